"""The per-round ratios of bench_connectivity's stack workloads to the residual, pooled over
runs, with a distribution-free confidence interval for their median.

    python3 tools/round_ratios.py [--target NAME=RATIO ...] LOG [LOG ...]

Each LOG is a bench_connectivity stderr (`round i/N, ms: residual 725.41, laurel 733.28, ...`
lines, then `stack12.train_step: 127.2 s with warm-up`). Within a round every variant runs once
beside the residual (round-robin, the order rotated per round), so a round's ratio
`variant / residual` cancels what drifts slower than a round. The rounds of every LOG are pooled
per workload and variant; the interval is the order-statistic one for the median (exact
binomial, 95%): it assumes independent rounds, which a machine whose load drifts within a run
only approximates.

With `--target laurel=1.05` the `stack12` row (the depth the targets are set at) says `met`
when the interval lies below the target, `missed` when above, `not shown` when it holds it.
"""

import math
import re
import statistics
import sys
from collections import defaultdict

ROUND = re.compile(r"round \d+/\d+, ms:(.*)")
WORKLOAD = re.compile(r"^(\S+): [0-9.]+ s with warm-up")
PAIR = re.compile(r"(\w+) ([0-9.]+)")


def median_interval(values, level=0.95):
    """(lower, upper) order statistics bracketing the median with at least `level` coverage."""
    n = len(values)
    ordered = sorted(values)
    # Largest k with P(Bin(n, 1/2) < k) <= (1 - level) / 2: then [x_(k), x_(n+1-k)] (1-based).
    tail = (1 - level) / 2
    cumulative, k = 0.0, 0
    while k < n:
        nxt = cumulative + math.comb(n, k) / 2**n
        if nxt > tail:
            break
        cumulative, k = nxt, k + 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def main(argv):
    targets = {}
    logs = []
    args = iter(argv)
    for arg in args:
        if arg == "--target":
            name, ratio = next(args).split("=")
            targets[name] = float(ratio)
        else:
            logs.append(arg)
    if not logs:
        sys.exit(__doc__)
    ratios = defaultdict(list)  # (workload, variant) -> per-round ratios
    runs = defaultdict(int)
    for log in logs:
        pending = []
        for line in open(log, encoding="utf-8", errors="replace"):
            found = ROUND.search(line)
            if found:
                pending.append(dict((k, float(v)) for k, v in PAIR.findall(found.group(1))))
                continue
            found = WORKLOAD.match(line)
            if found and pending:
                workload = found.group(1)
                runs[workload] += 1
                for times in pending:
                    for variant, ms in times.items():
                        if variant != "residual":
                            ratios[(workload, variant)].append(ms / times["residual"])
                pending = []
    print("| workload | variant | runs | rounds | median | 95% interval | target |")
    print("|---|---|---|---|---|---|---|")
    for (workload, variant), values in sorted(ratios.items()):
        lower, upper = median_interval(values)
        middle = statistics.median(values)
        verdict = ""
        if variant in targets and workload.startswith("stack12"):
            target = targets[variant]
            verdict = "met" if upper < target else "missed" if lower > target else "not shown"
            verdict = f"≤ {target:.2f}×: {verdict}"
        print(
            f"| {workload} | {variant} | {runs[workload]} | {len(values)} | {middle:.3f}× | "
            f"{lower:.3f}–{upper:.3f}× | {verdict} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
