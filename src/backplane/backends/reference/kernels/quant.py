"""Linear quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, ConvInteger and
QLinearConv. QuantizeLinear and DequantizeLinear also take ml_dtypes' 2- and 4-bit integers, float8
and float4.

A scale and zero point are a scalar (per tensor), a 1-D tensor along ``axis`` (per channel), or a
tensor shaped like the input with ``axis`` divided into blocks of ``block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.cast import FLOAT8, SMALL_INTEGERS, is_integer, saturate_cast
from backplane.backends.reference.kernels.conv import conv
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo


def _broadcastable(param, x, axis, block_size):
    """A scale or zero point shaped to broadcast against x."""
    if param.ndim == 0 or param.size == 1 and block_size == 0:
        return param.reshape(())
    axis = axis % x.ndim
    if block_size:  # each value covers block_size consecutive elements along axis
        repeated = np.repeat(param, block_size, axis=axis)
        return np.take(repeated, np.arange(x.shape[axis]), axis=axis)
    return param.reshape([-1 if d == axis else 1 for d in range(x.ndim)])


QUANTIZED = frozenset({*map(np.dtype, (np.int8, np.uint8, np.int16, np.uint16, np.int32)),
                       *SMALL_INTEGERS, *FLOAT8, np.dtype(ml_dtypes.float4_e2m1fn)})
"""The types QuantizeLinear makes and DequantizeLinear reads (int32: DequantizeLinear's bias)."""


def quantize_linear(x, y_scale, y_zero_point=None, axis=1, block_size=0, output_dtype=0,
                    saturate=1, precision=0):
    dtype = _quantized_dtype(y_zero_point, output_dtype)
    scale = _broadcastable(y_scale, x, axis, block_size)
    zero = np.zeros((), np.int64) if y_zero_point is None else \
        _broadcastable(y_zero_point, x, axis, block_size)
    if is_integer(dtype):  # rint rounds half to even; integers always saturate
        return (saturate_cast(np.rint(x / scale) + zero.astype(np.int64), dtype),)
    scaled = x / scale + zero.astype(np.float32)  # float8 / float4: their zero point is 0
    return (saturate_cast(scaled, dtype) if saturate and dtype in FLOAT8 else scaled.astype(dtype),)


def _quantized_dtype(zero_point, output_dtype):
    if zero_point is not None:
        return zero_point.dtype
    return onnx_to_numpy_dtype(output_dtype) if output_dtype else np.dtype(np.uint8)


def dequantize_linear(x, x_scale, x_zero_point=None, axis=1, block_size=0, output_dtype=0):
    scale = _broadcastable(x_scale, x, axis, block_size)
    wide = np.int64 if is_integer(x.dtype) else np.float32
    centred = x.astype(wide)
    if x_zero_point is not None:
        centred = centred - _broadcastable(x_zero_point, x, axis, block_size).astype(wide)
    dtype = onnx_to_numpy_dtype(output_dtype) if output_dtype else x_scale.dtype
    return ((centred * scale).astype(dtype),)


def dynamic_quantize_linear(x):
    # uint8 over the range of x widened to include 0, so that 0 is exact.
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = np.float32((high - low) / 255) if high > low else np.float32(1.0)
    zero = saturate_cast(np.rint(np.float32(0 - low) / scale), np.uint8)
    y = saturate_cast(np.rint(x / scale) + zero, np.uint8)
    return y, np.array(scale, np.float32), np.array(zero, np.uint8)


def conv_integer(x, w, x_zero_point=None, w_zero_point=None, auto_pad="NOTSET", dilations=None,
                 group=1, kernel_shape=None, pads=None, strides=None):
    xs = x.astype(np.int32) - (0 if x_zero_point is None else x_zero_point.astype(np.int32))
    ws = w.astype(np.int32) - (0 if w_zero_point is None else _per_output(w_zero_point, w))
    return conv(xs, ws, None, auto_pad, dilations, group, kernel_shape, pads, strides)


def _per_output(param, w):
    """A weight scale or zero point, scalar or per output channel, against (M, C, *k) weights."""
    return param.astype(w.dtype if param.dtype.kind == "f" else np.int32).reshape(
        [-1] + [1] * (w.ndim - 1)) if param.size > 1 else param.reshape(())


def q_linear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
                  B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
                  strides=None):
    # Integer convolution of the centred operands, rescaled to y's scale and zero point.
    (acc,) = conv_integer(x, w, x_zero_point, w_zero_point, auto_pad, dilations, group,
                          kernel_shape, pads, strides)
    if B is not None:
        acc = acc + B.reshape(-1, *[1] * (x.ndim - 2))
    w_scale = w_scale.astype(np.float32).reshape(-1, *[1] * (x.ndim - 2))
    multiplier = x_scale.astype(np.float32) * w_scale / y_scale.astype(np.float32)
    y = np.rint(acc * multiplier) + y_zero_point.astype(np.int32)
    return (saturate_cast(y, y_zero_point.dtype),)


def check_quantize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("precision", 0):
        return "QuantizeLinear precision attribute not supported"
    zero = inputs[2].dtype if len(inputs) > 2 and inputs[2].dtype is not None else None
    output_dtype = layer.attrs.get("output_dtype", 0)
    dtype = zero if zero is not None else (onnx_to_numpy_dtype(output_dtype) if output_dtype
                                           else np.dtype(np.uint8))
    return None if dtype in QUANTIZED else f"quantizing to {dtype} not supported"


def check_dequantize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = inputs[0].dtype if inputs else None
    return None if dtype in QUANTIZED else f"dequantizing {dtype} not supported"


KERNELS: KernelTable = {
    "QuantizeLinear": {10: quantize_linear},  # axis (13), block_size (21) etc. default to old ways
    "DequantizeLinear": {10: dequantize_linear},
    "DynamicQuantizeLinear": {11: dynamic_quantize_linear},
    "ConvInteger": {10: conv_integer},
    "QLinearConv": {10: q_linear_conv},
}

CHECKS = {"QuantizeLinear": check_quantize, "DequantizeLinear": check_dequantize}

ANY_DTYPE = frozenset({"QuantizeLinear", "DequantizeLinear"})  # their CHECKS name the types
