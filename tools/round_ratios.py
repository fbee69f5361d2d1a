"""The per-round ratios of bench_connectivity's stack workloads to the residual, pooled over
runs, with a distribution-free interval for their median and each run's own median.

    python3 tools/round_ratios.py [--target NAME=RATIO ...] LOG [LOG ...]

Each LOG is a bench_connectivity stderr (`round i/N, ms: residual 725.41, laurel 733.28, ...`
lines, then `stack12.train_step: 127.2 s with warm-up`). Within a round every variant runs once
beside the residual, so a round's ratio `variant / residual` cancels what drifts slower than a
round. The rounds of every LOG are pooled per workload and variant; the interval is the
order-statistic one for the median (exact binomial, 95%; with five rounds or fewer no pair of
order statistics reaches 95% and it is the whole range). It treats the rounds as independent,
which they are not quite: the machine's speed drifts within a run and differs between runs.

With `--target laurel=1.05` the `stack12` row (the depth the targets are set at) says `met` when
the pooled interval and every run's median lie below the target, `missed` when they all lie
above, and `not shown` otherwise.
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
            name, _, ratio = next(args, "").partition("=")
            if not name or not ratio:
                sys.exit("--target takes NAME=RATIO, e.g. --target laurel=1.05")
            targets[name] = float(ratio)
        else:
            logs.append(arg)
    if not logs:
        sys.exit(__doc__)
    ratios = defaultdict(list)  # (workload, variant) -> per-round ratios
    run_medians = defaultdict(list)  # (workload, variant) -> each run's median ratio
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
                run = defaultdict(list)
                for times in pending:
                    for variant, ms in times.items():
                        if variant != "residual":
                            run[variant].append(ms / times["residual"])
                for variant, values in run.items():
                    ratios[(workload, variant)].extend(values)
                    run_medians[(workload, variant)].append(statistics.median(values))
                pending = []
    print("| workload | variant | rounds | median | 95% interval | runs' medians | target |")
    print("|---|---|---|---|---|---|---|")
    for (workload, variant), values in sorted(ratios.items()):
        lower, upper = median_interval(values)
        middle = statistics.median(values)
        medians = run_medians[(workload, variant)]
        verdict = ""
        if variant in targets and workload.startswith("stack12"):
            target = targets[variant]
            if upper < target and max(medians) < target:
                verdict = "met"
            elif lower > target and min(medians) > target:
                verdict = "missed"
            else:
                verdict = "not shown"
            verdict = f"≤ {target:.2f}×: {verdict}"
        each = ", ".join(f"{m:.3f}" for m in medians)
        print(
            f"| {workload} | {variant} | {len(values)} | {middle:.3f}× | "
            f"{lower:.3f}–{upper:.3f}× | {each} | {verdict} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
