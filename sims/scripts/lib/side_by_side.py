"""Run by the side-by-side serving scripts (compare-auth.sh, compare-security.sh):
usage: side_by_side.py OUT REPEATS BASE OTHER

Reads OUT/{BASE,OTHER}-{repeat}.json (`tessera bench serve --json`), prints each repeat's
output tok/s under both and their ratio (a failed or missing run is said, not counted),
then the median ratio OTHER / BASE."""
import json
import statistics
import sys

out, repeats, base, other = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def tok_s(mode, r):
    try:
        with open(f"{out}/{mode}-{r}.json") as f:
            rep = json.load(f)
        return rep["output_throughput_tok_s"] if rep["requests_failed"] == 0 else None
    except (OSError, ValueError, KeyError):
        return None


ratio = f"{other}/{base}"
ratios = []
print(f"{'repeat':>6} {base + ' tok/s':>14} {other + ' tok/s':>14} {ratio:>14}")
for r in range(1, repeats + 1):
    a, b = tok_s(base, r), tok_s(other, r)
    if a and b:
        ratios.append(b / a)
        print(f"{r:>6} {a:>14.1f} {b:>14.1f} {b / a:>14.3f}")
    else:
        print(f"{r:>6} a run failed (see {out}/up-*-{r}.log)")
if ratios:
    print(f"median {ratio} over {len(ratios)} repeats: {statistics.median(ratios):.3f}")
