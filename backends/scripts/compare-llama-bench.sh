#!/usr/bin/env bash
# Tessera's engine against llama.cpp's on the same GGUF files and thread counts, in one
# run: for each file and thread count, `tessera bench engine` and `llama-bench` take
# turns (-r rounds), and the medians and their ratios are printed.
#
#   backends/scripts/compare-llama-bench.sh [-t "1 2"] [-r 3] [-p 128] [-n 32] FILE.gguf...
#
# TESSERA: the tessera binary (default target/debug/tessera: kernels are built at
# opt-level 3 in every profile). LLAMA_BENCH: llama.cpp's llama-bench (default: on PATH;
# shared/tools/build-llama-server.sh builds it). Prefill is a p-token prompt; decode is
# n tokens at batch 1 (tessera: `--steps n` after a p-token context).
set -euo pipefail
threads="1 2"; rounds=3; prompt=128; gen=32
while getopts "t:r:p:n:" o; do
  case $o in t) threads=$OPTARG;; r) rounds=$OPTARG;; p) prompt=$OPTARG;; n) gen=$OPTARG;; *) exit 2;; esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { echo "usage: $0 [-t \"1 2\"] [-r 3] [-p 128] [-n 32] FILE.gguf..." >&2; exit 2; }
tessera=${TESSERA:-target/debug/tessera}
llama=${LLAMA_BENCH:-llama-bench}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for f in "$@"; do
  for t in $threads; do
    for _ in $(seq "$rounds"); do
      "$tessera" bench engine --model "$f" --threads "$t" --batch 1 --prompt-len "$prompt" \
        --context "$prompt" --steps "$gen" --json 2>/dev/null |
        python3 -c 'import json,sys; r=json.load(sys.stdin); print(sys.argv[1], sys.argv[2], "tessera", r["prefill"]["tokens_per_s"], r["decode"][0]["tokens_per_s"])' "$f" "$t" >>"$out"
      "$llama" -m "$f" -t "$t" -p "$prompt" -n "$gen" -r 1 -o json 2>/dev/null |
        python3 -c 'import json,sys; rs=json.load(sys.stdin); pp=[r["avg_ts"] for r in rs if r["n_prompt"]>0]; tg=[r["avg_ts"] for r in rs if r["n_gen"]>0]; print(sys.argv[1], sys.argv[2], "llama.cpp", pp[0], tg[0])' "$f" "$t" >>"$out"
    done
  done
done
python3 - "$out" "$prompt" "$gen" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print(f"prefill {sys.argv[2]} tokens, decode {sys.argv[3]} tokens at batch 1; medians of the rounds, tokens/s")
print(f"{'model':40} {'threads':>7} {'prefill':>9} {'llama.cpp':>9} {'ratio':>6} {'decode':>8} {'llama.cpp':>9} {'ratio':>6}")
for key in dict.fromkeys((r[0], r[1]) for r in rows):
    med = lambda eng, col: statistics.median(float(r[col]) for r in rows if (r[0], r[1]) == key and r[2] == eng)
    tp, lp, td, ld = med("tessera", 3), med("llama.cpp", 3), med("tessera", 4), med("llama.cpp", 4)
    print(f"{key[0].split('/')[-1]:40} {key[1]:>7} {tp:9.1f} {lp:9.1f} {tp/lp:6.2f} {td:8.1f} {ld:9.1f} {td/ld:6.2f}")
PY
