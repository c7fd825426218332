#!/usr/bin/env bash
# Fair queuing on a real cluster: a light tenant's TTFT alone against beside a flooding
# tenant, side by side. The embedded default topology (or --colocated) with two tenants,
# `flood` and `light`, and a keys file; each repeat starts the cluster, runs the light
# tenant alone, then both at once (`bench serve --tenants`), and stops the cluster.
# Prints each repeat's light TTFT p50 alone and beside the flood, the flood's own p50
# (of the requests served: the flood's excess gets 429s), the requests of each refused,
# and the ratio beside/alone, then the median ratio (the issue's goal: 1.5 at most).
#
# usage: sims/scripts/compare-tenants.sh [OUTDIR] [REPEATS] [--colocated]
#   env: TESSERA (the binary; default target/release/tessera), PORT (gateway port,
#        default 8300; bus ports PORT-800 and up), LIGHT_RATE (default 2),
#        LIGHT_REQUESTS (default 40), FLOOD_CONCURRENCY (default 64),
#        FLOOD_REQUESTS (default 300), ISL (default 256), OSL (default 64),
#        DECODE_OVERFLOW (the topology's `[router] decode_overflow`: prefill-chips, the
#        default, or wait).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=lib/tenant-cluster.sh
. "$here/sims/scripts/lib/tenant-cluster.sh"
# out, repeats, colocated, bin, port, url; the default topology in $out (tenants below).
tenant_setup "$here" "$@"
printf '\n[[tenants]]\nname = "flood"\n\n[[tenants]]\nname = "light"\n' >> "$out/topology.toml"
rm -f "$out/keys.json" "$out/audit.log"
FLOOD_KEY=$("$bin" keys add --file "$out/keys.json" --tenant flood | tail -1)
LIGHT_KEY=$("$bin" keys add --file "$out/keys.json" --tenant light | tail -1)
export FLOOD_KEY LIGHT_KEY
light="[[tenants]]
name = \"light\"
key_env = \"LIGHT_KEY\"
rate = ${LIGHT_RATE:-2}
requests = ${LIGHT_REQUESTS:-40}
"
printf '%s' "$light" > "$out/light.toml"
printf '[[tenants]]\nname = "flood"\nkey_env = "FLOOD_KEY"\nconcurrency = %s\nrequests = %s\n\n%s' \
    "${FLOOD_CONCURRENCY:-64}" "${FLOOD_REQUESTS:-300}" "$light" > "$out/both.toml"

for r in $(seq 1 "$repeats"); do
    echo "repeat $r" >&2
    TESSERA_HOME="$out/home" "$bin" up "$out/topology.toml" "${colocated[@]}" > "$out/up-$r.log" 2>&1 &
    pid=$!
    wait_chips_up "$url"
    for load in light both; do
        "$bin" bench serve --url "$url" --tenants "$out/$load.toml" --isl "${ISL:-256}" --osl "${OSL:-64}" \
            --seed "$r" --json > "$out/$load-$r.json" || true
    done
    kill -INT "$pid"
    wait "$pid" || true
done

python3 - "$out" "$repeats" <<'PY'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
def row(load, r, tenant):
    """(TTFT p50 ms of the requests served, requests refused or failed), or None."""
    try:
        with open(f"{out}/{load}-{r}.json") as f:
            rep = {t["name"]: t for t in json.load(f)["tenants"]}[tenant]
        return rep["ttft"]["p50_ms"], rep["requests_failed"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
ratios = []
print(f"{'repeat':>6} {'light alone ms':>15} {'light beside ms':>16} {'light failed':>13} "
      f"{'flood ms':>9} {'flood failed':>13} {'beside/alone':>13}")
for r in range(1, repeats + 1):
    alone, beside, flood = row("light", r, "light"), row("both", r, "light"), row("both", r, "flood")
    if alone and beside and flood and alone[1] == 0:
        ratios.append(beside[0] / alone[0])
        print(f"{r:>6} {alone[0]:>15.1f} {beside[0]:>16.1f} {beside[1]:>13} {flood[0]:>9.1f} {flood[1]:>13} "
              f"{beside[0] / alone[0]:>13.2f}")
    else:
        print(f"{r:>6} a run failed (see {out}/up-{r}.log)")
if ratios:
    print(f"median light TTFT p50 beside/alone over {len(ratios)} repeats: {statistics.median(ratios):.2f}")
PY
