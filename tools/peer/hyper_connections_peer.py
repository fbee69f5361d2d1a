"""The peer measurement for `bench_connectivity`'s stack workload: lucidrains' `hyper-connections`
(0.4.11) on PyTorch eager, same blocks and shapes, as a ratio to its own residual in the same run.

    pip install torch hyper-connections==0.4.11
    python3 tools/peer/hyper_connections_peer.py [--device cpu|cuda] [--runs 7] [--warmup 3]
        [--workload stack|model|encoder] [--model-size full|reduced]

Blocks are pre-LN MLPs (LN -> Linear(d, 4d) -> GELU -> Linear(4d, d)) on [8, 128, 256] at depths
12 and 24 (`stack`), or 12 of them on [8, 1024, 768] (`model`, GPT-2-small width; `--model-size
reduced`, the default on CPU, is [1, 32, 768]), f32; HC is
dynamic with tanh and mHC uses 20 Sinkhorn iterations, both with n = 4 streams. `train_step` is
forward + backward of the mean output (no optimiser update), like the Rust bench. Variants are
timed round-robin; each number is the median of `--runs` runs.

`encoder` is the model workload's shapes through 12 pre-norm transformer layers (12 heads,
feed-forward 4d, GELU, no dropout, causal): the residual is PyTorch's `TransformerEncoderLayer`
(`norm_first=True`), HC and mHC wrap each sublayer (LN -> causal attention, LN -> MLP) apart,
as the Rust bench's `--only encoder --granularity sublayer` does.
"""

import argparse
import json
import statistics
import time

import torch
from torch import nn
from hyper_connections import get_init_and_expand_reduce_stream_functions
from hyper_connections import mc_get_init_and_expand_reduce_stream_functions

STREAMS = 4
# (batch, length, width, depths) per workload, as in tools/src/workloads.rs.
SHAPES = {
    "stack": (8, 128, 256, (12, 24)),
    "model": (8, 1024, 768, (12,)),
    "model_reduced": (1, 32, 768, (12,)),
}
WIDTH = 256


def block():
    return nn.Sequential(
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.GELU(),
        nn.Linear(4 * WIDTH, WIDTH),
    )


class ResidualStack(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, x):
        for f in self.blocks:
            x = f(x) + x
        return x


class StreamStack(nn.Module):
    """`branches` in turn, each wrapped by lucidrains' streams (`init_and_expand`)."""

    def __init__(self, branches, init_and_expand):
        super().__init__()
        init, self.expand, self.reduce = init_and_expand(STREAMS, dim=WIDTH)
        self.layers = nn.ModuleList(
            init(branch=branch, layer_index=i) for i, branch in enumerate(branches)
        )

    def forward(self, x):
        x = self.expand(x)
        for layer in self.layers:
            x = layer(x)
        return self.reduce(x)


VARIANTS = {
    "residual": ResidualStack,
    "hc": lambda depth: StreamStack(
        [block() for _ in range(depth)], get_init_and_expand_reduce_stream_functions),
    "mhc": lambda depth: StreamStack(
        [block() for _ in range(depth)], mc_get_init_and_expand_reduce_stream_functions),
}

HEADS = 12


class CausalAttention(nn.Module):
    """LN -> causal multi-head self-attention: a pre-norm layer's attention sublayer."""

    def __init__(self, length):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, dropout=0.0, batch_first=True)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, x):
        x = self.norm(x)
        return self.attention(x, x, x, attn_mask=self.mask, is_causal=True, need_weights=False)[0]


class ResidualEncoder(nn.Module):
    def __init__(self, depth, length):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, src_mask=self.mask, is_causal=True)
        return x


def sublayers(depth, length):
    """Each layer's attention and MLP sublayers apart, in order."""
    return [sublayer for _ in range(depth) for sublayer in (CausalAttention(length), block())]


ENCODER_VARIANTS = {
    "residual": ResidualEncoder,
    "hc": lambda depth, length: StreamStack(
        sublayers(depth, length), get_init_and_expand_reduce_stream_functions),
    "mhc": lambda depth, length: StreamStack(
        sublayers(depth, length), mc_get_init_and_expand_reduce_stream_functions),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    parser.add_argument("--workload", choices=("stack", "model", "encoder"), default="stack")
    parser.add_argument("--model-size", choices=("full", "reduced"), default=None,
                        help="model workload size (default: full on cuda, reduced on cpu)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    workload = args.workload
    if workload in ("model", "encoder"):
        size = args.model_size or ("full" if device.type == "cuda" else "reduced")
        workload = "model" if size == "full" else "model_reduced"
    batch, length, width, depths = SHAPES[workload]
    global WIDTH
    WIDTH = width
    x = torch.randn(batch, length, width, device=device)
    for depth in depths:
        if args.workload == "encoder":
            models = {name: make(depth, length).to(device)
                      for name, make in ENCODER_VARIANTS.items()}
        else:
            models = {name: make(depth).to(device) for name, make in VARIANTS.items()}
        for mode in ("forward", "train_step"):

            def work(model):
                if mode == "forward":
                    with torch.no_grad():
                        return model(x)
                model.zero_grad(set_to_none=True)
                model(x).mean().backward()

            times = {name: [] for name in models}
            for run in range(args.warmup + args.runs):
                for name, model in models.items():
                    sync()
                    start = time.perf_counter()
                    work(model)
                    sync()
                    if run >= args.warmup:
                        times[name].append(1e3 * (time.perf_counter() - start))
            base = statistics.median(times["residual"])
            for name, samples in times.items():
                ms = statistics.median(samples)
                print(json.dumps({
                    "workload": (f"stack{depth}.{mode}" if args.workload == "stack"
                                 else f"{args.workload}.{mode}"),
                    "shape": [batch, length, width],
                    "variant": name,
                    "ms": round(ms, 3),
                    "ratio": round(ms / base, 3),
                    "device": args.device,
                    "torch": torch.__version__,
                }), flush=True)


if __name__ == "__main__":
    main()
