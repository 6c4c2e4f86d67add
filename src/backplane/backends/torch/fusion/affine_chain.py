"""A chain of Mul, Add, Sub and Div of one float32 tensor by constants (a detector's box decode:
(sigmoid * 2 - 0.5 + grid) * stride) as one ``AffineChain`` layer: x * a + b in one ``addcmul``,
a and b folded at load.

Why: each step is a kernel call and a tensor of its own, in a trace too, on a detector's few
hundred values a run where the call is the cost: detect_nms_ts14's trace 37 -> 34 ops. The folded
constants round once where the steps rounded at each (an ulp or two); a Div by c is a product by
1 / c. NaN stays NaN, an infinity goes where the steps take it (inf * 0 is NaN in both).

Three steps or more (``MIN_STEPS``). A step that another pattern starts at (a GELU's x / sqrt(2),
a hard-swish's x + 3, a Linear) ends the chain before it; the chain keeps x's shape (constants
that broadcast to it, no wider).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer

OPS = frozenset({"Mul", "Add", "Sub", "Div"})
MIN_STEPS = 3
"""Fewer are left as they are: two steps become one call, but a subgraph of a few layers fused
so can drop below a trace's ``traced.MIN_LAYERS`` and run layer by layer (a CTC head's Linear,
Mul 2, Add 1: test_linear_routes)."""
Matcher = Callable[[Layer, Context], "tuple[list[Layer], Layer] | None"]


def match_affine(first: Layer, ctx: Context,
                 others: Callable[[Layer], Matcher | None] = lambda _: None
                 ) -> tuple[list[Layer], Layer] | None:
    """The chain that starts with ``first``, of ``MIN_STEPS`` steps or more, or None;
    ``others(layer)`` is the matcher a later step would start a pattern with (the chain ends
    before it where that matches)."""
    step = _step(first, None, ctx)
    if step is None:
        return None
    x, shape = step[0], ctx.shape(step[0])
    scale, shift = np.ones((), np.float64), np.zeros((), np.float64)
    group: list[Layer] = []
    layer: Layer | None = first
    while layer is not None:
        found = _step(layer, x if not group else group[-1].outputs[0], ctx)
        if found is None or ctx.shape(layer.outputs[0]) != shape:
            break
        if group:
            other = others(layer)
            if other is not None and other(layer, ctx) is not None:
                break
        _, op, value, constant_first = found
        scale, shift = _folded(scale, shift, op, value, constant_first)
        group.append(layer)
        layer = ctx.sole(layer.outputs[0])
    if len(group) < MIN_STEPS or np.broadcast_shapes(scale.shape, shift.shape, shape) != shape:
        return None
    fused = Layer("+".join(lay.name for lay in group), "AffineChain", [x],
                  [group[-1].outputs[0]], {"scale": scale.astype(np.float32),
                                           "shift": shift.astype(np.float32)}, FUSED_DOMAIN, 1)
    return group, fused


def _step(layer: Layer, x: str | None, ctx: Context) -> tuple[str, str, np.ndarray, bool] | None:
    """(the tensor, the op, the constant, whether the constant comes first) of ``layer``, a float32
    step by a float32 constant (of ``x`` where given), or None."""
    if layer.op_type not in OPS or layer.domain or len(layer.inputs) != 2:
        return None
    a, b = layer.inputs
    constant_first = ctx.const(a) is not None
    tensor, other = (b, a) if constant_first else (a, b)
    value = ctx.const(other)
    if value is None or value.dtype != F32 or ctx.const(tensor) is not None \
            or (x is not None and tensor != x) or ctx.shape(tensor) is None \
            or (constant_first and layer.op_type == "Div"):  # c / x: not affine
        return None
    return tensor, layer.op_type, value.astype(np.float64), constant_first


def _folded(scale: np.ndarray, shift: np.ndarray, op: str, value: np.ndarray,
            constant_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """x * scale + shift, then ``op`` by ``value``, as x * scale' + shift'."""
    if op == "Mul":
        return scale * value, shift * value
    if op == "Add":
        return scale, shift + value
    if op == "Sub":
        return (-scale, value - shift) if constant_first else (scale, shift - value)
    return scale / value, shift / value  # Div, of x (``_step``)


def with_affine(matchers: dict[str, Matcher], default: Matcher) -> dict[str, Matcher]:
    """``matchers`` with each of ``OPS`` also starting an AffineChain where its own matcher (or
    ``default``) finds nothing; a chain ends before a step where that matcher finds a pattern."""
    own = {op: matchers.get(op, default) for op in OPS}

    def chain(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
        found = own[layer.op_type](layer, ctx)
        if found is not None or layer.domain:
            return found
        return match_affine(layer, ctx, lambda step: own.get(step.op_type))

    return {**matchers, **dict.fromkeys(OPS, chain)}


def affine_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch

    scale = torch.from_numpy(np.ascontiguousarray(layer.attrs["scale"]))
    shift = torch.from_numpy(np.ascontiguousarray(layer.attrs["shift"]))

    if not layer.attrs["shift"].any():  # a product alone
        def run(x: Any) -> tuple[Any]:
            return (torch.mul(x, scale),)
    elif (layer.attrs["scale"] == 1).all():  # a sum alone
        def run(x: Any) -> tuple[Any]:
            return (torch.add(x, shift),)
    else:
        def run(x: Any) -> tuple[Any]:
            return (torch.addcmul(shift, x, scale),)

    run.weights = (scale, shift)  # type: ignore[attr-defined]
    return run
