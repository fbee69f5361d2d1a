"""What the connection tables' heavy parts cost in PyTorch (cuBLAS and its own reductions), at the
model workload's shapes: a reference for the crate's CubeCL kernels on the same GPU.

    pip install torch
    python3 tools/peer/kernel_floors.py [--device cpu|cuda] [--runs 9] [--rows N]

The normalised projection of HC and mHC reads rows `x [R, w]` and a weight matrix `W [w, C]`:
mHC projects each token's `n = 4` streams flattened (`R = 8192`, `w = 3072`, `C = 2n + n² = 24`),
HC each stream's row (`R = 32768`, `w = 768`, `C = 5`) on `[8, 1024, 768]`. Per shape this times,
f32, each the median of `--runs` runs of 10 calls:

    proj     x W                       the forward's product
    norms    ‖x_r‖ per row             its sum of squares (one reduction kernel)
    grad_x   δ Wᵀ                      the rows' gradient's product
    grad_w   xᵀ δ                      the weights' gradient (the crate's `weights_product`)
    read     Σ x                       one pass reading x: the bandwidth floor of a kernel
                                       that reads the rows once
    copy     x.clone()                 one pass reading and one writing x

with TF32 off and on for the products on CUDA (CubeCL's f32 matmuls run in TF32 there). The crate's
kernels do more per row than these (norms, scales, Sinkhorn-Knopp, the block input's terms),
but a kernel far above `read` + `proj` for its pass is where time goes. One JSON line per op on
stdout, a table on stderr. `--rows` sets `R` for both shapes (the CPU default is 256: a check
that the script runs).
"""

import argparse
import json
import statistics
import sys
import time

import torch

# (name, rows, width, columns) at the model workload's shapes.
SHAPES = (("mhc", 8192, 3072, 24), ("hc", 32768, 768, 5))
CALLS = 10


def timer(device):
    """Seconds of `fn` called CALLS times, with the device's own clock where it has one."""
    if device.type == "cuda":

        def run(fn):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0

    else:

        def run(fn):
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            return time.perf_counter() - start

    return run


def ops(x, w, delta):
    return {
        "proj": lambda: x @ w,
        "norms": lambda: torch.linalg.vector_norm(x, dim=1),
        "grad_x": lambda: delta @ w.T,
        "grad_w": lambda: x.T @ delta,
        "read": lambda: x.sum(),
        "copy": lambda: x.clone(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--rows", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    run = timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"kernel floors on {name}, torch {torch.__version__}", file=sys.stderr)
    for shape, rows, width, columns in SHAPES:
        rows = args.rows or (rows if device.type == "cuda" else 256)
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(rows, width, generator=generator).to(device)
        w = torch.randn(width, columns, generator=generator).to(device)
        delta = torch.randn(rows, columns, generator=generator).to(device)
        # TF32 is a CUDA setting: the CPU runs the products once.
        for tf32 in (False, True) if device.type == "cuda" else (False,):
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = tf32
            for op, fn in ops(x, w, delta).items():
                if tf32 and op not in ("proj", "grad_x", "grad_w"):
                    continue
                for _ in range(3):
                    run(fn)
                times = [run(fn) / CALLS * 1000.0 for _ in range(args.runs)]
                ms = statistics.median(times)
                # Bytes any form must move: x read once (grad_x: its [R, w] output written
                # once; copy: both).
                moved = x.numel() * x.element_size() * (2 if op == "copy" else 1)
                record = {
                    "floor": op,
                    "shape": shape,
                    "rows": rows,
                    "width": width,
                    "columns": columns,
                    "tf32": tf32,
                    "device": name,
                    "ms": round(ms, 4),
                    "gb_per_s": round(moved / (ms / 1000.0) / 1e9, 1),
                }
                print(json.dumps(record), flush=True)
                print(
                    f"  {shape:4} R={rows} w={width} C={columns} {op:7} tf32={int(tf32)}"
                    f"  {ms:8.4f} ms  {record['gb_per_s']:8.1f} GB/s of x",
                    file=sys.stderr,
                )


if __name__ == "__main__":
    main()
