#!/usr/bin/env bash
# The simulator beside the real cluster: runs `tessera up` on a topology (default: the
# embedded default, an emulated 910B prefilling for an emulated C500) disaggregated and
# `--colocated`, each under the same seeded open-loop workload with `tessera bench serve`,
# and simulates both with the matching scenarios; prints TTFT and TPOT p50/p99 measured
# and simulated, the error of each, and whether the simulator ranks the two setups as
# the measurements do.
#
# usage: sims/scripts/sim-vs-real.sh [OUTDIR] [REPEATS]
#   env: TESSERA (default target/release/tessera), REQUESTS (per run, default 200),
#        SCENARIO (disaggregated; default sims/scenarios/default-poisson.toml),
#        COLOCATED_SCENARIO (default sims/scenarios/default-colocated.toml),
#        TOPOLOGY (what `up` runs; default: the embedded default, which the scenarios name),
#        CALIBRATE (a chip id of TOPOLOGY: recalibrate its kind before every repeat, and
#        simulate each repeat with that repeat's calibration; KIND names the kind,
#        default `cpu`),
#        FROM_STEPS (a chip id of TOPOLOGY: trace every step the real runs serve and
#        simulate each run with its kind fitted to that run's own served steps,
#        `tessera calibrate --from-steps`; KIND as above). The chips' speed is then
#        taken from the runs being predicted, so what is compared is the simulator's
#        serving (queueing, batching, hand-offs, routing), not this machine's drift
#        between a calibration and the runs after it.
#        REPORT_ONLY=1: measure and simulate nothing; print the report of the runs
#        already in OUTDIR (an earlier run of this script with the same REPEATS).
# The scenario's rate, lengths and seed drive bench serve too. Measured figures are the
# median over REPEATS (default 3) runs of each setup, alternated; simulated figures the
# median over the repeats' simulations when CALIBRATE recalibrates each repeat (a shared
# machine's speed drifts by several percent over minutes: a calibration minutes away
# from the runs it predicts carries that drift into the comparison).
# Ranking: one setup ranks lower on a figure when the medians differ by more than the
# repeats' own noise (half the wider of the two setups' max-min spreads over the
# repeats); closer than that, the runs cannot tell the setups apart and the figure is a
# tie. The same rule ranks the simulated repeats, and the simulator ranks a figure as
# the measurements do when both name the same setup or both call it a tie.
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
repeats=${2:-3}
bin=${TESSERA:-$here/target/release/tessera}
requests=${REQUESTS:-200}
disagg=${SCENARIO:-$here/sims/scenarios/default-poisson.toml}
colocated=${COLOCATED_SCENARIO:-$here/sims/scenarios/default-colocated.toml}
topo=${TOPOLOGY:-}
[ -x "$bin" ] || { echo "no tessera binary at $bin (cargo build --release, or set TESSERA)" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
key() { sed -n "s/^$1 = \"\{0,1\}\([^\"]*\)\"\{0,1\}.*/\1/p" "$disagg" | head -1; }
rate=$(key rate_rps); isl=$(key isl); osl=$(key osl); seed=$(key seed)
log_filter=${TESSERA_LOG:-info}
[ -n "${FROM_STEPS:-}" ] && log_filter="$log_filter,tessera::steps=trace"
url=http://127.0.0.1:8000
[ -n "$topo" ] && url=http://$(sed -n 's/^listen = "\(.*\)"/\1/p' "$topo" | head -1)

measure() { # setup repeat
    local setup=$1 r=$2 pid flag=()
    [ "$setup" = colocated ] && flag=(--colocated)
    TESSERA_LOG=$log_filter "$bin" up ${topo:+"$topo"} "${flag[@]}" > "$out/up-$setup-$r.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
        curl -s "$url/health" | grep -q '"chips_up":2' && break
        sleep 0.5
    done
    "$bin" bench serve --url "$url" --rate "$rate" --requests "$requests" --isl "$isl" --osl "$osl" \
        --seed "$seed" --json > "$out/real-$setup-$r.json" || true
    kill -INT "$pid"
    wait "$pid" || true
}

# The simulated runs: the same requests (count, rate, lengths, seed), timed by the
# scenario's models or by the repeat's calibration (CALIBRATE) or each run's (FROM_STEPS),
# files in $out.
simulate() { # repeat
    local r=$1 cal setup scenario tmp
    for setup in disaggregated colocated; do
        scenario=$disagg
        [ "$setup" = colocated ] && scenario=$colocated
        cal=
        [ -n "${CALIBRATE:-}" ] && cal=cal-$r.toml
        [ -n "${FROM_STEPS:-}" ] && cal=cal-$setup-$r.toml
        tmp="$(dirname "$scenario")/.sim-vs-real-$setup.toml"
        sed "s/^requests = .*/requests = $requests/" "$scenario" > "$tmp"
        [ -n "$cal" ] && sed -i "s#^${KIND:-cpu} = .*#${KIND:-cpu} = \"$out/$cal\"#" "$tmp"
        "$bin" sim "$tmp" --json > "$out/sim-$setup-$r.json" 2> /dev/null
        rm -f "$tmp"
    done
}

[ -n "${REPORT_ONLY:-}" ] || for r in $(seq 1 "$repeats"); do
    if [ -n "${CALIBRATE:-}" ]; then
        echo "repeat $r: calibrating chip $CALIBRATE" >&2
        "$bin" calibrate ${topo:+--topology "$topo"} --chip "$CALIBRATE" --out "$out/cal-$r.toml" > "$out/cal-$r.log" 2>&1 ||
            { cat "$out/cal-$r.log" >&2; exit 1; }
    fi
    for setup in disaggregated colocated; do
        echo "repeat $r: $setup" >&2
        measure "$setup" "$r"
    done
    if [ -n "${FROM_STEPS:-}" ]; then
        # Each run's own steps: the machine's speed can move between the two runs.
        for setup in disaggregated colocated; do
            "$bin" calibrate ${topo:+--topology "$topo"} --chip "$FROM_STEPS" --from-steps "$out/up-$setup-$r.log" \
                --out "$out/cal-$setup-$r.toml" > "$out/cal-$setup-$r.log" 2>&1 ||
                { cat "$out/cal-$setup-$r.log" >&2; exit 1; }
        done
    fi
    if [ -n "${CALIBRATE:-}${FROM_STEPS:-}" ]; then
        simulate "$r"
    fi
done
[ -n "${REPORT_ONLY:-}${CALIBRATE:-}${FROM_STEPS:-}" ] || simulate 1

python3 - "$out" "$repeats" <<'EOF'
import json, os, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
rows = {}
def load(kind, setup):
    runs = []
    for r in range(1, repeats + 1):
        p = f"{out}/{kind}-{setup}-{r}.json"
        if os.path.exists(p) and os.path.getsize(p) > 0:
            runs.append(json.load(open(p)))
    return runs
series = {}
for setup in ["disaggregated", "colocated"]:
    runs, sims = load("real", setup), load("sim", setup)
    if not runs or not sims:
        sys.exit(f"{out}: no measured or no simulated {setup} report (real-{setup}-R.json, sim-{setup}-R.json)")
    for metric in ["ttft", "tpot"]:
        for q in ["p50_ms", "p99_ms"]:
            real = [run[metric][q] for run in runs if run.get(metric)]
            sim = [s[metric][q] for s in sims]
            series[(setup, metric, q)] = (real, sim)
            rows[(setup, metric, q)] = (statistics.median(real), statistics.median(sim))
    failed = [run["requests_failed"] for run in runs]
    print(f"{setup}: {len(runs)} real runs, failed {failed}; {len(sims)} simulated, failed {[s['failed'] for s in sims]}")
print(f"\n| setup | metric | measured ms (median of {repeats}) | simulated ms | error |")
print("|---|---|---:|---:|---:|")
for (setup, metric, q), (real, sim) in rows.items():
    print(f"| {setup} | {metric.upper()} {q[:3]} | {real:.1f} | {sim:.1f} | {(sim / real - 1):+.1%} |")
print()
def rank(d, c):
    """The lower setup, or a tie when the medians differ by less than the repeats' noise."""
    noise = max((max(x) - min(x)) / 2 for x in (d, c))
    gap = statistics.median(d) - statistics.median(c)
    if abs(gap) <= noise:
        return "tie", gap, noise
    return ("disaggregated" if gap < 0 else "colocated"), gap, noise
agree = 0
for metric in ["ttft", "tpot"]:
    for q in ["p50_ms", "p99_ms"]:
        d, c = series[("disaggregated", metric, q)], series[("colocated", metric, q)]
        real_rank, real_gap, real_noise = rank(d[0], c[0])
        sim_rank, sim_gap, sim_noise = rank(d[1], c[1])
        agree += real_rank == sim_rank
        same = "same" if real_rank == sim_rank else "DIFFERENT"
        print(f"{metric.upper()} {q[:3]}: lower measured: {real_rank} (gap {real_gap:+.2f} ms, noise {real_noise:.2f}); "
              f"lower simulated: {sim_rank} (gap {sim_gap:+.2f} ms, noise {sim_noise:.2f}) ({same})")
print(f"ranked as measured on {agree} of 4 figures")
print(f"\nraw reports: {out}")
EOF
