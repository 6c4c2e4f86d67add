"""Linear quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, ConvInteger and
QLinearConv, for the integer types NumPy has (int4 / float8 are refused).

A scale and zero point are a scalar (per tensor), a 1-D tensor along ``axis`` (per channel), or a
tensor shaped like the input with ``axis`` divided into blocks of ``block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import conv
from backplane.backends.api.backend import is_numpy_native
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


def _saturate(values, dtype):
    info = np.iinfo(dtype)
    return np.clip(values, info.min, info.max).astype(dtype)


def quantize_linear(x, y_scale, y_zero_point=None, axis=1, block_size=0, output_dtype=0,
                    saturate=1, precision=0):
    dtype = _quantized_dtype(y_zero_point, output_dtype)
    scale = _broadcastable(y_scale, x, axis, block_size)
    zero = 0 if y_zero_point is None else \
        _broadcastable(y_zero_point, x, axis, block_size).astype(np.int64)
    return (_saturate(np.rint(x / scale) + zero, dtype),)  # rint rounds half to even


def _quantized_dtype(zero_point, output_dtype):
    if zero_point is not None:
        return zero_point.dtype
    return onnx_to_numpy_dtype(output_dtype) if output_dtype else np.dtype(np.uint8)


def dequantize_linear(x, x_scale, x_zero_point=None, axis=1, block_size=0, output_dtype=0):
    scale = _broadcastable(x_scale, x, axis, block_size)
    centred = x.astype(np.int64)
    if x_zero_point is not None:
        centred = centred - _broadcastable(x_zero_point, x, axis, block_size).astype(np.int64)
    dtype = onnx_to_numpy_dtype(output_dtype) if output_dtype else x_scale.dtype
    return ((centred * scale).astype(dtype),)


def dynamic_quantize_linear(x):
    # uint8 over the range of x widened to include 0, so that 0 is exact.
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = np.float32((high - low) / 255) if high > low else np.float32(1.0)
    zero = _saturate(np.rint(np.float32(0 - low) / scale), np.uint8)
    y = _saturate(np.rint(x / scale) + zero, np.uint8)
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
    return (_saturate(y, y_zero_point.dtype),)


def check_quantize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("precision", 0):
        return "QuantizeLinear precision attribute not supported"
    zero = inputs[2].dtype if len(inputs) > 2 and inputs[2].dtype is not None else None
    output_dtype = layer.attrs.get("output_dtype", 0)
    dtype = zero if zero is not None else (onnx_to_numpy_dtype(output_dtype) if output_dtype
                                           else np.dtype(np.uint8))
    if dtype is None or not is_numpy_native(dtype) or dtype.kind not in "iu":
        return f"quantizing to {dtype} not supported (NumPy integer types only)"
    return None


def check_dequantize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = inputs[0].dtype if inputs else None
    if dtype is None or not is_numpy_native(dtype) or dtype.kind not in "iu":
        return f"dequantizing {dtype} not supported (NumPy integer types only)"
    return None


KERNELS: KernelTable = {
    "QuantizeLinear": {10: quantize_linear},  # axis (13), block_size (21) etc. default to old ways
    "DequantizeLinear": {10: dequantize_linear},
    "DynamicQuantizeLinear": {11: dynamic_quantize_linear},
    "ConvInteger": {10: conv_integer},
    "QLinearConv": {10: q_linear_conv},
}

CHECKS = {"QuantizeLinear": check_quantize, "DequantizeLinear": check_dequantize}
