#!/usr/bin/env bash
# Compares the router's placement policies on a topology of unlike chips: the same
# multi-turn workload and the same generated Mooncake-format trace, at the same rates
# and seeds, against the topology under each policy, and against its first chip alone
# (the oracle's hit rate: one chip that held everything). Prints TTFT p50/p90,
# throughput, the cluster's prefix hit rate and the busiest chip's busy time over the
# mean, per policy and workload.
#
# usage: sims/scripts/compare-router-policies.sh [OUTDIR] [REPEATS]
#   env: TESSERA (the binary; default target/release/tessera), TOPOLOGY (default
#        topology/examples/unlike-kv.toml, gateway on 127.0.0.1:8100), MT_RATE (multi-turn
#        conversations started per second, default 3), TRACE_RATE (trace requests per
#        second, default 4), POLICIES (default "kv-aware round-robin least-loaded dynamo").
# Each repeat runs every policy once, in turn; the table shows the median over repeats.
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
repeats=${2:-3}
bin=${TESSERA:-$here/target/release/tessera}
topo=${TOPOLOGY:-$here/topology/examples/unlike-kv.toml}
mt_rate=${MT_RATE:-3}
trace_rate=${TRACE_RATE:-4}
policies=${POLICIES:-kv-aware round-robin least-loaded dynamo}
url=$(sed -n 's/^listen = "\(.*\)"/http:\/\/\1/p' "$topo" | head -1)
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
[ -n "$url" ] || { echo "$topo sets no [gateway] listen address" >&2; exit 1; }
mkdir -p "$out"

"$bin" bench trace-gen --requests 80 --rate "$trace_rate" --reuse 0.6 --isl uniform:520-720 --osl 16 --seed 7 \
    --out "$out/trace.jsonl" 2> "$out/trace-gen.txt"
# The oracle: the first host with its first chip only.
awk '/^\[\[hosts\]\]/{h++} h>=2{exit} /^\[\[hosts.chips\]\]/{c++} c>=2{exit} {print}' "$topo" > "$out/topo-oracle.toml"

run() { # policy repeat
    local policy=$1 r=$2 pid chips
    [ "$policy" = oracle ] || sed "s/^policy = .*/policy = \"$policy\"/" "$topo" > "$out/topo-$policy.toml"
    "$bin" up "$out/topo-$policy.toml" --in-process > "$out/up-$policy-$r.log" 2>&1 &
    pid=$!
    chips=$(grep -c '^\[\[hosts.chips\]\]' "$out/topo-$policy.toml")
    for _ in $(seq 1 240); do
        curl -s "$url/health" | grep -q "\"chips_up\":$chips" && break
        sleep 0.5
    done
    "$bin" bench serve --url "$url" --multi-turn 16 --turns 4 --isl 40 --osl 24 --rate "$mt_rate" --seed 1 \
        --warmup 2 --json > "$out/mt-$policy-$r.json" || true
    "$bin" bench serve --url "$url" --trace "$out/trace.jsonl" --seed 1 --json > "$out/trace-$policy-$r.json" || true
    kill -INT "$pid"
    wait "$pid" || true
}

for r in $(seq 1 "$repeats"); do
    for policy in oracle $policies; do
        echo "repeat $r: $policy" >&2
        run "$policy" "$r"
    done
done

python3 - "$out" "$repeats" oracle $policies <<'EOF'
import json, os, statistics, sys
out, repeats, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def figures(path):
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    r = json.load(open(path))
    chips = (r.get("server") or {}).get("chips", [])
    prompt = sum(c["prompt_tokens"] for c in chips)
    busy = [c["busy_s"] for c in chips if c["busy_s"] > 0]
    ttft = r.get("ttft") or {}
    return {
        "ok": r["requests_ok"], "failed": r["requests_failed"],
        "ttft_p50": ttft.get("p50_ms", float("nan")), "ttft_p90": ttft.get("p90_ms", float("nan")),
        "out_tok_s": r["output_throughput_tok_s"],
        "hit": sum(c["reused_tokens"] for c in chips) / prompt if prompt else float("nan"),
        "busy": max(busy) / statistics.mean(busy) if busy else float("nan"),
    }

for workload, name in [("mt", "multi-turn"), ("trace", "Mooncake-format trace")]:
    print(f"\n{name} (median of {repeats})")
    print(f"{'policy':<13}{'ok':>5}{'failed':>7}{'TTFT p50':>10}{'TTFT p90':>10}{'out tok/s':>10}{'hit rate':>9}{'of oracle':>10}{'busiest/mean':>13}")
    oracle = None
    for p in policies:
        runs = [f for f in (figures(f"{out}/{workload}-{p}-{r}.json") for r in range(1, repeats + 1)) if f]
        if not runs:
            continue
        m = {k: statistics.median(f[k] for f in runs) for k in runs[0]}
        if p == "oracle":
            oracle = m["hit"]
        share = f"{m['hit'] / oracle:.1%}" if oracle else "-"
        print(f"{p:<13}{m['ok']:>5.0f}{m['failed']:>7.0f}{m['ttft_p50']:>10.1f}{m['ttft_p90']:>10.1f}"
              f"{m['out_tok_s']:>10.1f}{m['hit']:>9.3f}{share:>10}{m['busy']:>13.2f}")
print(f"\nraw reports: {out}")
EOF
