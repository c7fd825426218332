#!/usr/bin/env bash
# N side-by-side serving runs (`serve-compare.sh`, Tessera and llama-server in turns
# under the same load), each ratio exact from that run's JSON, then their median and
# how many runs met a target. One run's ratio moves with the machine's state between
# the two halves of the run; several runs and their median say where the engines stand.
#
#   backends/scripts/serve-rounds.sh [-n 5] [-t 0.9] TOPOLOGY GGUF [bench serve args]
#
# e.g. -n 10 topo.toml bench-f16.gguf --concurrency 1 --requests 6 --isl 64 --osl 32 --warmup 2
# Per run: wall time ours / theirs and the ratio, TTFT and TPOT p50 in ms (ours / theirs:
# the TPOTs show which side ran in a slower state), our TPOT p99 / p50, failed requests.
# BIN and LLAMA_BIN as for serve-compare.sh; SERVE_COMPARE: its path (default
# ../shared/tools/serve-compare.sh beside this checkout).
set -euo pipefail
runs=5; target=0.9
while getopts "n:t:" o; do
  case $o in
    n) runs=$OPTARG;; t) target=$OPTARG;; *) exit 2;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || { echo "usage: $0 [-n runs] [-t target] TOPOLOGY GGUF [bench serve args]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
compare=${SERVE_COMPARE:-$here/../../../shared/tools/serve-compare.sh}
[ -x "$compare" ] || { echo "serve-compare.sh not found at $compare (set SERVE_COMPARE)" >&2; exit 2; }
# `report run I DIR` prints one run; `report summary TARGET DIR...` the median over them.
report() {
  python3 - "$@" <<'PY'
import json, statistics, sys
def load(d):
    return json.load(open(d + "/tessera.json")), json.load(open(d + "/llama.json"))
mode, *args = sys.argv[1:]
if mode == "run":
    i, d = args
    t, l = load(d)
    print(f"run {i}: wall {t['duration_s']:.2f} / {l['duration_s']:.2f} s = {t['duration_s'] / l['duration_s']:.3f}"
          f"  TTFT p50 {t['ttft']['p50_ms']:.0f} / {l['ttft']['p50_ms']:.0f}"
          f"  TPOT p50 {t['tpot']['p50_ms']:.1f} / {l['tpot']['p50_ms']:.1f}"
          f"  ours p99/p50 {t['tpot']['p99_ms'] / t['tpot']['p50_ms']:.2f}"
          f"  failed {t['requests_failed']} / {l['requests_failed']}")
else:
    target, *dirs = args
    runs = [load(d) for d in dirs]
    ratios = [t["duration_s"] / l["duration_s"] for t, l in runs]
    failed = sum(t["requests_failed"] + l["requests_failed"] for t, l in runs)
    met = sum(r <= float(target) for r in ratios)
    print(f"wall ratio over {len(ratios)} runs: median {statistics.median(ratios):.3f}, "
          f"{min(ratios):.3f}-{max(ratios):.3f}; {met} of {len(ratios)} at or under {target}; "
          f"{failed} requests failed")
PY
}
dirs=()
for i in $(seq "$runs"); do
  log=$("$compare" "$@" 2>&1) || { echo "run $i failed:" >&2; echo "$log" >&2; exit 1; }
  dir=$(sed -n 's/^raw results: //p' <<<"$log")
  [ -f "$dir/tessera.json" ] && [ -f "$dir/llama.json" ] || { echo "run $i left no results:" >&2; echo "$log" >&2; exit 1; }
  dirs+=("$dir")
  report run "$i" "$dir"
done
report summary "$target" "${dirs[@]}"
