"""Products by constant weights that read one input, as one product (issue 27: attention's
separate query, key and value projections).

A transformer block written with three ``nn.Linear`` for Q, K and V (the corpus's char tagger,
BERT-style exports) exports three MatMul [-> Add(bias)] of one input; fused one by one they are
three ``Linear`` layers, three products of a few rows by a small weight each, where the call
costs as much as the arithmetic. As one ``LinearSiblings`` layer they are one product by the
weights stacked, its result split along the last axis into views, one per sibling: the same values
(each output column is the same dot product), two products fewer a block. Only plain siblings are
taken: float32, no activation, residual or Reshape folded into any (what ``match_linear`` would
fuse stays its own), none an output of the graph or read by a QuantizeLinear or a contrib op; and
none in a subgraph with convolutions, which oneDNN Graph compiles whole from the ops it was
measured on (``onednn_graph.TRACED_OPS``), this layer not among them."""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.linear import linear_workload, match_linear
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer

CONVOLUTIONS = frozenset({"Conv", "ConvTranspose"})
MAX_SIBLING_WEIGHTS = 1 << 22
"""The stacked weight's bound (N x K values, 16 MB of float32): a larger one is left as it is."""


def match_sibling_linears(matmul: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """``matmul`` and the other plain products by constant weights of its input, as one
    ``LinearSiblings`` layer; None where it has none."""
    if matmul.op_type != "MatMul" or matmul.domain or not matmul.inputs:
        return None
    if any(layer.op_type in CONVOLUTIONS and not layer.domain for layer in ctx.view.layers):
        return None
    x = matmul.inputs[0]
    found = [_plain(m, x, ctx) for m in _products_of(x, ctx)]
    siblings = [f for f in found if f is not None]
    if len(siblings) < 2 or not any(group[0] is matmul for group, _ in siblings):
        return None
    shape = siblings[0][1].attrs["input_shape"]
    if any(fused.attrs["input_shape"] != shape for _, fused in siblings):
        return None
    order = {id(layer): i for i, layer in enumerate(ctx.view.layers)}
    siblings.sort(key=lambda s: order[id(s[0][-1])])  # the first output made first (``_in_order``)
    weights = [np.asarray(fused.attrs["weight"], F32) for _, fused in siblings]
    if sum(w.size for w in weights) > MAX_SIBLING_WEIGHTS:
        return None
    biases = [fused.attrs["bias"] if fused.attrs["bias"] is not None
              else np.zeros(w.shape[0], F32) for (_, fused), w in zip(siblings, weights)]
    attrs = {"weight": np.concatenate(weights), "bias": np.concatenate(biases).astype(F32),
             "input_shape": list(shape), "unary": None, "binary": False, "output_shape": None,
             "sizes": [int(w.shape[0]) for w in weights]}
    group = [layer for g, _ in siblings for layer in g]
    outputs = [fused.outputs[0] for _, fused in siblings]
    name = "+".join(layer.name for layer in group)
    return group, Layer(name, "LinearSiblings", [x], outputs, attrs, FUSED_DOMAIN, 1)


def _products_of(x: str, ctx: Context) -> list[Layer]:
    return [u for u in ctx.consumers.get(x, []) if u.op_type == "MatMul" and not u.domain
            and u.inputs[0] == x and id(u) in ctx.inside and id(u) not in ctx.taken]


def _plain(matmul: Layer, x: str, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """(its layers, its Linear) where ``match_linear`` makes ``matmul`` a plain float32 Linear of
    ``x`` whose result leaves it for default-domain layers other than a QuantizeLinear."""
    found = match_linear(matmul, ctx)
    if found is None:
        return None
    group, fused = found
    a, out = fused.attrs, fused.outputs[0]
    if fused.inputs != [x] or a["unary"] is not None or a["binary"] or a["output_shape"] \
            or a.get("compute") or a["weight"].dtype != F32 or out in ctx.graph.outputs:
        return None
    readers = ctx.consumers.get(out, [])
    if not readers or any(r.domain or r.op_type == "QuantizeLinear" for r in readers):
        return None
    return group, fused


def linear_siblings_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The stacked product (``linear_workload``'s route, measured or known as a Linear's is), its
    result split into views of it along the last axis."""
    product = linear_workload(layer, backend, inputs)
    sizes = list(layer.attrs["sizes"])

    def run(x: Any) -> tuple[Any, ...]:
        (y,) = product(x)
        return tuple(y.split(sizes, -1))

    run.weights = getattr(product, "weights", ())  # type: ignore[attr-defined]
    run.why = getattr(product, "why", None)  # type: ignore[attr-defined]
    return run
