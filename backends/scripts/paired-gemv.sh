#!/usr/bin/env bash
# Batch-1 decode steps' linear layers, ours against llama.cpp's ggml, in turns in one
# process (paired-gemv.c): the two sides of each pair run within ~100 ms of each other,
# so a machine whose memory bandwidth drifts between states cannot favour either, as it
# can between the two halves of `compare-llama-bench.sh` or `serve-compare.sh`.
#
#   backends/scripts/paired-gemv.sh [STEPS [THREADS [HIDDEN KV_DIM FFN LAYERS VOCAB]]] [-v]
#
# Defaults: 100 steps, 2 threads, the `bench` preset's shapes (0.92B f16 weights, 1.84
# GB per step). -v prints every pair. LLAMA_BIN: the directory build-llama-server.sh
# prints (its ggml libraries); LLAMA_SRC: llama.cpp's source tree (ggml's headers;
# default: the one that script unpacks beside LLAMA_BIN). Our kernel library is
# target/release/libtessera_kernels_cpu.so, brought up to date first.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
lb=${LLAMA_BIN:?set LLAMA_BIN (see build-llama-server.sh)}
src=${LLAMA_SRC:-$( (ls -d "$lb"/../llama_cpp_python-*/vendor/llama.cpp 2>/dev/null || true) | tail -1)}
[ -n "$src" ] && [ -f "$src/ggml/include/ggml.h" ] || { echo "ggml headers not found: set LLAMA_SRC to llama.cpp's source tree" >&2; exit 2; }
lib=$root/target/release
(cd "$root" && cargo build -q --release -p tessera-kernels-cpu >&2)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -O2 -o "$out/paired-gemv" "$here/paired-gemv.c" -I"$src/ggml/include" -I"$root/backends/include" \
  -L"$lb" -lggml -lggml-base -lggml-cpu -L"$lib" -ltessera_kernels_cpu -Wl,-rpath,"$lb:$lib"
"$out/paired-gemv" "$@"
