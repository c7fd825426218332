#!/usr/bin/env bash
# The router's policies on multi-turn chats that share system prompts, on real clusters
# and in the simulator side by side: CHATS chats of TURNS turns, each opening with one of
# SYSTEM_PROMPTS system prompts of SYSTEM_WORDS words, each turn extending the last prompt and
# its answer, CONCURRENCY chats under way at once. Each setup is a topology of unlike
# chips:
#   default-colocated  the embedded default, `--colocated` (an Ascend 910B and a MetaX
#                      C500, KV blocks of 16 and 32 tokens), 2 chips
#   unlike-kv          topology/examples/unlike-kv.toml: 2 H100s and 2 910Bs, colocated
#   unlike-disagg      topology/examples/unlike-disagg.toml: 2 910Bs prefill, 2 C500s
#                      decode
# Each repeat runs every policy once, in turn, with the same chats (`bench serve
# --multi-turn`, the repeat as its seed); `tessera sim` runs a scenario of the same
# topology and workload per policy. Prints, per setup and policy, TTFT p50/p90 and the
# run's wall time, real (median over repeats) and simulated; kv-aware over round-robin
# as the median of each repeat's ratio; and whether the real and simulated rankings
# (by wall time, by TTFT p90) agree: every pair of policies more than 5% apart on both
# sides in the same order.
#
# usage: sims/scripts/compare-multiturn.sh [OUTDIR] [REPEATS]
#   env: TESSERA (the binary; default target/release/tessera), SETUPS (default
#        "default-colocated unlike-kv unlike-disagg"), POLICIES (default "kv-aware
#        round-robin least-loaded dynamo"), CHATS (default 12), TURNS (4), CONCURRENCY
#        (4), SYSTEM_PROMPTS (3), SYSTEM_WORDS (220), ISL (user message words, 30), OSL (answer
#        tokens, 32).
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
repeats=${2:-3}
bin=${TESSERA:-$here/target/release/tessera}
setups=${SETUPS:-default-colocated unlike-kv unlike-disagg}
policies=${POLICIES:-kv-aware round-robin least-loaded dynamo}
chats=${CHATS:-12} turns=${TURNS:-4} concurrency=${CONCURRENCY:-4}
groups=${SYSTEM_PROMPTS:-3} system_words=${SYSTEM_WORDS:-220} isl=${ISL:-30} osl=${OSL:-32}
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
mkdir -p "$out"
. "$here/sims/scripts/lib/serve-round.sh"

workload=(--multi-turn "$chats" --turns "$turns" --prefix-groups "$groups" --prefix-words "$system_words"
    --isl "$isl" --osl "$osl" --concurrency "$concurrency")

for setup in $setups; do
    colocated=false up=(--in-process)
    case $setup in
        default-colocated) topo=$here/topology/default.toml colocated=true up=(--in-process --colocated) ;;
        unlike-kv) topo=$here/topology/examples/unlike-kv.toml ;;
        unlike-disagg) topo=$here/topology/examples/unlike-disagg.toml ;;
        *) echo "unknown setup $setup (default-colocated, unlike-kv, unlike-disagg)" >&2; exit 1 ;;
    esac
    url=$(sed -n 's/^listen = "\(.*\)"/http:\/\/\1/p' "$topo" | head -1)
    chips=$(grep -c '^\[\[hosts.chips\]\]' "$topo")
    for policy in $policies; do
        sed "s/^policy = .*/policy = \"$policy\"/" "$topo" > "$out/$setup-$policy.toml"
        cat > "$out/$setup-$policy.scenario.toml" <<EOF
seed = 1
topology = "$setup-$policy.toml"
colocated = $colocated

[workload]
conversations = $chats
turns = $turns
concurrency = $concurrency
isl = "$isl"
osl = "$osl"
prefix_groups = $groups
prefix_words = $system_words

[slo]
ttft_ms = 2000
tpot_ms = 200
EOF
        "$bin" sim "$out/$setup-$policy.scenario.toml" --json > "$out/sim-$setup-$policy.json" 2> "$out/sim-$setup-$policy.log"
    done
    for r in $(seq 1 "$repeats"); do
        for policy in $policies; do
            echo "$setup, repeat $r: $policy" >&2
            serve_round "$setup-$policy" "$r" "$chips" "${up[@]}" -- "${workload[@]}"
        done
    done
done

python3 - "$out" "$repeats" "$setups" "$policies" <<'EOF'
import json, os, statistics, sys
out, repeats, setups, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()

def load(path):
    return json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) > 0 else None

def real(setup, policy, r):
    rep = load(f"{out}/{setup}-{policy}-{r}.json")
    if not rep or rep["requests_failed"] or not rep.get("ttft"):
        return None
    return rep["ttft"]["p50_ms"], rep["ttft"]["p90_ms"], rep["duration_s"]

def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")

def ranking(figures, i):
    return [p for p, _ in sorted(figures.items(), key=lambda kv: kv[1][i])]

# Two policies within 5% of each other on one side are a tie there: only pairs apart by
# more on both sides can disagree.
TIE = 0.05

def disagreements(reals, sims, i):
    out = []
    for n, a in enumerate(policies):
        for b in policies[n + 1:]:
            r = (reals[a][i] - reals[b][i]) / max(min(reals[a][i], reals[b][i]), 1e-9)
            s = (sims[a][i] - sims[b][i]) / max(min(sims[a][i], sims[b][i]), 1e-9)
            if abs(r) > TIE and abs(s) > TIE and (r > 0) != (s > 0):
                out.append(f"{a} vs {b}")
    return out

for setup in setups:
    print(f"\n{setup}: real, median of {repeats} | simulated")
    print(f"{'policy':<14} {'TTFT p50':>9} {'p90 ms':>7} {'wall s':>7} | {'TTFT p50':>9} {'p90 ms':>7} {'wall s':>7}")
    reals, sims = {}, {}
    for policy in policies:
        runs = [real(setup, policy, r) for r in range(1, repeats + 1)]
        reals[policy] = tuple(median([x[i] if x else None for x in runs]) for i in range(3))
        s = load(f"{out}/sim-{setup}-{policy}.json")
        sims[policy] = (s["ttft"]["p50_ms"], s["ttft"]["p90_ms"], s["simulated_s"]) if s and s.get("ttft") else (float("nan"),) * 3
        failed = sum(1 for x in runs if x is None)
        note = f"  ({failed} of {repeats} runs failed or lost requests)" if failed else ""
        print(f"{policy:<14} {reals[policy][0]:9.1f} {reals[policy][1]:7.1f} {reals[policy][2]:7.2f} | "
              f"{sims[policy][0]:9.1f} {sims[policy][1]:7.1f} {sims[policy][2]:7.2f}{note}")
    if "kv-aware" in policies and "round-robin" in policies:
        ratio = lambda i: median([
            (a[i] / b[i]) if a and b else None
            for a, b in ((real(setup, "kv-aware", r), real(setup, "round-robin", r)) for r in range(1, repeats + 1))
        ])
        sim = lambda i: sims["kv-aware"][i] / sims["round-robin"][i]
        print(f"kv-aware / round-robin, real (median of each repeat's ratio): TTFT p50 {ratio(0):.2f}, "
              f"p90 {ratio(1):.2f}, wall {ratio(2):.2f}; simulated: {sim(0):.2f}, {sim(1):.2f}, {sim(2):.2f}")
    for name, i in (("wall", 2), ("TTFT p90", 1)):
        a, b = ranking(reals, i), ranking(sims, i)
        differ = disagreements(reals, sims, i)
        verdict = "agree" if not differ else "differ on " + ", ".join(differ)
        print(f"ranking by {name}: real {' < '.join(a)}; simulated {' < '.join(b)}: {verdict} "
              f"(pairs within {TIE:.0%} on either side count as ties)")
EOF
