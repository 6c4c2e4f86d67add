"""The QOperator format's integer layers as float products of exact integers, one layer each.

[QuantizeLinear ->] QLinearConv [-> DequantizeLinear [-> activation] | -> QLinearAdd(residual)
| -> MaxPool] becomes one ``QLinearConv`` and [QuantizeLinear ->] QLinearMatMul [-> DequantizeLinear
[-> Add(constant)] [-> activation]] one ``QLinearMatMul`` (both in CpuAcc's domain), with constant
weights, scales and zero points. The QLinearAdd is ONNX Runtime's (com.microsoft), a residual
block's sum in the QOperator format: the convolution's requantized output and the other operand
are added as ONNX Runtime's kernel adds them (``_residual_finisher``).

How: ONNX Runtime is the reference for these ops, and it requantizes in float32 (MLAS: the int32
sum as float32 times the float32 multiplier s_x * s_w / s_y, rounded half to even, plus z_y,
saturated); so does this route. The input centred on its zero point is small integers, held
exactly in float32; the product (FusedConv's and Linear's routes, measured at load: oneDNN with a
prepacked weight, torch's, MKL's) is by the centred weight times the multiplier per output
channel, and its bias times it (``_scaled``), so it gives the scaled sums, within a few float32
roundings of MLAS's; they are rounded, saturated and offset in float32, and, where a
DequantizeLinear follows, multiplied by its scale (an integer times a float32 scale, rounded
once). A value within float32 roundings of a half step may land one step from CpuRef's (which
requantizes in float64: the executable spec) or ONNX Runtime's, on few values (the full tier's
QOperator ResNet: 0.1% of its features, its logits equal). Match time still checks that no sum
of the centred integers can pass 2^24 (the weight split as 16 * high + low where it could, joined
again for this route), so the exact sums stay available to the int8 and GPU routes.

``dynamic_quant`` takes ``quantize_dynamic``'s DynamicQuantizeLinear -> MatMulInteger as exact float32
products of the centred integers too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.reference.kernels.conv import spatial_pads
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context, activation
from backplane.backends.torch.fusion.int8_cast import PASSES_FROM, integers, narrowed  # noqa: F401
from backplane.backends.torch.fusion.qlinear_float import (  # noqa: F401  # importable from here too
    SPLIT, max_pooled, qlinear_workload)
from backplane.backends.torch.fusion.quantized import RANGES, quant_params
from backplane.ir.graph import Layer

EXACT = 2 ** 24
"""Integers up to this are exact in float32: every sum of the products stays below it."""


def _zero_point(name: str, ctx: Context) -> tuple[float, tuple[int, int]] | None:
    """A scalar constant zero point of an 8- or 16-bit type: its value and its type's range."""
    zero = ctx.const(name)
    if zero is None or zero.size != 1 or zero.dtype not in RANGES:
        return None
    return float(zero.reshape(())), RANGES[zero.dtype]


def _input_side(layer: Layer, ctx: Context) -> tuple[list[Layer], str, dict[str, Any]] | None:
    """The integer input: its QuantizeLinear where it has one the layer alone reads (the layer
    then reads the float tensor), its zero point and the largest |x - zero point| it can hold."""
    zero = _zero_point(layer.inputs[2], ctx)
    scale = ctx.const(layer.inputs[1])
    if zero is None or scale is None or scale.size != 1:
        return None
    (x_zero, (low, high)), x = zero, layer.inputs[0]
    side = {"x_zero": x_zero, "reach": max(high - x_zero, x_zero - low), "into": None}
    made = ctx.graph.producers().get(x)
    if made is None or made.op_type != "QuantizeLinear" or made.domain or ctx.sole(x) is not layer \
            or id(made) not in ctx.inside or id(made) in ctx.taken:
        return [], x, side
    source = made.inputs[0]
    shape = ctx.graph.info(source).shape
    into = quant_params(made, ctx, 1, len(shape) if shape is not None else None)
    if ctx.graph.info(source).dtype != F32 or into is None \
            or (into["low"], into["high"]) != (low, high):
        return [], x, side
    return [made], source, {**side, "into": into}


def _output_side(layer: Layer, ctx: Context, bias_add: bool = False,
                 ) -> tuple[list[Layer], str, dict[str, Any]]:
    """What follows the integer output: a DequantizeLinear the layer alone feeds (then an Add of a
    constant where ``bias_add``, and an activation) or nothing."""
    y = layer.outputs[0]
    after = ctx.sole(y)
    side: dict[str, Any] = {"back": None, "add": None, "activation": None}
    if after is None or after.op_type != "DequantizeLinear" or after.domain \
            or after.attrs.get("output_dtype", 0) not in (0, 1):
        return [], y, side
    back = quant_params(after, ctx, 1, None)
    if back is None:
        return [], y, side
    group, out = [after], after.outputs[0]
    side["back"] = back
    add = ctx.sole(out)
    if bias_add and add is not None and add.op_type == "Add" and not add.domain:
        other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
        constant = ctx.const(other)
        shape = ctx.graph.info(out).shape
        if constant is not None and constant.dtype == F32 and shape is not None and \
                np.broadcast_shapes(constant.shape, tuple(shape)) == tuple(shape):
            side["add"], out = np.ascontiguousarray(constant), add.outputs[0]
            group.append(add)
    found = activation(out, ctx)
    if found is not None:
        group += found[0]
        side["activation"], out = found[1], found[0][-1].outputs[0]
    return group, out, side


def _residual_add(layer: Layer, ctx: Context) -> tuple[Layer, str, dict[str, Any]] | None:
    """ONNX Runtime's QLinearAdd that the layer's integer output alone feeds (a residual block's
    sum, the QOperator format's): with its scales and zero points constant scalars, the layer's
    output is dequantized, added to the other operand's and quantized again in the same layer.
    Returns the QLinearAdd, the other operand and their parameters."""
    y = layer.outputs[0]
    add = ctx.sole(y)
    if add is None or add.op_type != "QLinearAdd" or add.domain != "com.microsoft" \
            or len(add.inputs) != 8 or add.inputs.count(y) != 1 \
            or y not in (add.inputs[0], add.inputs[3]):
        return None  # a C zero point left out defaults to uint8's 0: not matched here
    mine = 0 if add.inputs[0] == y else 3
    names = add.inputs[mine + 1:mine + 3] + add.inputs[4 - mine:6 - mine] + add.inputs[6:8]
    values = [ctx.const(name) for name in names]
    zero_dtypes = {v.dtype for v in values[1::2] if v is not None}
    operands = {ctx.graph.info(name).dtype for name in (y, add.inputs[3 - mine])}
    if any(v is None or v.size != 1 for v in values) or len(zero_dtypes | operands) != 1 \
            or any(v.dtype != F32 for v in values[0::2]):  # type: ignore[union-attr]
        return None
    scalars = [np.array(v, F32).reshape(()) if k % 2 == 0 else int(v.reshape(()))  # type: ignore
               for k, v in enumerate(values)]
    keys = ("mine_scale", "mine_zero", "other_scale", "other_zero", "sum_scale", "sum_zero")
    return add, add.inputs[3 - mine], dict(zip(keys, scalars))


def _requant(layer: Layer, ctx: Context, x_scale: np.ndarray, w_scale: np.ndarray,
             shape: list[int]) -> dict[str, Any] | None:
    """The output's quantization: the multiplier s_x * s_w / s_y in float32 (as CpuRef and the
    torch kernel round it), shaped ``shape`` per output channel, the zero point and the range."""
    y_scale = ctx.const(layer.inputs[-2 if layer.op_type == "QLinearMatMul" else 6])
    zero = _zero_point(layer.inputs[-1 if layer.op_type == "QLinearMatMul" else 7], ctx)
    if y_scale is None or y_scale.size != 1 or zero is None or w_scale.dtype != F32:
        return None
    x_scale, y_scale = x_scale.astype(F32).reshape(()), y_scale.astype(F32).reshape(())
    multiplier = x_scale * w_scale.astype(F32) / y_scale
    multiplier = multiplier.reshape(shape) if multiplier.size > 1 else multiplier.reshape(())
    return {"multiplier": np.array(multiplier, F32), "y_zero": zero[0],
            "y_low": zero[1][0], "y_high": zero[1][1]}


def _centred_weight(w: np.ndarray | None, zero: np.ndarray | None,
                    per_row: bool) -> np.ndarray | None:
    """w minus its zero point (a scalar, or one per output channel: rows of a (M, ...) convolution
    weight, columns of a (K, N) matrix), as float32."""
    if w is None or w.dtype not in RANGES or (zero is not None and zero.dtype != w.dtype):
        return None
    centred = w.astype(np.int64)
    if zero is not None and zero.size > 1:
        zero = zero.reshape([-1] + [1] * (w.ndim - 1)) if per_row else zero.reshape(1, -1)
    return (centred - (0 if zero is None else zero.astype(np.int64))).astype(F32)


def match_qlinear_conv(conv: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """QLinearConv of a 4-D input, constant weight, scales, zero points and bias, whose sums are
    exact in float32; with the QuantizeLinear before it and DequantizeLinear after it it owns."""
    if conv.domain or len(conv.inputs) < 8:
        return None
    w_zero_name = conv.inputs[5]
    weight = _centred_weight(ctx.const(conv.inputs[3]), ctx.const(w_zero_name), per_row=True)
    w_scale, info = ctx.const(conv.inputs[4]), ctx.graph.info(conv.inputs[0])
    b_name = conv.inputs[8] if len(conv.inputs) > 8 else ""
    bias = ctx.const(b_name)
    if weight is None or weight.ndim != 4 or w_scale is None or not info.is_static \
            or len(info.shape) != 4 or (b_name and bias is None) \
            or (w_zero_name and ctx.const(w_zero_name) is None):
        return None
    inside = _input_side(conv, ctx)  # None where x's scale is no constant
    if inside is None:
        return None
    x_scale = ctx.const(conv.inputs[1])
    requant = _requant(conv, ctx, x_scale, w_scale, [1, -1, 1, 1])  # type: ignore[arg-type]
    if requant is None:
        return None
    before, x, side = inside
    bias = np.zeros(weight.shape[0], F32) if bias is None else bias.astype(np.float64)
    split = _exact_split(weight, bias, side["reach"], int(conv.attrs.get("group", 1)))
    if split is None:
        return None
    weight, bias, halves = split
    after, out, out_side = _output_side(conv, ctx)
    other, residual, pool = [], None, None
    if not after:
        found = _residual_add(conv, ctx)
        if found is not None:
            after, out, other, residual = [found[0]], found[0].outputs[0], [found[1]], found[2]
        else:
            pooled = _max_pool_after(conv, ctx)
            if pooled is not None:
                after, out, pool = [pooled[0]], pooled[0].outputs[0], pooled[1]
    strides = list(conv.attrs.get("strides") or [1, 1])
    dilations = list(conv.attrs.get("dilations") or [1, 1])
    begins, ends = spatial_pads(info.shape[2:], weight.shape[2:], strides, dilations,
                                conv.attrs.get("auto_pad", "NOTSET"), conv.attrs.get("pads"))
    # The FusedConv attributes conv_workload reads: its routes compute the integer product.
    attrs = {"weight": weight, "bias": bias, "strides": strides, "dilations": dilations,
             "group": int(conv.attrs.get("group", 1)), "begins": begins, "ends": ends,
             "input_shape": list(info.shape),
             "output_shape": list(ctx.graph.info(conv.outputs[0]).shape or []),
             "binary": False, "unary": None, **side, **requant, **out_side, "residual": residual,
             "split": halves, "pool": pool}
    from backplane.backends.torch.fusion.int8_qlinear import qlinear_int8

    attrs["int8"] = qlinear_int8(conv, ctx, attrs)
    group = [*before, conv, *after]
    fused = Layer("+".join(lay.name for lay in group), "QLinearConv", [x, *other], [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _max_pool_after(conv: Layer, ctx: Context) -> tuple[Layer, dict[str, Any]] | None:
    """A 2-D MaxPool (one output, explicit pads torch takes: equal at both ends, at most half a
    window) that the QLinearConv's integer output alone feeds, and its window (the stem of a
    QOperator ResNet: pooled as integers, it was a float copy of the largest activation)."""
    pool = ctx.sole(conv.outputs[0])
    if pool is None or pool.op_type != "MaxPool" or pool.domain or len(pool.outputs) != 1 \
            or pool.attrs.get("auto_pad", "NOTSET") != "NOTSET" \
            or pool.attrs.get("storage_order", 0) or len(pool.attrs.get("kernel_shape", ())) != 2:
        return None
    kernel = list(pool.attrs["kernel_shape"])
    pads = list(pool.attrs.get("pads") or [0] * 4)
    if pads[:2] != pads[2:] or any(2 * p > k for p, k in zip(pads, kernel)):
        return None
    return pool, {"kernel": kernel, "strides": list(pool.attrs.get("strides") or kernel),
                  "pads": pads[:2], "dilations": list(pool.attrs.get("dilations") or [1, 1]),
                  "ceil_mode": bool(pool.attrs.get("ceil_mode", 0))}


def _exact_split(weight: np.ndarray, bias: np.ndarray, reach: float, group: int,
                 ) -> tuple[np.ndarray, np.ndarray, int | None] | None:
    """The convolution's weight and bias as float32 products can compute them exactly: as they
    are where every sum stays below 2^24; else (one group) the weight split as 16 * high + low
    (low in [0, 15]), the two stacked as 2M output channels of one convolution (the bias with the
    low half), each half's sums exact, combined in float64 (``split``: M); None where even the
    halves' sums could pass 2^24."""
    def exact(w: np.ndarray, b: np.ndarray) -> bool:
        return reach * float(np.abs(w).sum(axis=(1, 2, 3)).max()) + float(np.abs(b).max()) < EXACT

    if exact(weight, bias):
        return weight, bias.astype(F32), None
    low = np.mod(weight, SPLIT)
    high = (weight - low) / SPLIT
    if group != 1 or not exact(high, np.zeros(1)) or not exact(low, bias):
        return None
    stacked = np.concatenate([high, low]).astype(F32)
    return stacked, np.concatenate([np.zeros_like(bias), bias]).astype(F32), weight.shape[0]


def match_qlinear_matmul(matmul: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """QLinearMatMul by a constant 2-D matrix (per-tensor or per-column scale and zero point)."""
    if matmul.domain or len(matmul.inputs) != 8:
        return None
    b_zero = ctx.const(matmul.inputs[5])
    weight = _centred_weight(ctx.const(matmul.inputs[3]), b_zero, per_row=False)
    b_scale, info = ctx.const(matmul.inputs[4]), ctx.graph.info(matmul.inputs[0])
    if weight is None or weight.ndim != 2 or b_zero is None or b_scale is None \
            or not info.is_static or len(info.shape) < 2:
        return None
    inside = _input_side(matmul, ctx)  # None where a's scale is no constant
    if inside is None:
        return None
    a_scale = ctx.const(matmul.inputs[1])
    requant = _requant(matmul, ctx, a_scale, b_scale, [-1])  # type: ignore[arg-type]
    if requant is None:
        return None
    before, x, side = inside
    if side["reach"] * float(np.abs(weight).sum(axis=0).max()) >= EXACT:
        return None
    after, out, out_side = _output_side(matmul, ctx, bias_add=True)
    attrs = {"weight": np.ascontiguousarray(weight.T), "bias": None,
             "input_shape": list(info.shape), "unary": None, "binary": False,
             "output_shape": None, **side, **requant, **out_side}
    group = [*before, matmul, *after]
    fused = Layer("+".join(lay.name for lay in group), "QLinearMatMul", [x], [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused
