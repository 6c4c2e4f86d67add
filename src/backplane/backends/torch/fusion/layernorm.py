"""LayerNormalization written out, as exporters below opset 17 write it, as one layer.

torch.onnx writes ``nn.LayerNorm`` at opsets below 17 as nine layers over the last axis:

    mean = ReduceMean(x); d = x - mean; var = ReduceMean(d ^ 2)
    y = d / Sqrt(var + epsilon) [* Scale] [+ B]

(the corpus's char tagger: 14 such chains, 126 of its 526 layers, each a torch call when the
partition runs layer by layer). The chain becomes one default-domain ``LayerNormalization``
(opset 17) over the last axis, which CpuAcc's kernel runs as one ``F.layer_norm`` and a trace
holds. Only that exact chain is taken: float32, one constant scalar epsilon added to the variance
inside the root, the exponent 2, both means over the last axis alone with keepdims, Scale and B
constants of the normalized size; anything else (epsilon outside the root, another axis, another
exponent) is left as it is. torch's layer_norm multiplies by the inverse root where the chain
divides by the root: within a float32 ulp or two, NaN and infinities where the chain puts them.
"""

from __future__ import annotations

import numpy as np

from backplane.backends.torch.fusion.patterns import Context, scalar_op
from backplane.ir.graph import Layer

F32 = np.dtype(np.float32)


def match_layer_norm(mean: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The chain that starts with ``mean`` (ReduceMean of x), or None."""
    x = mean.inputs[0]
    sub = ctx.sole(mean.outputs[0])
    if not _last_axis_mean(mean, ctx) or sub is None or sub.op_type != "Sub" or sub.domain \
            or sub.inputs != [x, mean.outputs[0]]:
        return None
    users = ctx.consumers.get(sub.outputs[0], [])
    pow_ = next((u for u in users if scalar_op(u, sub.outputs[0], ctx, "Pow", 2.0)), None)
    div = next((u for u in users if u.op_type == "Div" and not u.domain
                and u.inputs[0] == sub.outputs[0]), None)
    if len(users) != 2 or pow_ is None or div is None or sub.outputs[0] in ctx.graph.outputs:
        return None
    chain = _variance_root(pow_, ctx)
    if chain is None or chain[-1].outputs[0] != div.inputs[1]:
        return None
    group = [mean, sub, pow_, *chain, div]
    epsilon = _epsilon(chain[1], chain[0].outputs[0], ctx)
    affine = _affine(div, ctx, _width(x, ctx))
    if epsilon is None or affine is None or ctx.graph.info(x).dtype != F32:
        return None
    group += affine[0]
    if any(id(u) not in ctx.inside or id(u) in ctx.taken for u in group):
        return None
    fused = Layer("+".join(lay.name for lay in group), "LayerNormalization", [x, *affine[1]],
                  [group[-1].outputs[0]], {"axis": -1, "epsilon": epsilon}, "", 17)
    return group, fused


def _last_axis_mean(layer: Layer, ctx: Context) -> bool:
    """Whether ``layer`` is a ReduceMean over the last axis alone, keeping it."""
    if layer.op_type != "ReduceMean" or layer.domain or not layer.attrs.get("keepdims", 1):
        return False
    axes = layer.attrs.get("axes")
    if axes is None and len(layer.inputs) > 1:  # opset 18: the axes as an input
        axes = ctx.const(layer.inputs[1])
    if axes is None or np.asarray(axes).size != 1:
        return False
    axis = int(np.asarray(axes).reshape(-1)[0])
    rank = _rank(layer.inputs[0], ctx)
    return axis == -1 or (rank is not None and axis == rank - 1)


def _variance_root(pow_: Layer, ctx: Context) -> list[Layer] | None:
    """ReduceMean (last axis) -> Add (epsilon) -> Sqrt after ``pow_``, each the sole reader."""
    var = ctx.sole(pow_.outputs[0])
    add = ctx.sole(var.outputs[0]) if var is not None and _last_axis_mean(var, ctx) else None
    root = ctx.sole(add.outputs[0]) if add is not None and add.op_type == "Add" else None
    if root is None or root.op_type != "Sqrt" or root.domain or add.domain:
        return None
    return [var, add, root]


def _epsilon(add: Layer, var: str, ctx: Context) -> float | None:
    """The scalar float32 constant ``add`` adds to ``var``, or None."""
    if var not in add.inputs or len(add.inputs) != 2:
        return None
    constant = ctx.const(add.inputs[1 - add.inputs.index(var)])
    if constant is None or constant.size != 1 or constant.dtype != F32:
        return None
    return float(constant.reshape(-1)[0])


def _affine(div: Layer, ctx: Context, width: int | None) -> tuple[list[Layer], list[str]] | None:
    """The Mul by Scale and Add of B after ``div`` (each optional, constants of the normalized
    width): the layers and LayerNormalization's Scale and B, or None where Scale is not there."""
    layers: list[Layer] = []
    out = div.outputs[0]
    mul = ctx.sole(out)
    scale = _vector(mul, out, "Mul", ctx, width)
    if scale is None:
        return None  # LayerNormalization needs a Scale: a chain without one is left alone
    layers.append(mul)
    add = ctx.sole(mul.outputs[0])
    bias = _vector(add, mul.outputs[0], "Add", ctx, width)
    if bias is None:
        return layers, [scale]
    return [*layers, add], [scale, bias]


def _vector(layer: Layer | None, operand: str, op: str, ctx: Context,
            width: int | None) -> str | None:
    """The constant ``layer`` (``operand <op> constant``) applies, if a float32 vector of the
    normalized width, else None."""
    if layer is None or layer.op_type != op or layer.domain or len(layer.inputs) != 2 \
            or operand not in layer.inputs:
        return None
    name = layer.inputs[1 - layer.inputs.index(operand)]
    constant = ctx.const(name)
    if constant is None or constant.dtype != F32 or constant.ndim != 1 or width is None \
            or constant.shape[0] != width:
        return None
    return name


def _rank(name: str, ctx: Context) -> int | None:
    shape = ctx.graph.info(name).shape
    return None if shape is None else len(shape)


def _width(name: str, ctx: Context) -> int | None:
    """The last dimension of ``name`` where it is a number."""
    shape = ctx.graph.info(name).shape
    last = shape[-1] if shape else None
    return last if isinstance(last, int) else None
