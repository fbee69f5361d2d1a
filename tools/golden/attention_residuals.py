"""Golden vectors for Attention Residuals: tests/golden/attnres.safetensors.

    python3 -m venv .venv-golden
    .venv-golden/bin/pip install -r tools/golden/requirements.txt
    .venv-golden/bin/python tools/golden/attention_residuals.py [--out tests/golden/attnres.safetensors]

Every mixture is made by the `attn-res` package's operator (`attn_res.AttnResOperator`, 0.1.0:
RMS-normalised keys without a weight, one pseudo-query, softmax over the sources), and checked
against the equations written out here in float64 (MATH §5.4). The package's own model sums the
sources for its final output; the paper treats the output like one more layer, so the variants
`*_sum` make the package's output and the others attend with a pseudo-query of their own (see
tests/golden/README.md). Block AttnRes groups `k` blocks: the sources before block l are the
completed group sums (`x` first) and the current group's partial sum when it is not empty, which
is the package's block-boundary handling.
"""

import argparse

import torch
from attn_res import AttnResOperator
from safetensors.torch import save_file

BLOCKS = 6
WIDTH = 8
SHAPE = (2, 3, WIDTH)
EPSILON = 1e-6
# name: (block size, output)
VARIANTS = {
    "full": (1, "attend"),
    "full_sum": (1, "sum"),
    "block2": (2, "attend"),
    "block4": (4, "attend"),
    "block4_sum": (4, "sum"),
}


def package_operators(queries, output_query, dtype):
    """One `AttnResOperator` per block (and one for the output), holding the queries."""
    operators = []
    for query in [*queries, *([output_query] if output_query is not None else [])]:
        operator = AttnResOperator(WIDTH, eps=EPSILON).to(dtype)
        with torch.no_grad():
            operator.pseudo_query.copy_(query)
        operators.append(operator)
    return operators


def by_equations(query, sources):
    """h = Σ_s softmax_s(w · s / sqrt(mean(s²) + ε)) s, in float64."""
    stacked = torch.stack(sources, dim=0)
    keys = stacked / torch.sqrt(stacked.pow(2).mean(-1, keepdim=True) + EPSILON)
    weights = torch.softmax((keys * query).sum(-1), dim=0)
    return (weights.unsqueeze(-1) * stacked).sum(0)


def run(attend, x, blocks, block_size, with_output_query):
    """Output, readout y_0..y_L and block inputs of the stack; `attend(l, sources)` mixes with
    query l (l = BLOCKS: the output's)."""
    sources, partial = [x], None
    readout, inputs = [], []

    def output():
        current = sources + ([partial] if partial is not None else [])
        if not with_output_query:
            return torch.stack(current).sum(0)
        return current[0] if len(current) == 1 else attend(BLOCKS, current)

    readout.append(output())
    for l, (weight, bias) in enumerate(blocks):
        current = sources + ([partial] if partial is not None else [])
        h = current[0] if len(current) == 1 else attend(l, current)
        inputs.append(h)
        v = torch.tanh(h @ weight + bias)
        partial = v if partial is None else partial + v
        if (l + 1) % block_size == 0:
            sources.append(partial)
            partial = None
        readout.append(output())
    return readout[-1], torch.stack(readout), torch.stack(inputs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/golden/attnres.safetensors")
    parser.add_argument("--seed", type=int, default=2603)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dtype = torch.float64
    tensors = {}
    x = torch.randn(SHAPE, dtype=dtype)
    probe = torch.randn(SHAPE, dtype=dtype)
    blocks = []
    for j in range(BLOCKS):
        weight = torch.randn(WIDTH, WIDTH, dtype=dtype) / WIDTH**0.5
        bias = 0.1 * torch.randn(WIDTH, dtype=dtype)
        blocks.append((weight, bias))
        tensors[f"blocks.{j}.weight"] = weight
        tensors[f"blocks.{j}.bias"] = bias
    tensors["input"], tensors["probe"] = x, probe

    for name, (block_size, output) in VARIANTS.items():
        queries = torch.randn(BLOCKS, WIDTH, dtype=dtype)
        output_query = torch.randn(WIDTH, dtype=dtype) if output == "attend" else None
        tensors[f"{name}.queries"] = queries
        if output_query is not None:
            tensors[f"{name}.output_query"] = output_query
        results = []
        for by in ("package", "equations"):
            x_leaf = x.clone().requires_grad_()
            weights = [(w.clone().requires_grad_(), b) for w, b in blocks]
            if by == "package":
                operators = package_operators(queries, output_query, dtype)
                attend = lambda l, sources: operators[l](torch.stack(sources, dim=0))
            else:
                query_leaves = [q.clone().requires_grad_() for q in queries]
                if output_query is not None:
                    query_leaves.append(output_query.clone().requires_grad_())
                attend = lambda l, sources: by_equations(query_leaves[l], sources)
            y, readout, block_inputs = run(
                attend, x_leaf, weights, block_size, output_query is not None
            )
            (y * probe).sum().backward()
            if by == "package":
                query_grads = [op.pseudo_query.grad for op in operators]
            else:
                query_grads = [q.grad for q in query_leaves]
            # A query whose mixture has one source gets no gradient: zero.
            query_grads = [
                torch.zeros(WIDTH, dtype=dtype) if g is None else g for g in query_grads
            ]
            grads = [x_leaf.grad, torch.stack(query_grads[:BLOCKS])]
            if output_query is not None:
                grads.append(query_grads[BLOCKS])
            results.append((y, readout, block_inputs, grads, [w.grad for w, _ in weights]))
        (y, readout, block_inputs, grads, block_grads), reference = results
        worst = max(
            ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()
            for a, b in zip(
                [y, readout, block_inputs, *grads, *block_grads],
                [reference[0], reference[1], reference[2], *reference[3], *reference[4]],
            )
        )
        # The package normalises the keys in float32: about 1e-7 of each tensor's scale.
        assert worst < 1e-6, f"{name}: the package and the equations differ by {worst}"
        y, readout, block_inputs, grads, block_grads = reference
        tensors[f"{name}.out.y"] = y.detach()
        tensors[f"{name}.out.readout"] = readout.detach()
        tensors[f"{name}.out.inputs"] = block_inputs.detach()
        tensors[f"{name}.grad.input"] = grads[0]
        tensors[f"{name}.grad.queries"] = grads[1]
        if output_query is not None:
            tensors[f"{name}.grad.output_query"] = grads[2]
        for j, grad in enumerate(block_grads):
            tensors[f"{name}.grad.blocks.{j}.weight"] = grad
        print(f"{name}: package vs equations, largest difference {worst:.1e} (relative to scale)")

    metadata = {
        "blocks": str(BLOCKS),
        "epsilon": str(EPSILON),
        "seed": str(args.seed),
        "variants": ",".join(f"{n}:k={k}:{o}" for n, (k, o) in VARIANTS.items()),
        "block": "tanh(x @ blocks.j.weight + blocks.j.bias)",
        "loss": "sum(out.y * probe)",
        "reference": "attn-res 0.1.0 AttnResOperator, checked against the equations in float64",
    }
    save_file(
        {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}, args.out, metadata
    )
    print(f"wrote {args.out}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
