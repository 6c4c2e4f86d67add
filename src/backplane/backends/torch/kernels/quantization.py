"""The linear quantization torch kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv. (The other math kernels: ``numeric.py``.)

Where NumPy (CpuRef, the spec) widens a computation, these kernels widen it the same way, so that
the results are the same values and not merely close ones: a dequantized value is its integer times
the scale (in float32 where that is exact, else float64), rounded once; an integer product is summed
in float64 (exact for 8-bit operands) and wrapped to int32 as an int32 matrix product would.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.torch.kernels.common import FLOATS, SIGNED, torch_dtype
from backplane.backends.torch.kernels.nn import conv
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo

UINT8 = np.dtype(np.uint8)
INTEGERS = SIGNED | {UINT8}
EIGHT_BITS = frozenset({UINT8, np.dtype(np.int8)})


def _broadcastable(param, x, axis, block_size):
    """A scale or zero point shaped to broadcast against x: a scalar, one value per index of
    ``axis``, or (``block_size``) one per block of that many consecutive indices."""
    if param.dim() == 0 or param.numel() == 1 and not block_size:
        return param.reshape(())
    axis = axis % x.dim()
    if block_size:
        return param.repeat_interleave(block_size, axis).narrow(axis, 0, x.shape[axis])
    return param.reshape([-1 if d == axis else 1 for d in range(x.dim())])


def _saturated(x, dtype):
    info = torch.iinfo(dtype)
    return torch.clamp(x, info.min, info.max).to(dtype)


SMALL_INTS = frozenset({torch.uint8, torch.int8, torch.int16, torch.uint16})
"""Integer types whose values less a zero point are exact in float32."""


def quantize_linear(x, y_scale, y_zero_point=None, axis=1, block_size=0, output_dtype=0,
                    saturate=1, precision=0):
    dtype = y_zero_point.dtype if y_zero_point is not None else \
        (torch_dtype(output_dtype) if output_dtype else torch.uint8)
    if x.dtype == torch.float32 and y_scale.dtype == torch.float32 and dtype in SMALL_INTS:
        # in float32, in place: rint(x / s) is exact there, and so is adding an 8- or 16-bit z
        # below 2^24; above it the clamp saturates either way (it was widened to float64)
        scale = _broadcastable(y_scale, x, axis, block_size)
        # a 0-d constant is cast at every call of a frozen trace, one of one axis is not
        q = torch.div(x, scale.reshape(1) if scale.dim() == 0 < x.dim() else scale).round_()
        if y_zero_point is not None:  # in float32 first: a frozen trace folds a constant's cast
            q = q.add_(_broadcastable(y_zero_point, x, axis, block_size).to(torch.float32))
        info = torch.iinfo(dtype)
        return (q.clamp_(info.min, info.max).to(dtype),)
    wide = torch.promote_types(x.dtype, y_scale.dtype)  # as NumPy: a 0-d scale widens x too
    scale = _broadcastable(y_scale, x, axis, block_size).to(wide)
    y = torch.round(x.to(wide) / scale).double()  # round half to even, as NumPy's rint
    if y_zero_point is not None:
        y = y + _broadcastable(y_zero_point, x, axis, block_size)
    return (_saturated(y, dtype),)


def dequantize_linear(x, x_scale, x_zero_point=None, axis=1, block_size=0, output_dtype=0):
    if x.dtype in SMALL_INTS and x_scale.dtype == torch.float32 and output_dtype in (0, 1):
        # one float32 tensor, computed in place: x - z is exact and the product rounds once, as
        # in float64 then rounded (an 8-bit tensor at 56x56x64 took 0.3 ms in int64 and float64)
        centred = x.float()
        if x_zero_point is not None:
            centred = centred.sub_(_broadcastable(x_zero_point, x, axis, block_size))
        return (centred.mul_(_broadcastable(x_scale, x, axis, block_size)),)
    centred = x.long()
    if x_zero_point is not None:
        centred = centred - _broadcastable(x_zero_point, x, axis, block_size).long()
    scale = _broadcastable(x_scale, x, axis, block_size)
    dtype = torch_dtype(output_dtype) if output_dtype else x_scale.dtype
    return ((centred.double() * scale.double()).to(dtype),)


def dynamic_quantize_linear(x):
    # uint8 over the range of x widened to include 0, so that 0 is exact: the scale is computed
    # in float64 and rounded once, as CpuRef's Python floats do
    low = torch.clamp_max(torch.amin(x), 0).double()
    high = torch.clamp_min(torch.amax(x), 0).double()
    scale = torch.where(high > low, (high - low) / 255, 1.0).float()
    zero = _saturated(torch.round(-low.float() / scale), torch.uint8)
    y = _saturated(torch.round(x / scale) + zero, torch.uint8)
    return y, scale, zero


def _wrapped(product):
    """An exact integer sum held in float64 as int32 wraps it (int64 first: a float beyond int32's
    range has no defined conversion)."""
    return product.long().int()


def mat_mul_integer(A, B, a_zero_point=None, b_zero_point=None):
    # in float64, exact for 8-bit operands (CUDA has no integer matrix product); A's zero point is
    # per row (M), B's per column (N)
    a = A.double() - (0 if a_zero_point is None else a_zero_point.double().reshape(-1, 1))
    b = B.double() - (0 if b_zero_point is None else b_zero_point.double())
    return (_wrapped(torch.matmul(a, b)),)


def q_linear_mat_mul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    (product,) = mat_mul_integer(a, b, a_zero_point, b_zero_point)
    multiplier = a_scale.float() * b_scale.float() / y_scale.float()
    y = torch.round(product.double() * multiplier.double()) + y_zero_point.double()
    return (_saturated(y, y_zero_point.dtype),)


def conv_integer(x, w, x_zero_point=None, w_zero_point=None, auto_pad="NOTSET", dilations=None,
                 group=1, kernel_shape=None, pads=None, strides=None):
    xs = x.double() - (0 if x_zero_point is None else x_zero_point.double())
    ws = w.double() - (0 if w_zero_point is None else _per_output(w_zero_point.double(), w))
    (y,) = conv(xs, ws, None, auto_pad, dilations, group, kernel_shape, pads, strides)
    return (_wrapped(y),)


def _per_output(param, w):
    """A weight scale or zero point, scalar or per output channel, against (M, C, *k) weights."""
    return param.reshape([-1] + [1] * (w.dim() - 1)) if param.numel() > 1 else param.reshape(())


def q_linear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
                  B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
                  strides=None):
    (acc,) = conv_integer(x, w, x_zero_point, w_zero_point, auto_pad, dilations, group,
                          kernel_shape, pads, strides)
    if B is not None:
        acc = acc + B.reshape(-1, *[1] * (x.dim() - 2))
    w_scale = w_scale.float().reshape(-1, *[1] * (x.dim() - 2))
    multiplier = x_scale.float() * w_scale / y_scale.float()
    y = torch.round(acc.double() * multiplier.double()) + y_zero_point.double()
    return (_saturated(y, y_zero_point.dtype),)


def check_quantize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("precision", 0):
        return "QuantizeLinear precision attribute not supported"
    zero = inputs[2].dtype if len(inputs) > 2 and inputs[2].dtype is not None else None
    output_dtype = layer.attrs.get("output_dtype", 0)
    dtype = zero or (onnx_to_numpy_dtype(output_dtype) if output_dtype else UINT8)
    if dtype not in INTEGERS:
        return f"QuantizeLinear to {dtype} (torch kernels quantize to int8, uint8, int16, int32)"
    return None


def check_dequantize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = inputs[0].dtype if inputs else None
    if dtype not in INTEGERS - {np.dtype(np.int64)}:
        return f"DequantizeLinear of {dtype} (torch kernels dequantize int8, uint8, int16, int32)"
    output_dtype = layer.attrs.get("output_dtype", 0)
    if output_dtype and onnx_to_numpy_dtype(output_dtype) not in FLOATS:
        return f"DequantizeLinear to {onnx_to_numpy_dtype(output_dtype)} (no torch type for it)"
    return None


KERNELS: KernelTable = {
    "QuantizeLinear": {10: quantize_linear},
    "DequantizeLinear": {10: dequantize_linear},
    "DynamicQuantizeLinear": {11: dynamic_quantize_linear},
    "MatMulInteger": {10: mat_mul_integer},
    "QLinearMatMul": {10: q_linear_mat_mul},
    "ConvInteger": {10: conv_integer},
    "QLinearConv": {10: q_linear_conv},
}

CHECKS = {
    "QuantizeLinear": check_quantize,
    "DequantizeLinear": check_dequantize,
}

INPUT_DTYPES = {
    "QuantizeLinear": FLOATS,
    **{op: EIGHT_BITS for op in ("MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv")},
}
"""Per op, the element types its first input may have (other inputs follow ONNX's type rules)."""
