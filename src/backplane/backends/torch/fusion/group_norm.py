"""A group norm as exporters write it, Reshape to (N, G, -1) -> InstanceNormalization -> Reshape
back [-> Mul by a per-channel constant] [-> Add of one]: one ``GroupNorm`` layer, torch's
``group_norm`` of the groups and one ``addcmul`` with both affines folded into one per channel.

Why: torch.onnx writes ``nn.GroupNorm`` so (the InstanceNormalization's scale ones and bias zeros
over the groups, the module's own affine after it, per channel), five layers where torch has one
kernel: in a trace two views, the normalization, its affine, and the module's Mul and Add.
audio_conv1d_dyn19's GroupNorm(16, 16) at (1, 16, 79): its trace 22 -> 18 ops.

The folded affine is the two applied one after the other: scale s and bias b of a channel's group,
then the Mul's m and the Add's a, make scale s * m and bias b * m + a (one rounding each, where
the layers rounded twice: a difference of an ulp or two). NaN spreads over its group as in the
layers; a constant group gives its bias exactly (``kernels/network.group_normalization``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer


def match_group_norm(reshape: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The group norm that starts with ``reshape`` (x to (N, G, -1)), or None."""
    if reshape.op_type != "Reshape" or reshape.domain:
        return None
    x = reshape.inputs[0]
    shape, grouped = ctx.shape(x), ctx.shape(reshape.outputs[0])
    if shape is None or grouped is None or len(shape) < 3 or len(grouped) != 3:
        return None
    groups = grouped[1]
    if grouped[0] != shape[0] or not groups or shape[1] % groups \
            or grouped[2] != shape[1] // groups * math.prod(shape[2:]):
        return None
    norm = ctx.sole(reshape.outputs[0])
    if norm is None or norm.op_type != "InstanceNormalization" or norm.domain \
            or norm.inputs[0] != reshape.outputs[0]:
        return None
    inner = [ctx.const(n) for n in norm.inputs[1:3]]
    if any(v is None or v.dtype != F32 or v.shape != (groups,) for v in inner):
        return None
    back = ctx.sole(norm.outputs[0])
    if back is None or back.op_type != "Reshape" or back.domain \
            or back.inputs[0] != norm.outputs[0] or ctx.shape(back.outputs[0]) != shape:
        return None
    group = [reshape, norm, back]
    sizer = _shape_of(back, x, ctx)
    if sizer is False:
        return None
    if sizer is not None:
        group.insert(2, sizer)
    channels, rank = shape[1], len(shape)
    scale = np.repeat(inner[0], channels // groups).astype(np.float64)
    bias = np.repeat(inner[1], channels // groups).astype(np.float64)
    out = back.outputs[0]
    for op in ("Mul", "Add"):
        layer = ctx.sole(out)
        factor = None if layer is None else _per_channel(layer, out, op, channels, rank, ctx)
        if factor is None:
            continue
        if op == "Mul":
            scale, bias = scale * factor, bias * factor
        else:
            bias = bias + factor
        group.append(layer)  # type: ignore[arg-type]
        out = layer.outputs[0]  # type: ignore[union-attr]
    epsilon = float(norm.attrs.get("epsilon", 1e-5))
    fused = Layer("+".join(lay.name for lay in group), "GroupNorm", [x], [out],
                  {"groups": groups, "epsilon": epsilon, "scale": scale.astype(np.float32),
                   "bias": bias.astype(np.float32), "rank": rank}, FUSED_DOMAIN, 1)
    return group, fused


def _shape_of(back: Layer, x: str, ctx: Context) -> Layer | None | bool:
    """The Shape layer that gives ``back`` its shape, read by nothing else (taken into the
    group); None where the shape is a constant; False where it is anything else."""
    if ctx.const(back.inputs[1]) is not None:
        return None
    producer = ctx.graph.producers().get(back.inputs[1])
    if producer is None or producer.op_type != "Shape" or producer.domain \
            or producer.inputs[0] != x or producer.attrs.get("start", 0) \
            or producer.attrs.get("end") is not None or ctx.sole(back.inputs[1]) is not back \
            or id(producer) not in ctx.inside or id(producer) in ctx.taken:
        return False
    return producer


def _per_channel(layer: Layer, operand: str, op: str, channels: int, rank: int,
                 ctx: Context) -> np.ndarray | None:
    """The (channels,) values of the float32 constant ``layer`` (``operand <op> constant``)
    applies per channel (shape (C, 1, ...), (1, C, 1, ...), one value, or ones), else None."""
    if layer.op_type != op or layer.domain or len(layer.inputs) != 2 \
            or operand not in layer.inputs or layer.inputs[0] == layer.inputs[1]:
        return None
    value = ctx.const(layer.inputs[1 - layer.inputs.index(operand)])
    if value is None or value.dtype != F32 or value.ndim > rank:
        return None
    full = (1,) * (rank - value.ndim) + value.shape
    if full[0] != 1 or full[1] not in (1, channels) or any(n != 1 for n in full[2:]):
        return None
    return np.broadcast_to(value.reshape(-1), (channels,)).astype(np.float64)


def group_norm_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch

    a = layer.attrs
    view = (-1, *[1] * (a["rank"] - 2))
    scale = torch.from_numpy(np.ascontiguousarray(a["scale"])).reshape(view)
    bias = torch.from_numpy(np.ascontiguousarray(a["bias"])).reshape(view)
    groups, epsilon = a["groups"], a["epsilon"]

    def run(x: Any) -> tuple[Any]:
        y = torch.group_norm(x.contiguous(), groups, None, None, epsilon)  # not channels-last:
        if y.dtype != scale.dtype:  # kernels/network.group_normalization says why
            return (torch.addcmul(bias.to(y.dtype), y, scale.to(y.dtype)),)  # CpuAcc.precision
        return (torch.addcmul(bias, y, scale),)

    run.weights = (scale, bias)  # type: ignore[attr-defined]  # held with the workload
    return run
