#!/usr/bin/env python3
"""Writes the generated scenarios (a topology this size is data, not something to write
by hand): chips of several kinds, eight of one kind per host, each kind in one role,
under one open-loop workload on a 7B-class model.

usage: sims/scripts/gen-fleet.py
  rewrites sims/scenarios/fleet/fleet-{1000,32,64}.toml (the speed benchmarks) and
  sims/scenarios/splitwise/*.toml (Splitwise's iso-cost comparison) and
  sims/scenarios/solver/*.toml (the pools `tessera solve` picks from) and
  sims/scenarios/parallel/*.toml (Splitwise's comparison on Llama-2-70B, each host's 8
  chips one tensor-parallel instance)
"""
import os
import sys

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "scenarios", "fleet")

# (kind, role, chips): compute-rich kinds prefill, bandwidth-rich ones decode, the
# H200 does both.
FLEET_1000 = [
    ("nvidia-h100", "prefill", 160),
    ("ascend-910b", "prefill", 160),
    ("nvidia-h200", "both", 120),
    ("nvidia-a100", "decode", 200),
    ("metax-c500", "decode", 200),
    ("cambricon-mlu370", "decode", 160),
]
# The solver's benchmark: 64 chips of 4 kinds, each kind's role left to the solver.
FLEET_64 = [
    ("nvidia-h100", "both", 16),
    ("ascend-910b", "both", 16),
    ("nvidia-a100", "both", 16),
    ("metax-c500", "both", 16),
]
FLEET_32 = [
    ("nvidia-h100", "prefill", 8),
    ("ascend-910b", "prefill", 8),
    ("nvidia-a100", "decode", 8),
    ("metax-c500", "decode", 8),
]


LLAMA_7B = ("Llama-2-7B", "llama-2-7b")
LLAMA_70B = ("Llama-2-70B", "llama-2-70b")


def scenario(
    name, fleet, rate, duration_s, about, out=OUT, isl="normal:1024,256", osl="normal:256,64", model=LLAMA_7B, tp=1
):
    """`tp` > 1: each host's chips are instances of `tp` chips (one stage each)."""
    chips = sum(n for _, _, n in fleet)
    kinds = len(fleet)
    lines = [
        f"# {about}",
        f"# {chips} chips of {kinds} kinds, 8 per host; written by sims/scripts/gen-fleet.py.",
        f"# Run it with `tessera sim sims/scenarios/{os.path.basename(out)}/{name}.toml`.",
        "seed = 1",
        "topology_toml = '''",
        "[cluster]",
        f'name = "{name}"',
        f"# {model[0]}'s shape (config.json only), f16 weights and KV.",
        f'model = "../../models/{model[1]}"',
        'dtype = "f16"',
        'kv_dtype = "f16"',
        "",
        "[gateway]",
        'host = "h0"',
        "max_inflight_requests = 65536",
        "",
        "[router]",
        "max_queued_requests = 65536",
        "max_waiting_requests = 65536",
    ]
    host = 0
    instances = []
    for kind, role, n in fleet:
        for first in range(0, n, 8):
            lines += ["", "[[hosts]]", f'name = "h{host}"', f'bus = "127.0.{host // 200}.{host % 200 + 1}:7000"']
            for c in range(first, min(first + 8, n)):
                lines += [
                    "",
                    "[[hosts.chips]]",
                    f'id = "{kind}-{c}"',
                    f'kind = "{kind}"',
                    'backend = "cpu"',
                    f'role = "{role}"',
                    "max_batch_tokens = 2048",
                    "max_batch_seqs = 256",
                ]
            members = [f"{kind}-{c}" for c in range(first, min(first + 8, n))]
            for i in range(0, len(members) - tp + 1, tp) if tp > 1 else []:
                ids = ", ".join(f'"{m}"' for m in members[i : i + tp])
                at = sum(1 for x in instances if x.startswith(f'id = "{kind}-'))
                instances += ["", "[[instances]]", f'id = "{kind}-tp{tp}-{at}"', f"chips = [{ids}]", f"tp = {tp}"]
            host += 1
    lines += instances
    lines += [
        "'''",
        "",
        "[workload]",
        'arrivals = "poisson"',
        f"rate_rps = {rate}",
        f"duration_s = {duration_s}",
        f'isl = "{isl}"',
        f'osl = "{osl}"',
        "",
        "[slo]",
        "ttft_ms = 1000",
        "tpot_ms = 50",
        "",
        "[network]",
        "kv_bandwidth_gbs = 25.0",
        "kv_latency_us = 10",
        "",
    ]
    with open(os.path.join(out, f"{name}.toml"), "w") as f:
        f.write("\n".join(lines))


os.makedirs(OUT, exist_ok=True)
scenario(
    "fleet-1000",
    FLEET_1000,
    200.0,
    3600,
    "One simulated hour of 1,000 mixed chips at 200 requests/s (~1,024-token prompts, ~256-token answers): the simulator's speed benchmark.",
)
scenario(
    "fleet-32",
    FLEET_32,
    64.0,
    300,
    "Five simulated minutes of 32 mixed chips at 64 requests/s: the simulator's small-cluster speed benchmark.",
)
scenario(
    "fleet-64",
    FLEET_64,
    64.0,
    60,
    "One simulated minute of 64 chips of 4 kinds at 64 requests/s: the solver's benchmark (`tessera solve`).",
)

# Splitwise (ISCA'24): H100 prefill + A100 decode against all-H100 and all-A100 at equal
# cost, on its conversation workload (prompts ~1,020 tokens, answers ~129). Splitwise
# served Llama-70B and BLOOM-176B with 8-way tensor parallelism per DGX; a chip here
# holds a whole model, so a 7B-class model stands in (docs/how-to/plan-fleet.md, "Against Splitwise").
# Equal cost at the catalog's prices (H100 = 2.15 x A100, Splitwise's own ratio):
SPLITWISE = os.path.join(HERE, "..", "scenarios", "splitwise")
os.makedirs(SPLITWISE, exist_ok=True)
for name, fleet, about in [
    ("all-a100", [("nvidia-a100", "both", 43)], "All A100: 43 chips, $220.16/h."),
    ("all-h100", [("nvidia-h100", "both", 20)], "All H100: 20 chips, $220.20/h."),
    (
        "h100-prefill-a100-decode",
        [("nvidia-h100", "prefill", 6), ("nvidia-a100", "decode", 30)],
        "Splitwise-HA: 6 H100 prefill + 30 A100 decode, $219.66/h.",
    ),
]:
    scenario(
        name,
        fleet,
        160.0,
        120,
        "Splitwise's iso-cost comparison. " + about,
        out=SPLITWISE,
        isl="normal:1020,400",
        osl="normal:129,60",
    )

# The solver's pools: every chip of the equal-cost options above, each kind's role and
# count left to `tessera solve` (each chip starts as `both`).
SOLVER = os.path.join(HERE, "..", "scenarios", "solver")
os.makedirs(SOLVER, exist_ok=True)
scenario(
    "founding-pool",
    [("ascend-910b", "both", 9), ("metax-c500", "both", 8)],
    30.0,
    120,
    "The founding comparison's chips for `tessera solve`: 9 Ascend 910B and 8 MetaX C500 (each alone ~$36/h) under its workload.",
    out=SOLVER,
)
scenario(
    "splitwise-pool",
    [("nvidia-h100", "both", 20), ("nvidia-a100", "both", 43)],
    200.0,
    120,
    "Splitwise's chips for `tessera solve`: 20 H100 and 43 A100 (each alone ~$220/h) under its conversation workload.",
    out=SOLVER,
    isl="normal:1020,400",
    osl="normal:129,60",
)

# Splitwise's own setting: Llama-2-70B at 8-way tensor parallelism, each host's 8 chips
# one instance (a DGX), at equal cost on the same workload. The model does not fit one
# 80 GB chip, so these are the scenarios where a chip cannot be a replica.
PARALLEL = os.path.join(HERE, "..", "scenarios", "parallel")
os.makedirs(PARALLEL, exist_ok=True)
for name, fleet, about in [
    ("70b-all-a100", [("nvidia-a100", "both", 88)], "All A100: 11 instances of 8, $450.3/h."),
    ("70b-all-h100", [("nvidia-h100", "both", 40)], "All H100: 5 instances of 8, $440.4/h."),
    (
        "70b-h100-prefill-a100-decode",
        [("nvidia-h100", "prefill", 16), ("nvidia-a100", "decode", 48)],
        "Splitwise-HA: 2 H100 instances prefill + 6 A100 instances decode, $421.9/h.",
    ),
]:
    scenario(
        name,
        fleet,
        20.0,
        120,
        "Splitwise's iso-cost comparison on Llama-2-70B, 8-way tensor parallel. " + about,
        out=PARALLEL,
        isl="normal:1020,400",
        osl="normal:129,60",
        model=LLAMA_70B,
        tp=8,
    )
scenario(
    "70b-pool",
    [("nvidia-h100", "both", 40), ("nvidia-a100", "both", 88)],
    20.0,
    120,
    "The 70B comparison's chips for `tessera solve`: 5 H100 and 11 A100 instances of 8 (each alone ~$445/h).",
    out=PARALLEL,
    isl="normal:1020,400",
    osl="normal:129,60",
    model=LLAMA_70B,
    tp=8,
)
scenario(
    "70b-llama3-pool",
    [("nvidia-h100", "both", 40), ("nvidia-a100", "both", 88)],
    45.0,
    120,
    "The 70B pool on Llama-3-70B's shape (a 128k vocabulary): 5 H100 and 11 A100 instances of 8 for `tessera solve`.",
    out=PARALLEL,
    isl="normal:1020,400",
    osl="normal:129,60",
    model=("Llama-3-70B", "llama-3-70b"),
    tp=8,
)
