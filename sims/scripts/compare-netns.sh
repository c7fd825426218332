#!/usr/bin/env bash
# Hosts on distinct network stacks against one loopback, side by side: three network
# namespaces on one bridge (made here, removed on exit), as tests/netns.rs builds them.
#
#   bus       `tessera bench bus` on loopback, then from namespace a to namespace b
#             (`--peer-via "ip netns exec B"`): RTT p50 and round trips/s, bus and
#             plain TCP, each repeat both in turn.
#   transfer  `tessera bench transfer` the same way: engine tcp and raw socket GB/s.
#   serve     a cluster of three `tessera node`s (prefill on a with the gateway, decode
#             on b and c, KV over tcp, hosts named in the namespaces' hosts files) under
#             one `bench serve` load, three ways per repeat: direct; through a
#             `tessera bench relay` per host at 0 ms (the relay's own cost); and through
#             relays adding DELAY_MS to every byte each way (nftables in each namespace
#             sends what goes to a peer through the peer's relay; where the kernel has
#             the netem qdisc it could do the same). Prints output tok/s and median
#             ratios over the repeats.
#
# usage: sims/scripts/compare-netns.sh [OUTDIR] [REPEATS] [PARTS]
#   PARTS: comma-separated, default bus,transfer,serve. Needs root, iproute2 and, for
#   serve, nftables (`nft`).
#   env: TESSERA (the binary; default target/release/tessera), MODEL (default
#        builtin:small), DELAY_MS (default 5), REQUESTS (default 48), CONCURRENCY
#        (default 8), ISL (default 128), OSL (default 32), BYTES (transfer, default
#        64MiB), MESSAGES (bus, default 10000).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
repeats=${2:-9}
parts=${3:-bus,transfer,serve}
bin=${TESSERA:-$here/target/release/tessera}
model=${MODEL:-builtin:small}
delay=${DELAY_MS:-5}
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "network namespaces need root" >&2; exit 1; }
command -v ip > /dev/null || { echo "no \`ip\` (apt-get install iproute2)" >&2; exit 1; }
mkdir -p "$out"

# The namespaces: ${p}a ${p}b ${p}c on a bridge in ${p}br, 10.214.S.1-3, and this
# namespace at 10.214.S.254 (the relays listen on .11-.13 here).
p=tnb$(($$ % 100000))
s=$(($$ % 250))
addr() { echo "10.214.$s.$(($1 + 1))"; }
relay_addr() { echo "10.214.$s.$(($1 + 11))"; }
hosts=(a b c)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -INT "$pid" 2> /dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2> /dev/null || true; done
    ip link del "${p}r" 2> /dev/null || true
    for ns in "${hosts[@]}" br; do
        ip netns del "$p$ns" 2> /dev/null || true
        rm -rf "/etc/netns/$p$ns"
    done
}
trap cleanup EXIT
ip netns add "${p}br"
ip -n "${p}br" link add br0 type bridge
ip -n "${p}br" link set br0 up
hosts_file="127.0.0.1 localhost"$'\n'
for i in 0 1 2; do hosts_file+="$(addr $i) tessera-${hosts[$i]}"$'\n'; done
for i in 0 1 2; do
    ns=$p${hosts[$i]}
    ip netns add "$ns"
    ip -n "${p}br" link add "v${hosts[$i]}" type veth peer name eth0 netns "$ns"
    ip -n "${p}br" link set "v${hosts[$i]}" master br0 up
    ip -n "$ns" addr add "$(addr $i)/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    mkdir -p "/etc/netns/$ns"
    printf '%s' "$hosts_file" > "/etc/netns/$ns/hosts"
done
ip link add "${p}r" type veth peer name vr netns "${p}br"
ip -n "${p}br" link set vr master br0 up
ip addr add "10.214.$s.254/24" dev "${p}r"
ip link set "${p}r" up
in_a=(ip netns exec "${p}a")
via_b="ip netns exec ${p}b"

summary() { # part: median of each repeat's ratios, from $out/<part>-<repeat>-{loopback,netns}.json
    python3 - "$out" "$repeats" "$1" << 'EOF'
import json, statistics, sys
out, repeats, part = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(r, where):
    try:
        with open(f"{out}/{part}-{r}-{where}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
rows = [(load(r, "loopback"), load(r, "netns")) for r in range(1, repeats + 1)]
rows = [(a, b) for a, b in rows if a and b]
if not rows:
    sys.exit(f"{part}: no repeat finished (see {out})")
if part == "bus":
    fig = {"bus RTT p50 us": lambda x: x["bus"]["rtt_p50_us"], "tcp RTT p50 us": lambda x: x["tcp"]["rtt_p50_us"],
           "bus round trips/s": lambda x: x["bus"]["round_trips_per_s"],
           "tcp round trips/s": lambda x: x["tcp"]["round_trips_per_s"]}
else:
    fig = {"engine tcp GB/s": lambda x: x["tcp"]["median_gb_per_s"],
           "raw tcp GB/s": lambda x: x["raw_tcp"]["median_gb_per_s"]}
print(f"{part}: medians over {len(rows)} repeats, loopback vs across namespaces")
print(f"{'figure':<20} {'loopback':>12} {'namespaces':>12} {'ns/loopback':>12}")
for name, get in fig.items():
    lo = statistics.median(get(a) for a, _ in rows)
    ns = statistics.median(get(b) for _, b in rows)
    ratio = statistics.median(get(b) / get(a) for a, b in rows)
    print(f"{name:<20} {lo:>12.2f} {ns:>12.2f} {ratio:>12.3f}")
EOF
}

if [[ ,$parts, == *,bus,* ]]; then
    for r in $(seq 1 "$repeats"); do
        echo "repeat $r: bench bus, loopback then namespaces" >&2
        "$bin" bench bus --messages "${MESSAGES:-10000}" --json > "$out/bus-$r-loopback.json"
        "${in_a[@]}" "$bin" bench bus --messages "${MESSAGES:-10000}" --json \
            --bind "$(addr 0)" --peer-bind "$(addr 1)" --peer-via "$via_b" > "$out/bus-$r-netns.json"
    done
    summary bus
fi

if [[ ,$parts, == *,transfer,* ]]; then
    for r in $(seq 1 "$repeats"); do
        echo "repeat $r: bench transfer, loopback then namespaces" >&2
        "$bin" bench transfer --bytes "${BYTES:-64MiB}" --runs 3 --json > "$out/transfer-$r-loopback.json"
        "${in_a[@]}" "$bin" bench transfer --bytes "${BYTES:-64MiB}" --runs 3 --json \
            --peer-bind "$(addr 1)" --peer-via "$via_b" > "$out/transfer-$r-netns.json"
    done
    summary transfer
fi

if [[ ,$parts, == *,serve,* ]]; then
    command -v nft > /dev/null || { echo "serve needs nftables' \`nft\` (apt-get install nftables)" >&2; exit 1; }
    topo=$out/netns.toml
    {
        printf '[cluster]\nname = "netns"\nmodel = "%s"\n\n' "$model"
        printf '[disagg]\nmin_prompt_tokens = 16\ntransport = "tcp"\n\n[security]\nmode = "off"\n\n'
        printf '[gateway]\nhost = "tessera-a"\nlisten = "%s:8000"\n' "$(addr 0)"
        for h in a b c; do
            role=decode
            [ $h = a ] && role=prefill
            printf '\n[[hosts]]\nname = "tessera-%s"\nbus = "tessera-%s:7400"\n' $h $h
            printf '[[hosts.chips]]\nid = "%s-chip"\nkind = "cpu"\nbackend = "cpu"\nrole = "%s"\nthreads = 1\n' $h $role
        done
    } > "$topo"
    url="http://$(addr 0):8000"
    for i in 0 1 2; do ip addr add "$(relay_addr $i)/24" dev "${p}r"; done

    relay_rules() { # on|off: route each namespace's traffic for a peer through the peer's relay
        for i in 0 1 2; do
            ns=$p${hosts[$i]}
            ip netns exec "$ns" nft delete table ip tessera_delay 2> /dev/null || true
            [ "$1" = on ] || continue
            rules=$'table ip tessera_delay {\n chain out {\n  type nat hook output priority -100\n'
            for j in 0 1 2; do
                [ $j = $i ] || rules+="  ip daddr $(addr $j) counter dnat to $(relay_addr $j)"$'\n'
            done
            printf '%s }\n}\n' "$rules" | ip netns exec "$ns" nft -f -
        done
    }
    serve_round() { # mode repeat [relay delay ms]
        local mode=$1 r=$2 round=()
        if [ $# -gt 2 ]; then
            for i in 0 1 2; do
                "$bin" bench relay --listen "$(relay_addr $i)" --to "$(addr $i)" --ports 7400,7401,7402 \
                    --delay-ms "$3" >> "$out/relay-$mode-$r.log" 2>&1 &
                round+=($!)
            done
            relay_rules on
        else
            relay_rules off
        fi
        for h in a b c; do
            ip netns exec "$p$h" "$bin" node --host "tessera-$h" --topology "$topo" > "$out/node-$h-$mode-$r.log" 2>&1 &
            round+=($!)
        done
        pids=("${round[@]}")
        for _ in $(seq 1 240); do
            curl -s "$url/health" | grep -q '"chips_up":3' && break
            sleep 0.5
        done
        "$bin" bench serve --url "$url" --seed "$r" --warmup 4 --concurrency "${CONCURRENCY:-8}" \
            --requests "${REQUESTS:-48}" --isl "${ISL:-128}" --osl "${OSL:-32}" --json > "$out/$mode-$r.json" || true
        if [ $# -gt 2 ]; then
            # What crossed the relays: connections each namespace sent through them.
            for h in a b c; do
                ip netns exec "$p$h" nft list table ip tessera_delay | grep -o 'packets [0-9]*' | awk -v h=$h \
                    '{ n += $2 } END { printf "host %s: %d connections through the relays\n", h, n }'
            done >> "$out/relay-$mode-$r.log"
        fi
        # Nodes first, then their relays.
        for pid in "${round[@]:${#round[@]}-3}" "${round[@]:0:${#round[@]}-3}"; do
            kill -INT "$pid" 2> /dev/null || true
            wait "$pid" 2> /dev/null || true
        done
        pids=()
    }
    for r in $(seq 1 "$repeats"); do
        echo "repeat $r: serve direct, through relays at 0 ms, through relays at $delay ms" >&2
        serve_round direct "$r"
        serve_round relay0 "$r" 0
        serve_round "relay$delay" "$r" "$delay"
    done
    python3 "$here/sims/scripts/lib/side_by_side.py" "$out" "$repeats" direct relay0
    python3 "$here/sims/scripts/lib/side_by_side.py" "$out" "$repeats" direct "relay$delay"
fi
