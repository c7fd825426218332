#!/usr/bin/env bash
# Weighted fair queuing on a real cluster: two tenants, `gold` (weight 2) and `silver`
# (weight 1), both offering far more than the cluster serves. The embedded default
# topology (or --colocated) with the two tenants and a keys file; each repeat starts
# the cluster, runs both loads at once (`bench serve --tenants`, closed loop), and reads
# every chip's `tessera_chip_tenant_service_seconds` (the chip time fair queuing
# charges each tenant) after a warm-up and again MEASURE_S seconds later. Prints each
# repeat's split of the chips' time over that window, then the median gold:silver ratio
# (the weights ask for 2).
#
# usage: sims/scripts/compare-weights.sh [OUTDIR] [REPEATS] [--colocated]
#   env: TESSERA (the binary; default target/release/tessera), PORT (gateway port,
#        default 8300; bus ports PORT-800 and up), CONCURRENCY (each tenant's, default
#        32), WARMUP_S (default 15), MEASURE_S (default 60), ISL (default 256),
#        OSL (default 64), DECODE_OVERFLOW (`[router] decode_overflow`, as in
#        compare-tenants.sh).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=lib/tenant-cluster.sh
. "$here/sims/scripts/lib/tenant-cluster.sh"
# out, repeats, colocated, bin, port, url; the default topology in $out (tenants below).
tenant_setup "$here" "$@"
printf '\n[[tenants]]\nname = "gold"\nweight = 2\n\n[[tenants]]\nname = "silver"\nweight = 1\n' \
    >> "$out/topology.toml"
rm -f "$out/keys.json" "$out/audit.log"
GOLD_KEY=$("$bin" keys add --file "$out/keys.json" --tenant gold | tail -1)
SILVER_KEY=$("$bin" keys add --file "$out/keys.json" --tenant silver | tail -1)
export GOLD_KEY SILVER_KEY
for t in gold silver; do
    key=$(echo "$t" | tr a-z A-Z)_KEY
    printf '[[tenants]]\nname = "%s"\nkey_env = "%s"\nconcurrency = %s\nrequests = 100000\n\n' \
        "$t" "$key" "${CONCURRENCY:-32}"
done > "$out/both.toml"

# Each tenant's chip seconds, summed over chips.
service() {
    curl -s "$url/metrics" | awk -F'[{}]' '/^tessera_chip_tenant_service_seconds\{/ {
        split($2, labels, ","); for (i in labels) if (labels[i] ~ /^tenant=/) { t = labels[i]; gsub(/tenant=|"/, "", t) }
        split($3, v, " "); sum[t] += v[1] } END { for (t in sum) print t, sum[t] }'
}

for r in $(seq 1 "$repeats"); do
    echo "repeat $r" >&2
    TESSERA_HOME="$out/home" "$bin" up "$out/topology.toml" "${colocated[@]}" > "$out/up-$r.log" 2>&1 &
    pid=$!
    wait_chips_up "$url"
    "$bin" bench serve --url "$url" --tenants "$out/both.toml" --isl "${ISL:-256}" --osl "${OSL:-64}" \
        --seed "$r" --timeout-s 60 > "$out/bench-$r.log" 2>&1 &
    load=$!
    sleep "${WARMUP_S:-15}"
    service > "$out/before-$r.txt"
    sleep "${MEASURE_S:-60}"
    service > "$out/after-$r.txt"
    kill "$load" 2>/dev/null || true
    wait "$load" 2>/dev/null || true
    kill -INT "$pid"
    wait "$pid" || true
done

python3 - "$out" "$repeats" <<'PY'
import statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
def read(path):
    try:
        with open(path) as f:
            return {t: float(v) for t, v in (line.split() for line in f if line.strip())}
    except (OSError, ValueError):
        return {}
ratios = []
print(f"{'repeat':>6} {'gold chip s':>12} {'silver chip s':>14} {'gold share':>11} {'gold:silver':>12}")
for r in range(1, repeats + 1):
    before, after = read(f"{out}/before-{r}.txt"), read(f"{out}/after-{r}.txt")
    gold = after.get("gold", 0.0) - before.get("gold", 0.0)
    silver = after.get("silver", 0.0) - before.get("silver", 0.0)
    if gold > 0 and silver > 0:
        ratios.append(gold / silver)
        print(f"{r:>6} {gold:>12.1f} {silver:>14.1f} {gold / (gold + silver):>11.1%} {gold / silver:>12.2f}")
    else:
        print(f"{r:>6} no service measured (see {out}/up-{r}.log, {out}/bench-{r}.log)")
if ratios:
    print(f"median gold:silver chip time over {len(ratios)} repeats: {statistics.median(ratios):.2f} (weights: 2)")
PY
