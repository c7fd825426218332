# Sourced by the side-by-side serving scripts (compare-auth.sh, compare-security.sh).

# serve_round MODE REPEAT CHIPS [UP_FLAGS...] -- [BENCH_FLAGS...]: starts
# `$bin up $out/MODE.toml UP_FLAGS` (log: $out/up-MODE-REPEAT.log), waits (up to 2
# minutes) until CHIPS chips are up at $url, runs `bench serve` with BENCH_FLAGS and the
# repeat as its seed into $out/MODE-REPEAT.json (a failed bench leaves no report, which
# the summary says), and stops the cluster by its pid.
serve_round() {
    local mode=$1 r=$2 chips=$3 pid up=()
    shift 3
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        up+=("$1")
        shift
    done
    [ $# -gt 0 ] && shift
    "$bin" up "$out/$mode.toml" "${up[@]}" > "$out/up-$mode-$r.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
        curl -s "$url/health" | grep -q "\"chips_up\":$chips" && break
        sleep 0.5
    done
    "$bin" bench serve --url "$url" --seed "$r" --warmup 4 "$@" --json > "$out/$mode-$r.json" || true
    kill -INT "$pid"
    wait "$pid" || true
}
