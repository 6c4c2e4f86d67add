"""Squeeze-and-excitation blocks: one SqueezeExcite workload on a vector of channels."""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import (
    F32,
    Context,
    activation,
    torch_post_op,
    weight_of,
)
from backplane.ir.graph import Layer


def match_squeeze_excite(gap: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """GlobalAveragePool -> 1x1 Conv -> activation -> 1x1 Conv -> gate -> Mul with the pooled input:
    the whole block on a vector of channels, as two small matrix products (oneDNN's convolution costs
    tens of microseconds a call on a 1x1 image, a matrix-vector product a few)."""
    x = gap.inputs[0]
    shape = ctx.shape(x)
    if gap.domain or shape is None or len(shape) != 4:
        return None
    group = [gap]
    reduce = _pointwise_conv(ctx.sole(gap.outputs[0]), shape[1], ctx)
    if reduce is None:
        return None
    group.append(reduce[0])
    act = activation(reduce[0].outputs[0], ctx)
    if act is None:
        return None
    group += act[0]
    expand = _pointwise_conv(ctx.sole(act[0][-1].outputs[0]), reduce[1].shape[0], ctx)
    gate = activation(expand[0].outputs[0], ctx) if expand is not None else None
    if expand is None or gate is None or gate[1][0] not in ("sigmoid", "hardsigmoid") \
            or expand[1].shape[0] != shape[1]:
        return None
    group += [expand[0], *gate[0]]
    mul = ctx.sole(gate[0][-1].outputs[0])
    if mul is None or mul.op_type != "Mul" or mul.domain or set(mul.inputs) != {x, gate[0][-1].outputs[0]}:
        return None
    group.append(mul)
    attrs = {"w1": reduce[1], "b1": reduce[2], "act": act[1], "w2": expand[1], "b2": expand[2],
             "gate": gate[1]}
    fused = Layer("+".join(lay.name for lay in group), "SqueezeExcite", [x], [mul.outputs[0]], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _pointwise_conv(conv: Layer | None, channels: int, ctx: Context,
                    ) -> tuple[Layer, np.ndarray, np.ndarray] | None:
    """A 1x1, unpadded, ungrouped Conv with constant weights on ``channels`` inputs: the layer, its
    weight as a (out, in) matrix and its bias."""
    if conv is None or conv.op_type != "Conv" or conv.domain:
        return None
    weight = ctx.const(conv.inputs[1])
    b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    bias = ctx.const(b_name)
    a = conv.attrs
    if weight is None or weight.dtype != F32 or weight.shape[1:] != (channels, 1, 1) \
            or (b_name and bias is None) or a.get("group", 1) != 1 or any(a.get("pads") or []) \
            or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") \
            or any(v != 1 for v in (a.get("strides") or []) + (a.get("dilations") or [])):
        return None
    bias = np.zeros(weight.shape[0], F32) if bias is None else bias
    return conv, np.ascontiguousarray(weight.reshape(weight.shape[0], channels)), bias.astype(F32)


def squeeze_excite_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch.nn.functional as F

    a = layer.attrs
    w1, b1, w2, b2 = (weight_of(a, k) for k in ("w1", "b1", "w2", "b2"))  # no copies in fp32
    act, gate = torch_post_op(a["act"]), torch_post_op(a["gate"])
    assert act is not None and gate is not None, "the matcher takes activations only"

    def run(x):
        s = gate(F.linear(act(F.linear(x.mean((2, 3)), w1, b1)), w2, b2))  # (N, C)
        return (x * s.view(*s.shape, 1, 1),)
    return run
