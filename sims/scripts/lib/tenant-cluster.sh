# Sourced by the tenancy measurement scripts (compare-tenants.sh, compare-weights.sh).

# tenant_setup HERE [OUTDIR] [REPEATS] [--colocated]: the scripts' shared arguments and
# environment. Sets out (default: a new temporary folder), repeats (default 9),
# colocated (an array: `--colocated` or empty), bin ($TESSERA, default the release
# build), port ($PORT, default 8300) and url; refuses a missing binary; writes
# $out/topology.toml (see tenant_topology).
tenant_setup() {
    local here=$1
    shift
    out=${1:-$(mktemp -d)}
    repeats=${2:-9}
    colocated=()
    if [ "${3:-}" = --colocated ]; then colocated=(--colocated); fi
    bin=${TESSERA:-$here/target/release/tessera}
    port=${PORT:-8300}
    url="http://127.0.0.1:$port"
    [ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
    mkdir -p "$out"
    tenant_topology "$here" "$port" "$out"
}

# tenant_topology HERE PORT OUT: writes OUT/topology.toml, the embedded default topology
# with its gateway on PORT, its buses on PORT-800 and up, a keys file (keys.json
# beside it) and, when $DECODE_OVERFLOW is set, that `[router] decode_overflow`; the
# caller appends its [[tenants]].
tenant_topology() {
    local here=$1 port=$2 out=$3
    local bus=$((port - 800))
    sed -e "s/127.0.0.1:8000/127.0.0.1:$port/" -e "s/127.0.0.1:7400/127.0.0.1:$bus/" \
        -e "s/127.0.0.1:7410/127.0.0.1:$((bus + 10))/" -e "s/127.0.0.1:7401/127.0.0.1:$((bus + 1))/" \
        -e "s/127.0.0.1:7402/127.0.0.1:$((bus + 2))/" -e "s/127.0.0.1:7411/127.0.0.1:$((bus + 11))/" \
        -e "s/127.0.0.1:7412/127.0.0.1:$((bus + 12))/" \
        -e 's/^max_inflight_requests = \(.*\)$/max_inflight_requests = \1\nkeys_file = "keys.json"/' \
        -e "s/^decode_overflow = .*/decode_overflow = \"${DECODE_OVERFLOW:-prefill-chips}\"/" \
        "$here/topology/default.toml" > "$out/topology.toml"
}

# wait_chips_up URL: waits (up to 2 minutes) until the cluster's two chips are up.
wait_chips_up() {
    for _ in $(seq 1 240); do
        curl -s "$1/health" | grep -q '"chips_up":2' && return 0
        sleep 0.5
    done
}
