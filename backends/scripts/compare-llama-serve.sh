#!/usr/bin/env bash
# Serving against llama.cpp's llama-server on the same GGUF file and the same load,
# judged over many rounds: each round runs `tessera up TOPOLOGY` and then llama-server
# (2 threads, 8 parallel slots, continuous batching), one after the other, each under
# the same `tessera bench serve` arguments; prints every round's figures (wall time,
# output tok/s, TTFT and TPOT p50, each side's TPOT p99/p50 spread) and then the median
# over the rounds of each round's own ratios. One round's ratio moves with the machine's
# state between its two halves; the median over nine or more says where the engines
# stand.
#
# usage: backends/scripts/compare-llama-serve.sh [-n ROUNDS] TOPOLOGY GGUF [bench serve args]
#   e.g. -n 9 topology/examples/smollm2-cpu.toml ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
#        --concurrency 1 --requests 8 --isl 128 --osl 64 --warmup 2
#   TOPOLOGY's gateway must listen on 127.0.0.1:8100 (llama-server takes 8101).
#   env: LLAMA_BIN (required: the directory holding llama-server and its libraries, as a
#        llama.cpp CMake build leaves them in build/bin), TESSERA (default
#        target/release/tessera), OUT (the rounds' reports; default a fresh temporary
#        directory).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
rounds=9
if [ "${1:-}" = -n ]; then rounds=$2; shift 2; fi
[ $# -ge 2 ] || { echo "usage: $0 [-n ROUNDS] TOPOLOGY GGUF [bench serve args]" >&2; exit 2; }
topo=$1 gguf=$2
shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
bin=${TESSERA:-$here/target/release/tessera}
lb=${LLAMA_BIN:?set LLAMA_BIN to the directory holding llama-server}
out=${OUT:-$(mktemp -d)}
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
[ -x "$lb/llama-server" ] || { echo "no llama-server in $lb" >&2; exit 1; }
[ -f "$gguf" ] || { echo "no GGUF file at $gguf" >&2; exit 1; }
mkdir -p "$out"

wait_up() { # URL PID
    for _ in $(seq 1 240); do
        curl -sf "$1/health" > /dev/null 2>&1 && return 0
        kill -0 "$2" 2> /dev/null || return 1
        sleep 0.5
    done
    return 1
}

for r in $(seq 1 "$rounds"); do
    "$bin" up "$topo" > "$out/tessera-$r.log" 2>&1 &
    pid=$!
    if ! wait_up http://127.0.0.1:8100 "$pid"; then
        echo "round $r: tessera did not start (see $out/tessera-$r.log)" >&2
        kill -INT "$pid" 2> /dev/null || true
        exit 1
    fi
    "$bin" bench serve --url http://127.0.0.1:8100 --json "$@" > "$out/tessera-$r.json"
    kill -INT "$pid"
    wait "$pid" || true
    LD_LIBRARY_PATH="$lb" "$lb/llama-server" -m "$gguf" -t 2 -tb 2 -np 8 -c 32768 --port 8101 --host 127.0.0.1 \
        > "$out/llama-$r.log" 2>&1 &
    pid=$!
    if ! wait_up http://127.0.0.1:8101 "$pid"; then
        echo "round $r: llama-server did not start (see $out/llama-$r.log)" >&2
        kill "$pid" 2> /dev/null || true
        exit 1
    fi
    "$bin" bench serve --url http://127.0.0.1:8101 --json "$@" > "$out/llama-$r.json"
    kill "$pid"
    wait "$pid" || true
    python3 - "$out" "$r" <<'EOF'
import json, sys
out, r = sys.argv[1], sys.argv[2]
t, l = (json.load(open(f"{out}/{side}-{r}.json")) for side in ("tessera", "llama"))
spread = lambda d: d["tpot"]["p99_ms"] / d["tpot"]["p50_ms"]
print(f"round {r}: wall {t['duration_s']:.2f} / {l['duration_s']:.2f} s = {t['duration_s'] / l['duration_s']:.3f}; "
      f"tok/s {t['output_throughput_tok_s']:.1f} / {l['output_throughput_tok_s']:.1f}; "
      f"TTFT p50 {t['ttft']['p50_ms']:.0f} / {l['ttft']['p50_ms']:.0f} ms; "
      f"TPOT p50 {t['tpot']['p50_ms']:.1f} / {l['tpot']['p50_ms']:.1f} ms; "
      f"TPOT p99/p50 {spread(t):.2f} / {spread(l):.2f}; failed {t['requests_failed']} / {l['requests_failed']}")
EOF
done

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
pairs = [tuple(json.load(open(f"{out}/{side}-{r}.json")) for side in ("tessera", "llama")) for r in range(1, rounds + 1)]
med = lambda xs: statistics.median(xs)
spread = lambda d: d["tpot"]["p99_ms"] / d["tpot"]["p50_ms"]
rows = [
    ("wall time, ours / theirs", [t["duration_s"] / l["duration_s"] for t, l in pairs]),
    ("output tok/s, ours / theirs", [t["output_throughput_tok_s"] / l["output_throughput_tok_s"] for t, l in pairs]),
    ("TTFT p50, ours / theirs", [t["ttft"]["p50_ms"] / l["ttft"]["p50_ms"] for t, l in pairs]),
    ("TPOT p50, ours / theirs", [t["tpot"]["p50_ms"] / l["tpot"]["p50_ms"] for t, l in pairs]),
    ("TPOT p99/p50, ours", [spread(t) for t, _ in pairs]),
    ("TPOT p99/p50, theirs", [spread(l) for _, l in pairs]),
]
print(f"\nmedian over {rounds} rounds (each round's own ratio; min-max in brackets):")
for name, xs in rows:
    print(f"  {name:<30} {med(xs):.3f}  [{min(xs):.3f}-{max(xs):.3f}]")
failed = sum(t["requests_failed"] + l["requests_failed"] for t, l in pairs)
print(f"  requests failed: {failed}; reports in {out}")
EOF
