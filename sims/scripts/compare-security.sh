#!/usr/bin/env bash
# Serving throughput with the planes encrypted against in clear, side by side: the same
# two-host cluster (a prefill chip on h0, a decode chip on h1, their KV crossing over the
# transfer engine's tcp path, every request crossing the bus), once with
# `[security] mode = "off"` and once with `mode = "encrypt"` (host keys made with
# `tessera keys gen-host`). Each repeat runs both, in turn, under the same `bench serve`
# load; prints each repeat's output tok/s and their ratio, then the median ratio
# (encrypt / off).
#
# usage: sims/scripts/compare-security.sh [OUTDIR] [REPEATS]
#   env: TESSERA (the binary; default target/release/tessera), MODEL (default
#        builtin:small), CIPHER (default chacha20-poly1305), PORT (gateway port, default
#        8500), REQUESTS (default 100), CONCURRENCY (default 8), ISL (default 256),
#        OSL (default 64).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
repeats=${2:-9}
bin=${TESSERA:-$here/target/release/tessera}
model=${MODEL:-builtin:small}
cipher=${CIPHER:-chacha20-poly1305}
port=${PORT:-8500}
url="http://127.0.0.1:$port"
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
mkdir -p "$out/keys"
for host in h0 h1; do
    [ -f "$out/keys/$host.key" ] || "$bin" keys gen-host --name "$host" --out "$out/keys" > /dev/null 2>> "$out/keys.log"
done

topology() { # mode
    printf '[cluster]\nmodel = "%s"\n\n[gateway]\nlisten = "127.0.0.1:%s"\n\n' "$model" "$port"
    printf '[disagg]\ntransport = "tcp"\nmin_prompt_tokens = 16\n\n'
    printf '[security]\nmode = "%s"\ncipher = "%s"\nkeys_dir = "%s"\n\n' "$1" "$cipher" "$out/keys"
    printf '[[hosts]]\nname = "h0"\nbus = "127.0.0.1:%s"\n' $((port + 10))
    printf '[[hosts.chips]]\nid = "h0-p"\nkind = "cpu"\nbackend = "cpu"\nrole = "prefill"\nthreads = 1\n\n'
    printf '[[hosts]]\nname = "h1"\nbus = "127.0.0.1:%s"\n' $((port + 20))
    printf '[[hosts.chips]]\nid = "h1-d"\nkind = "cpu"\nbackend = "cpu"\nrole = "decode"\nthreads = 1\n'
}
for mode in off encrypt; do topology "$mode" > "$out/$mode.toml"; done

# shellcheck source=lib/serve-round.sh
. "$here/sims/scripts/lib/serve-round.sh"
run() { # mode repeat
    serve_round "$1" "$2" 2 -- --concurrency "${CONCURRENCY:-8}" --requests "${REQUESTS:-100}" \
        --isl "${ISL:-256}" --osl "${OSL:-64}"
}

for r in $(seq 1 "$repeats"); do
    for mode in off encrypt; do
        echo "repeat $r: security $mode" >&2
        run "$mode" "$r"
    done
done

python3 "$here/sims/scripts/lib/side_by_side.py" "$out" "$repeats" off encrypt
