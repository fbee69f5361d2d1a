"""Golden vectors for DeepSeek-V4's mHC: tests/golden/mhc_v4.safetensors.

    python3 -m venv .venv-golden
    .venv-golden/bin/pip install -r tools/golden/requirements.txt
    .venv-golden/bin/python tools/golden/mhc_v4.py [--out tests/golden/mhc_v4.safetensors]

Each block's connections are made by `transformers`' `DeepseekV4HyperConnection` and the output
by its `DeepseekV4HyperHead` (as `DeepseekV4Model` runs them: the streams start as copies of the
input, `S' = post ⊙ h + combᵀ S`), and again from the equations written out here in float64
(MATH §5.5); the stored values are the equations', after checking that the two agree
(`transformers` computes the connections in float32).
"""

import argparse
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

BLOCKS = 6
WIDTH = 8
STREAMS = 4
SHAPE = (2, 3, WIDTH)
ITERATIONS = 20
EPSILON = 1e-6


def config():
    return SimpleNamespace(
        hc_mult=STREAMS,
        hc_sinkhorn_iters=ITERATIONS,
        hc_eps=EPSILON,
        rms_norm_eps=EPSILON,
        hidden_size=WIDTH,
    )


def rms(flat):
    return flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + EPSILON)


def connections_by_equations(params, streams):
    """post, comb, collapsed of one block, in the streams' type."""
    weights, base, scale = params
    n = STREAMS
    z = rms(streams.flatten(2)) @ weights.T
    pre = torch.sigmoid(z[..., :n] * scale[0] + base[:n]) + EPSILON
    post = 2 * torch.sigmoid(z[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = z[..., 2 * n :] * scale[2] + base[2 * n :]
    comb = torch.softmax(logits.unflatten(-1, (n, n)), dim=-1) + EPSILON
    comb = comb / (comb.sum(-2, keepdim=True) + EPSILON)
    for _ in range(ITERATIONS - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPSILON)
        comb = comb / (comb.sum(-2, keepdim=True) + EPSILON)
    collapsed = (pre.unsqueeze(-1) * streams).sum(2)
    return post, comb, collapsed


def head_by_equations(params, streams):
    weights, base, scale = params
    gains = torch.sigmoid(rms(streams.flatten(2)) @ weights.T * scale + base) + EPSILON
    return (gains.unsqueeze(-1) * streams).sum(2)


def run(connect, collapse, x, blocks):
    """Output, readout (the head after k blocks) and final streams."""
    streams = x.unsqueeze(2).expand(-1, -1, STREAMS, -1).contiguous()
    readout = [collapse(streams)]
    for j, (weight, bias) in enumerate(blocks):
        post, comb, collapsed = connect(j, streams)
        h = torch.tanh(collapsed @ weight + bias)
        streams = post.unsqueeze(-1) * h.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        readout.append(collapse(streams))
    return readout[-1], torch.stack(readout), streams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/golden/mhc_v4.safetensors")
    parser.add_argument("--seed", type=int, default=2604)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dtype = torch.float64
    n, entries = STREAMS, STREAMS * WIDTH
    tensors = {"input": torch.randn(SHAPE, dtype=dtype), "probe": torch.randn(SHAPE, dtype=dtype)}
    blocks = []
    for j in range(BLOCKS):
        weight = torch.randn(WIDTH, WIDTH, dtype=dtype) / WIDTH**0.5
        bias = 0.1 * torch.randn(WIDTH, dtype=dtype)
        blocks.append((weight, bias))
        tensors[f"blocks.{j}.weight"], tensors[f"blocks.{j}.bias"] = weight, bias
    # Random around DeepSeek-V4's init, so that every term matters.
    layers = []
    for j in range(BLOCKS):
        params = (
            0.5 * torch.randn((2 + n) * n, entries, dtype=dtype),
            0.5 * torch.randn((2 + n) * n, dtype=dtype),
            1.0 + 0.3 * torch.randn(3, dtype=dtype),
        )
        layers.append(params)
        for name, value in zip(("weights", "base", "scale"), params):
            tensors[f"layers.{j}.{name}"] = value
    head = (
        0.5 * torch.randn(n, entries, dtype=dtype),
        0.5 * torch.randn(n, dtype=dtype),
        1.0 + 0.3 * torch.randn(1, dtype=dtype),
    )
    for name, value in zip(("weights", "base", "scale"), head):
        tensors[f"head.{name}"] = value

    results = []
    for by in ("transformers", "equations"):
        x = tensors["input"].clone().requires_grad_()
        weights = [(w.clone().requires_grad_(), b) for w, b in blocks]
        if by == "transformers":
            modules = []
            for params in layers:
                module = DeepseekV4HyperConnection(config()).to(dtype)
                with torch.no_grad():
                    module.fn.copy_(params[0])
                    module.base.copy_(params[1])
                    module.scale.copy_(params[2])
                modules.append(module)
            head_module = DeepseekV4HyperHead(config()).to(dtype)
            with torch.no_grad():
                head_module.hc_fn.copy_(head[0])
                head_module.hc_base.copy_(head[1])
                head_module.hc_scale.copy_(head[2])
            connect = lambda j, s: modules[j](s)
            collapse = head_module
            leaves = [[m.fn, m.base, m.scale] for m in modules] + [
                [head_module.hc_fn, head_module.hc_base, head_module.hc_scale]
            ]
        else:
            leaves = [[p.clone().requires_grad_() for p in params] for params in [*layers, head]]
            connect = lambda j, s: connections_by_equations(leaves[j], s)
            collapse = lambda s: head_by_equations(leaves[BLOCKS], s)
        y, readout, streams = run(connect, collapse, x, weights)
        (y * tensors["probe"]).sum().backward()
        grads = [x.grad] + [w.grad for w, _ in weights] + [p.grad for group in leaves for p in group]
        results.append((y, readout, streams, grads))
    (y, readout, streams, grads), reference = results
    worst = max(
        ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()
        for a, b in zip([y, readout, streams, *grads], [*reference[:3], *reference[3]])
    )
    # transformers computes the connections in float32: about 1e-7 of each tensor's scale.
    assert worst < 2e-6, f"transformers and the equations differ by {worst}"
    print(f"transformers vs equations, largest difference {worst:.1e} (relative to scale)")
    y, readout, streams, grads = reference
    tensors["out.y"], tensors["out.readout"], tensors["out.streams"] = (
        y.detach(),
        readout.detach(),
        streams.detach(),
    )
    tensors["grad.input"] = grads[0]
    for j in range(BLOCKS):
        tensors[f"grad.blocks.{j}.weight"] = grads[1 + j]
    names = [f"layers.{j}.{p}" for j in range(BLOCKS) for p in ("weights", "base", "scale")]
    names += [f"head.{p}" for p in ("weights", "base", "scale")]
    for name, grad in zip(names, grads[1 + BLOCKS :]):
        tensors[f"grad.{name}"] = grad
    metadata = {
        "blocks": str(BLOCKS),
        "streams": str(STREAMS),
        "sinkhorn_iters": str(ITERATIONS),
        "epsilon": str(EPSILON),
        "seed": str(args.seed),
        "expand": "copy",
        "block": "tanh(x @ blocks.j.weight + blocks.j.bias)",
        "loss": "sum(out.y * probe)",
        "reference": "transformers 5.24.0 DeepseekV4HyperConnection and DeepseekV4HyperHead, "
        "checked against the equations in float64",
    }
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()}, args.out, metadata)
    print(f"wrote {args.out}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
