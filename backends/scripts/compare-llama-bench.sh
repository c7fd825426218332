#!/usr/bin/env bash
# Tessera's engine against llama.cpp's on the same GGUF files, thread counts and KV cache
# dtype, in one run: for each file, thread count and length, `tessera bench engine` and
# llama.cpp take turns (-r rounds), and the medians and their ratios are printed.
#
#   backends/scripts/compare-llama-bench.sh [-t "1 2"] [-r 3] [-p "128"] [-n 32] [-b 8] [-k f16] [-m bf16] FILE.gguf...
#
# For each length P of -p: prefill of a P-token prompt (llama-bench -p P), and decode of
# n tokens at batch 1 after P tokens of context (llama-bench -n n -d P; tessera
# `--context P --steps n`); where P + n + 1 passes the model's context (8192 for a P of
# 8192), the decode is measured after as many tokens as fit, for both engines, and its
# label names that depth. With -b B, also decode at batch B after the first length's
# context (llama-batched-bench -npp P -ntg n -npl B, its S_TG; tessera `--batch B`),
# tokens/s summed over the batch. -k sets both engines' KV cache dtype (llama.cpp's
# default is f16). -m sets Tessera's --matmul-precision (default f32).
#
# TESSERA: the tessera binary (default target/debug/tessera: kernels are built at
# opt-level 3 in every profile). LLAMA_BIN: the directory holding llama-bench and
# llama-batched-bench (default: on PATH; a llama.cpp build's bin directory, run with
# LD_LIBRARY_PATH set to it).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
threads="1 2"; rounds=3; lengths=128; gen=32; batch=""; kv=f16; precision=f32
while getopts "t:r:p:n:b:k:m:" o; do
  case $o in
    t) threads=$OPTARG;; r) rounds=$OPTARG;; p) lengths=$OPTARG;; n) gen=$OPTARG;;
    b) batch=$OPTARG;; k) kv=$OPTARG;; m) precision=$OPTARG;; *) exit 2;;
  esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { echo "usage: $0 [-t \"1 2\"] [-r 3] [-p \"128\"] [-n 32] [-b 8] [-k f16] [-m bf16] FILE.gguf..." >&2; exit 2; }
tessera=${TESSERA:-target/debug/tessera}
bin=${LLAMA_BIN:+$LLAMA_BIN/}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# One line per measurement: file threads metric engine tokens/s
for f in "$@"; do
  # The model's context, so that decode after P tokens fits it (`model info` reads GGUF).
  maxctx=$("$tessera" model info --json "$f" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["context"])' 2>/dev/null || true)
  for t in $threads; do
    for _ in $(seq "$rounds"); do
      first=1
      for p in $lengths; do
        d=$p
        if [ -n "$maxctx" ] && [ $((p + gen + 1)) -gt "$maxctx" ]; then d=$((maxctx - gen - 1)); fi
        batches=1
        if [ -n "$batch" ] && [ $first = 1 ]; then batches="1,$batch"; fi
        "$tessera" bench engine --model "$f" --threads "$t" --batch "$batches" --prompt-len "$p" \
          --context "$d" --steps "$gen" --kv-dtype "$kv" --matmul-precision "$precision" --json 2>/dev/null |
          python3 -c '
import json, sys
r = json.load(sys.stdin); f, t, p, depth = sys.argv[1:5]
print(f, t, "prefill" + p, "tessera", r["prefill"]["tokens_per_s"])
for d in r["decode"]:
    print(f, t, ("decode@" if d["batch"] == 1 else "batch%d@" % d["batch"]) + depth, "tessera", d["tokens_per_s"])
' "$f" "$t" "$p" "$d" >>"$out" || echo "tessera bench engine failed at $p tokens (run it alone to see why)" >&2
        "${bin}llama-bench" -m "$f" -t "$t" -p "$p" -n 0 -ctk "$kv" -ctv "$kv" -r 1 -o json 2>/dev/null |
          python3 -c 'import json,sys; r=json.load(sys.stdin)[0]; print(sys.argv[1], sys.argv[2], "prefill"+sys.argv[3], "llama.cpp", r["avg_ts"])' "$f" "$t" "$p" >>"$out" || echo "llama-bench failed at $p prompt tokens" >&2
        "${bin}llama-bench" -m "$f" -t "$t" -p 0 -n "$gen" -d "$d" -ctk "$kv" -ctv "$kv" -r 1 -o json 2>/dev/null |
          python3 -c 'import json,sys; r=json.load(sys.stdin)[0]; print(sys.argv[1], sys.argv[2], "decode@"+sys.argv[3], "llama.cpp", r["avg_ts"])' "$f" "$t" "$d" >>"$out" || echo "llama-bench failed at depth $d" >&2
        if [ -n "$batch" ] && [ $first = 1 ]; then
          ctx=$(( batch * (d + gen) + 64 ))
          "${bin}llama-batched-bench" -m "$f" -t "$t" -c "$ctx" -npp "$d" -ntg "$gen" -npl "$batch" \
            -ctk "$kv" -ctv "$kv" --output-format jsonl 2>/dev/null |
            python3 -c '
import json, sys
for line in sys.stdin:
    if line.startswith("{") and "speed_tg" in line:
        print(sys.argv[1], sys.argv[2], "batch%s@%s" % (sys.argv[4], sys.argv[3]), "llama.cpp", json.loads(line)["speed_tg"])
' "$f" "$t" "$d" "$batch" >>"$out" || echo "llama-batched-bench failed" >&2
        fi
        first=0
      done
    done
  done
done
python3 - "$out" "$gen" "$kv" "$precision" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print(f"tokens/s, medians of the rounds; decode: {sys.argv[2]} tokens after the context; KV cache {sys.argv[3]}; "
      f"Tessera's matmul precision {sys.argv[4]}")
print(f"{'model':36} {'threads':>7} {'measure':>14} {'tessera':>9} {'llama.cpp':>9} {'ratio':>6}")
for key in dict.fromkeys((r[0], r[1], r[2]) for r in rows):
    got = {e: [float(r[4]) for r in rows if (r[0], r[1], r[2]) == key and r[3] == e] for e in ("tessera", "llama.cpp")}
    if not all(got.values()):
        print(f"{key[0].split('/')[-1]:36} {key[1]:>7} {key[2]:>14}  (one engine gave no figure)")
        continue
    t, l = statistics.median(got["tessera"]), statistics.median(got["llama.cpp"])
    print(f"{key[0].split('/')[-1]:36} {key[1]:>7} {key[2]:>14} {t:9.1f} {l:9.1f} {t / l:6.2f}")
PY
