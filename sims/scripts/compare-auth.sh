#!/usr/bin/env bash
# Serving throughput with tenancy on against off, side by side: the same one-host
# cluster, once open (no keys file) and once with a keys file and a tenant whose quotas
# (requests/min, tokens/min, sequences in flight, max_tokens) are all set but do not
# bind, so every request pays the key check and the quota accounting. Each repeat runs
# both, in turn, under the same `bench serve` load; prints each repeat's output tok/s
# and their ratio, then the median ratio (on / off).
#
# usage: sims/scripts/compare-auth.sh [OUTDIR] [REPEATS]
#   env: TESSERA (the binary; default target/release/tessera), MODEL (default
#        builtin:small), PORT (gateway port, default 8100), REQUESTS (default 200),
#        CONCURRENCY (default 8), ISL (default 128), OSL (default 64).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
repeats=${2:-9}
bin=${TESSERA:-$here/target/release/tessera}
model=${MODEL:-builtin:small}
port=${PORT:-8100}
url="http://127.0.0.1:$port"
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
mkdir -p "$out"

base() {
    printf '[cluster]\nmodel = "%s"\n\n[gateway]\nlisten = "127.0.0.1:%s"\n%s\n' "$model" "$port" "$1"
    printf '[[hosts]]\nname = "h0"\nbus = "127.0.0.1:%s"\n\n' $((port + 10))
    printf '[[hosts.chips]]\nid = "h0-cpu0"\nkind = "cpu"\nbackend = "cpu"\nrole = "both"\nthreads = 2\n\n'
}
base "" > "$out/off.toml"
rm -f "$out/keys.json" "$out/audit.log"
key=$("$bin" keys add --file "$out/keys.json" --tenant bench)
{
    base "keys_file = \"$out/keys.json\""
    printf '[[tenants]]\nname = "bench"\n[tenants.limits]\nrequests_per_min = 1000000\n'
    printf 'tokens_per_min = 1000000000\nmax_concurrent = 1024\nmax_tokens = 4096\n'
} > "$out/on.toml"

# shellcheck source=lib/serve-round.sh
. "$here/sims/scripts/lib/serve-round.sh"
run() { # mode repeat
    local auth=()
    [ "$1" = on ] && auth=(--api-key "$key")
    serve_round "$1" "$2" 1 --in-process -- --concurrency "${CONCURRENCY:-8}" --requests "${REQUESTS:-200}" \
        --isl "${ISL:-128}" --osl "${OSL:-64}" "${auth[@]}"
}

for r in $(seq 1 "$repeats"); do
    for mode in off on; do
        echo "repeat $r: tenancy $mode" >&2
        run "$mode" "$r"
    done
done

python3 "$here/sims/scripts/lib/side_by_side.py" "$out" "$repeats" off on
