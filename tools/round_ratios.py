"""The per-round ratios of bench_connectivity's stack workloads to the residual, pooled over
runs, with an interval over the runs for the target verdicts.

    python3 tools/round_ratios.py [--target NAME=RATIO ...] [--rule runs|every-run] LOG [LOG ...]
    python3 -m doctest tools/round_ratios.py     # its own checks

Each LOG is a bench_connectivity stderr (`round i/N, ms: residual 725.41, laurel 733.28, ...`
lines, then `stack12.train_step: 127.2 s with warm-up`). Within a round every variant runs once
beside the residual, so a round's ratio `variant / residual` cancels what drifts slower than a
round. Per workload and variant the table gives:

* the pooled rounds' median with its order-statistic interval (exact binomial, 95%; with five
  rounds or fewer no pair of order statistics reaches 95% and it is the whole range, with less
  coverage). It treats every round as independent, which they are
  not: the machine's speed drifts within a run and differs between runs, so this interval is
  too narrow for a verdict and is only descriptive;
* each run's median, and their mean with a Student-t 95% interval (`k` runs, `k - 1` degrees of
  freedom): the runs are the independent replicates, the rounds within one are not.

With `--target laurel=1.05` the `stack12` row (the depth the targets are set at) says `met`
when the runs' interval lies below the target, `missed` when it lies above, `not shown`
otherwise (and with fewer than three runs). `--rule every-run` gives the verdicts of the rule
used until 2026-11-28 instead: `met` when the pooled rounds' interval and every run's median lie
below the target, `missed` when all lie above. Its every-run half only gets stricter as runs are
added (the largest of `k` medians can only grow), so more runs can turn `met` into `not shown`
and never back, and the chance of `met` tends to zero as runs are added.

The runs' interval answers for the variant's typical ratio, not for every run (a single run can
land past a target the interval clears), each target on its own (no correction for judging
several), and takes the runs as independent (runs of different sessions may not be).

    python3 tools/round_ratios.py [--target ...] --window A LOG ... --window B LOG ... [...]

The runs of one window of time are not independent either: on a shared machine the ratios
shift between windows (by 0.03 within one session, 2026-11-28) by more than the runs of one
window spread. `--window LABEL` puts the LOGs after it in that window; with windows given, each
window's replicate is the mean of its runs' medians, the verdict takes the windows as the
replicates (at least three; Student-t over the windows) and a column gives their mean and
interval. Take windows far enough apart that the machine's state can change between them
(tens of minutes, or other sessions) and the same binary in each.
"""

import math
import re
import statistics
import sys
from collections import defaultdict

ROUND = re.compile(r"round \d+/\d+, ms:(.*)")
WORKLOAD = re.compile(r"^(\S+): [0-9.]+ s with warm-up")
PAIR = re.compile(r"(\w+) ([0-9.]+)")

# Student's t, two-sided 95% (the 0.975 quantile), for 1 to 30 degrees of freedom; beyond 30
# the value for 30 (slightly wider than the exact quantile).
T_975 = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
]


def median_interval(values, level=0.95):
    """(lower, upper) order statistics bracketing the median with at least `level` coverage
    (the whole range, with less, where no pair reaches it).

    >>> median_interval(list(range(1, 21)))  # 20 values: x_(6) and x_(15)
    (6, 15)
    >>> median_interval([3, 1, 2])  # too few for 95%: the whole range
    (1, 3)
    """
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


def run_interval(medians):
    """(mean, lower, upper): the runs' medians' mean with its Student-t 95% interval, or None
    for fewer than two runs.

    >>> [round(v, 4) for v in run_interval([1.0, 1.1, 1.2])]  # sd 0.1, t(2) = 4.303
    [1.1, 0.8516, 1.3484]
    >>> run_interval([1.0]) is None
    True
    """
    k = len(medians)
    if k < 2:
        return None
    mean = statistics.fmean(medians)
    half = T_975[min(k - 1, len(T_975)) - 1] * statistics.stdev(medians) / math.sqrt(k)
    return mean, mean - half, mean + half


def window_means(medians, windows):
    """The mean of each window's runs' medians, in the order the windows first appear.

    >>> window_means([1.0, 1.5, 2.0, 3.0, 3.5], ["A", "A", "B", "C", "C"])
    [1.25, 2.0, 3.25]
    """
    grouped = defaultdict(list)
    for median, window in zip(medians, windows):
        grouped[window].append(median)
    return [statistics.fmean(values) for values in grouped.values()]


def interval_text(interval):
    """`mean× [lower–upper×]` of `run_interval`'s answer, or a dash for none.

    >>> interval_text((1.1, 1.05, 1.15))
    '1.100× [1.050–1.150×]'
    >>> interval_text(None)
    '—'
    """
    if interval is None:
        return "—"
    return "{:.3f}× [{:.3f}–{:.3f}×]".format(*interval)


def verdict(target, medians, pooled_interval, rule="runs"):
    """`met`, `missed` or `not shown` for a target ratio.

    >>> runs = [1.06, 1.08, 1.07, 1.16, 1.07, 1.09, 1.08, 1.06]
    >>> verdict(1.15, runs, (1.07, 1.09))  # the runs' interval, 1.057-1.111, is under 1.15
    'met'
    >>> verdict(1.15, runs, (1.07, 1.09), rule="every-run")  # one run's median is over
    'not shown'
    >>> verdict(1.05, [1.08, 1.09, 1.10], (1.07, 1.11))  # 1.065-1.115
    'missed'
    >>> verdict(1.05, [1.000, 1.001], (0.99, 1.01))  # two runs are too few, however close
    'not shown'
    """
    if rule == "every-run":
        lower, upper = pooled_interval
        if upper < target and max(medians) < target:
            return "met"
        if lower > target and min(medians) > target:
            return "missed"
        return "not shown"
    interval = run_interval(medians)
    if interval is None or len(medians) < 3:
        return "not shown"
    _, lower, upper = interval
    if upper < target:
        return "met"
    if lower > target:
        return "missed"
    return "not shown"


def main(argv):
    targets = {}
    logs = []  # (window or None, path)
    window = None
    rule = "runs"
    args = iter(argv)
    for arg in args:
        if arg == "--target":
            name, _, ratio = next(args, "").partition("=")
            if not name or not ratio:
                sys.exit("--target takes NAME=RATIO, e.g. --target laurel=1.05")
            targets[name] = float(ratio)
        elif arg == "--window":
            window = next(args, "")
            if not window:
                sys.exit("--window takes a label, then that window's LOGs")
        elif arg == "--rule":
            rule = next(args, "")
            if rule not in ("runs", "every-run"):
                sys.exit("--rule takes runs or every-run")
        else:
            logs.append((window, arg))
    if not logs:
        sys.exit(__doc__)
    windowed = any(window is not None for window, _ in logs)
    if windowed and any(window is None for window, _ in logs):
        sys.exit("with --window, every LOG comes after a --window LABEL")
    ratios = defaultdict(list)  # (workload, variant) -> per-round ratios
    run_medians = defaultdict(list)  # (workload, variant) -> each run's median ratio
    run_windows = defaultdict(list)  # (workload, variant) -> each run's window
    for window, log in logs:
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
                    run_windows[(workload, variant)].append(window)
                pending = []
    header = (
        "| workload | variant | rounds | rounds' median [95%, rounds as independent] "
        "| runs' medians | runs' mean [95%, t] |"
    )
    if windowed:
        header += " windows' means | windows' mean [95%, t] |"
    print(header + " target |")
    print("|---" * (8 if windowed else 6) + "|---|")
    for (workload, variant), values in sorted(ratios.items()):
        lower, upper = median_interval(values)
        middle = statistics.median(values)
        medians = run_medians[(workload, variant)]
        over_runs = interval_text(run_interval(medians))
        replicates = medians
        by_window = ""
        if windowed:
            replicates = window_means(medians, run_windows[(workload, variant)])
            by_window = " {} | {} |".format(
                ", ".join(f"{m:.3f}" for m in replicates),
                interval_text(run_interval(replicates)),
            )
        said = ""
        if variant in targets and workload.startswith("stack12"):
            target = targets[variant]
            said = f"≤ {target:.2f}×: {verdict(target, replicates, (lower, upper), rule)}"
        each = ", ".join(f"{m:.3f}" for m in medians)
        print(
            f"| {workload} | {variant} | {len(values)} | {middle:.3f}× [{lower:.3f}–{upper:.3f}×] "
            f"| {each} | {over_runs} |{by_window} {said} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
