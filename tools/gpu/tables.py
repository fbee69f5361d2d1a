"""Markdown tables from tools/gpu/measure.sh's output: the model workload per backend (ms and
ratio to that backend's own residual, median of the runs), the PyTorch peer beside it.

    python3 tools/gpu/tables.py OUT_DIR
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

out = Path(sys.argv[1])
rows = defaultdict(dict)  # (device, workload) -> variant -> ms
floors = []
for line in (out / "bench.jsonl").read_text().splitlines():
    if not line.startswith("{"):
        continue
    rec = json.loads(line)
    if "floor" in rec:  # kernel_floors.py's records: a table of their own below
        floors.append(rec)
        continue
    device = rec["device"]
    if "torch" in rec:
        device = f"pytorch-{device}"
    rows[(device, rec["workload"])][rec["variant"]] = rec["ms"]

for (device, workload), by_variant in sorted(rows.items()):
    base = by_variant.get("residual")
    print(f"\n{device} {workload}")
    print("| variant | ms | ratio to its residual |")
    print("|---|---|---|")
    for variant, ms in by_variant.items():
        ratio = f"{ms / base:.3f}" if base else "-"
        print(f"| {variant} | {ms:.2f} | {ratio} |")

if floors:
    print(f"\nPyTorch's floors on {floors[0]['device']} (tools/peer/kernel_floors.py)")
    print("| shape | R | w | C | op | TF32 | ms | GB/s of x |")
    print("|---|---|---|---|---|---|---|---|")
    for rec in floors:
        print(
            f"| {rec['shape']} | {rec['rows']} | {rec['width']} | {rec['columns']} | "
            f"{rec['floor']} | {'on' if rec['tf32'] else 'off'} | {rec['ms']:.4f} | "
            f"{rec['gb_per_s']:.0f} |"
        )
