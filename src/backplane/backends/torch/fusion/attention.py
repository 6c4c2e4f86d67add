"""Attention written out by an exporter, as one ``ScaledDotAttention`` layer run by torch's
``scaled_dot_product_attention`` (issue 27: the corpus's transformers).

The spellings the corpus has, each ending Softmax(last axis) -> MatMul(probabilities, V):

    MatMul(Q, Kt) -> Div(c) | Mul(c) -> Add(mask)            torch.onnx, TorchScript exporter
    MatMul(Q, Kt) -> Mul(c) -> Where(condition, fill, .)     the same, a boolean causal mask
    Mul(Q, c) ; Mul(Kt, c) -> MatMul -> [Add(mask)]          dynamo's export (the scale on Q and K
                                                              stays outside: its Muls are left)

Q (..., L, E), Kt (..., E, S) (K transposed, as the product reads it), V (..., S, Ev), of one
batch shape; the scale a constant scalar, the mask any tensor added to the scores (a constant
causal one, or made from the inputs: a padding mask), a Where's fill a constant scalar (its
condition becomes the additive mask ``where(condition, fill, 0)``, which gives the scores the
same softmax). torch's kernel computes each row in blocks with a running maximum instead of the
whole row then its softmax: within float32 rounding of the layers' values. A row whose mask is
-inf throughout is NaN in ONNX (softmax of -inf everywhere: CpuRef, ONNX Runtime) and zero in
torch's kernel: the layer puts NaN back in such rows (skipped where the mask is a constant with
none). 1 thread, this 2-core AMD EPYC: 4 heads x 32 x 64 95 -> 63 us, 2 x 128 x 32 269 -> 177.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer


def match_attention(softmax: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The attention that ``softmax`` is the middle of, or None."""
    made = ctx.graph.producers()
    shape = _shape(softmax.inputs[0], ctx)
    if softmax.domain or shape is None or not _last_axis(softmax, len(shape)):
        return None
    out = ctx.sole(softmax.outputs[0])
    if out is None or out.op_type != "MatMul" or out.domain or out.inputs[0] != softmax.outputs[0]:
        return None
    group, value, mask, scale = [softmax, out], softmax.inputs[0], None, 1.0
    layer = _free(made.get(value), ctx, value)
    if layer is not None and layer.op_type in ("Add", "Where"):
        masked = _mask(layer, ctx)
        if masked is None:
            return None
        value, mask = masked
        group.insert(0, layer)
        layer = _free(made.get(value), ctx, value)
    if layer is not None and layer.op_type in ("Mul", "Div"):
        value = next((i for i in layer.inputs if ctx.const(i) is None), "")
        factor = _scalar(layer, value, ctx)
        if factor is None:
            return None
        scale = factor if layer.op_type == "Mul" else 1 / factor
        group.insert(0, layer)
        layer = _free(made.get(value), ctx, value)
    if layer is None or layer.op_type != "MatMul" or layer.domain:
        return None
    group.insert(0, layer)
    return _fused(group, [*layer.inputs, out.inputs[1]], mask, scale, ctx)


def _fused(group: list[Layer], qkv: list[str], mask: tuple[str, ...] | None, scale: float,
           ctx: Context) -> tuple[list[Layer], Layer] | None:
    shapes = [_shape(name, ctx) for name in qkv]
    if any(s is None or len(s) < 3 for s in shapes):
        return None
    q, kt, v = shapes  # (..., L, E), (..., E, S), (..., S, Ev): one batch shape, no broadcast
    if not q[:-2] == kt[:-2] == v[:-2] or q[-1] != kt[-2] or kt[-1] != v[-2]:  # type: ignore
        return None
    inputs, attrs = list(qkv), {"scale": float(scale), "mask": None, "fill": None, "rows": False}
    if mask is not None:
        kind, name, fill = mask
        inputs.append(name)
        constant = ctx.const(name)
        additive = constant if kind == "add" else None
        attrs.update(mask=kind, fill=fill, rows=_masked_rows(additive, constant, kind, fill))
    out = group[-1].outputs[0]
    fused = Layer("+".join(lay.name for lay in group), "ScaledDotAttention", inputs, [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _masked_rows(additive: np.ndarray | None, condition: np.ndarray | None, kind: str,
                 fill: float | None) -> bool:
    """Whether a row may be masked throughout (NaN put back): unknown for a mask from the inputs."""
    if kind == "add":
        return additive is None or bool(np.isneginf(additive).all(axis=-1).any())
    if fill is None or not math.isinf(fill) or fill > 0:
        return False  # a finite fill: every row has a finite softmax, as torch's kernel gives
    if condition is None:
        return True
    chosen = condition if kind == "where" else np.logical_not(condition)  # where fill is taken
    return bool(np.asarray(chosen, bool).all(axis=-1).any())


def _mask(layer: Layer, ctx: Context) -> tuple[str, tuple[str, str, float | None]] | None:
    """(the scores' name, (kind, the mask's name, a Where's fill)) of an Add or Where on the
    scores; kind "add" (an additive mask), "where" (fill where the condition holds) or
    "where_not" (fill where it does not)."""
    if layer.domain:
        return None
    if layer.op_type == "Add":
        first, second = layer.inputs
        for scores, other in ((first, second), (second, first)):
            if _shape(scores, ctx) is not None and ctx.graph.info(other).dtype == F32 \
                    and _shape(scores, ctx) == _shape(layer.outputs[0], ctx) \
                    and _made_before(scores, ctx):
                return scores, ("add", other, None)
        return None
    condition, when, otherwise = layer.inputs
    for fill_name, scores, kind in ((when, otherwise, "where"), (otherwise, when, "where_not")):
        fill = ctx.const(fill_name)
        if fill is not None and fill.size == 1 and fill.dtype == F32 and ctx.const(scores) is None:
            if _shape(scores, ctx) != _shape(layer.outputs[0], ctx):
                return None  # the condition broadcasts the scores: not a mask of them
            return scores, (kind, condition, float(fill.reshape(-1)[0]))
    return None


def _made_before(name: str, ctx: Context) -> bool:
    """Whether ``name`` is the scores (not the mask): a MatMul's product in the view, or that
    product times or over a constant scalar."""
    made = ctx.graph.producers()
    layer = made.get(name)
    if layer is not None and layer.op_type in ("Mul", "Div") and not layer.domain \
            and _scalar(layer, next((i for i in layer.inputs if ctx.const(i) is None), ""), ctx):
        layer = made.get(next(i for i in layer.inputs if ctx.const(i) is None))
    return layer is not None and layer.op_type == "MatMul" and id(layer) in ctx.inside


def _free(layer: Layer | None, ctx: Context, out: str) -> Layer | None:
    """``layer`` where it is free to fuse and ``out``, its output, is read by one layer only."""
    if layer is None or id(layer) not in ctx.inside or id(layer) in ctx.taken \
            or len(ctx.consumers.get(out, [])) != 1 or out in ctx.graph.outputs:
        return None
    return layer


def _scalar(layer: Layer, scores: str, ctx: Context) -> float | None:
    other = layer.inputs[1] if layer.inputs[0] == scores else layer.inputs[0]
    value = ctx.const(other)
    if layer.domain or value is None or value.size != 1 or value.dtype != F32 or \
            (layer.op_type == "Div" and layer.inputs[1] != other):
        return None
    factor = float(value.reshape(-1)[0])
    return factor if math.isfinite(factor) and factor != 0 else None


def _shape(name: str, ctx: Context) -> tuple[int, ...] | None:
    return ctx.shape(name)


def _last_axis(softmax: Layer, rank: int) -> bool:
    axis = int(softmax.attrs.get("axis", -1 if softmax.opset >= 13 else 1))
    return axis % rank == rank - 1  # below opset 13 Softmax flattens from its axis: the last only


def attention_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """torch's ``scaled_dot_product_attention`` on Q, Kt's transpose and V, the mask added to the
    scores, NaN in the rows it masks throughout."""
    import torch
    import torch.nn.functional as F

    a = layer.attrs
    kind, fill, scale, rows = a["mask"], a["fill"], a["scale"], a["rows"]

    def additive(mask: Any, q: Any) -> Any:
        if kind == "add" or mask is None:
            return mask
        bias = torch.full((), fill, dtype=q.dtype)
        zero = torch.zeros((), dtype=q.dtype)
        return torch.where(mask, bias, zero) if kind == "where" else torch.where(mask, zero, bias)

    def run(q: Any, kt: Any, v: Any, mask: Any = None) -> tuple[Any]:
        bias = additive(mask, q)
        y = F.scaled_dot_product_attention(q, kt.transpose(-2, -1), v, attn_mask=bias,
                                           scale=scale)
        if rows:  # ONNX's softmax of a row of -inf: NaN (torch's kernel gives 0)
            y = y.masked_fill(torch.isneginf(bias).all(-1, keepdim=True), math.nan)
        return (y,)
    return run
