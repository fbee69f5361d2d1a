"""Per-kernel time of each variant's timed train step, from the profile stages of
tools/gpu/measure.sh (`cuda-profile`, `profile-groups`, `profile-product`: CubeCL's
`| 1.2ms | name` lines).

    python3 tools/gpu/profile_summary.py OUT_DIR/profile.log [TOP]

Each bench_connectivity run there times one round (`--runs 1`) after its warm-ups; CubeCL
prints a step's kernels and then a summary table that ends in `| Total`, so the kernel lines
between the last warm-up and the round's line split at those tables, one step per variant in
the round's order. CubeCL prints a table at every sync, so a step that syncs more than once
would shift the split: a run whose tables do not number its variants is reported, not summed.
Kernels of one full name are summed; TOP (default 16) rows per variant.
"""

import re
import sys
from collections import defaultdict

UNIT_MS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}
KERNEL = re.compile(r"^\| ([0-9.]+)(ns|µs|us|ms|s)\s*\| (.*)$")
ROUND = re.compile(r"round 1/1, ms:(.*)")

lines = open(sys.argv[1], encoding="utf-8", errors="replace").read().split("\n")
top = int(sys.argv[2]) if len(sys.argv) > 2 else 16

runs = []  # (header, lines): a "## ..." line of profile-groups or profile-product, or the command
for line in lines:
    if line.startswith("## "):
        runs.append((line[3:], []))
    elif line.startswith("== ") and "bench_connectivity" in line:
        if not runs or runs[-1][1]:
            runs.append((line[3:].strip(), []))
    elif runs:
        runs[-1][1].append(line)

for header, body in runs:
    rounds = [i for i, line in enumerate(body) if ROUND.search(line)]
    if not rounds:
        print(f"### {header}: no timed round")
        continue
    end = rounds[0]
    variants = re.findall(r"(\w+) [0-9.]+", ROUND.search(body[end]).group(1))
    warmups = [i for i, line in enumerate(body[:end]) if "warm-up" in line]
    step = body[warmups[-1] if warmups else 0 : end]
    tables = [i for i, line in enumerate(step) if line.startswith("| Total")]
    print(f"### {header}: {body[end].strip()}")
    if len(tables) != len(variants):
        print(f"{len(tables)} summary tables for {len(variants)} variants: not split")
        continue
    first = 0
    for variant, last in zip(variants, tables):
        kernels = defaultdict(lambda: [0.0, 0])
        for line in step[first:last]:
            m = KERNEL.match(line)
            if m:
                entry = kernels[m.group(3).strip()]
                entry[0] += float(m.group(1)) * UNIT_MS[m.group(2)]
                entry[1] += 1
        first = last
        total = sum(ms for ms, _ in kernels.values())
        launches = sum(calls for _, calls in kernels.values())
        print(f"## {variant}: {total:.3f} ms in {launches} kernels")
        for name, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{name[:62]:62s} {ms:8.3f} ms {calls:4d}")
