"""Neural-network torch kernels: Conv, pools, Gemm / MatMul, normalizations, Softmax.

These are the plain, unfused kernels (weights arrive as inputs at run time); CpuAcc's fused and
prepacked forms of Conv and Gemm are in ``backends/torch/fusion.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import AUTO_PADS, spatial_pads
from backplane.backends.torch.kernels.common import FLOATS
from backplane.ir.graph import Layer, TensorInfo

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pad_both(x, begins, ends, value=0.0):
    widths = [w for b, e in zip(reversed(begins), reversed(ends)) for w in (b, e)]
    return F.pad(x, widths, value=value)


def conv(X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
         strides=None):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(X.shape[2:], W.shape[2:], strides, dilations, auto_pad, pads)
    if begins != ends:
        X, begins = _pad_both(X, begins, ends), [0] * rank
    return (_CONV[rank](X, W, B, strides, begins, dilations, group),)


def _pool_geometry(X, kernel_shape, auto_pad, dilations, pads, strides):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(X.shape[2:], kernel_shape, strides, dilations, auto_pad, pads)
    return strides, dilations, begins, ends


def max_pool(X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
             storage_order=0, strides=None, *, n_outputs=1):
    rank = X.dim() - 2
    strides, dilations, begins, ends = _pool_geometry(X, kernel_shape, auto_pad, dilations, pads,
                                                      strides)
    fits = begins == ends and all(2 * b <= k for b, k in zip(begins, kernel_shape))
    if not fits:  # torch pads symmetrically, at most half a window: pad here instead
        X, begins = _pad_both(X, begins, ends, -math.inf), [0] * rank
    pool = _MAX_POOL[rank]
    if n_outputs == 1:
        return (pool(X, kernel_shape, strides, begins, dilations, bool(ceil_mode)),)
    y, indices = pool(X, kernel_shape, strides, begins, dilations, bool(ceil_mode),
                      return_indices=True)
    planes = torch.arange(X.shape[0] * X.shape[1], device=X.device).reshape(*X.shape[:2],
                                                                          *[1] * rank)
    return y, indices + planes * math.prod(X.shape[2:])


def average_pool(X, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 kernel_shape=None, pads=None, strides=None):
    rank = X.dim() - 2
    strides, _, begins, ends = _pool_geometry(X, kernel_shape, auto_pad, dilations, pads, strides)
    fits = begins == ends and all(2 * b <= k for b, k in zip(begins, kernel_shape))
    if not fits:  # only reached when the padding counts (check_average_pool)
        X, begins = _pad_both(X, begins, ends), [0] * rank
    return (_AVG_POOL[rank](X, kernel_shape, strides, begins, bool(ceil_mode), bool(count_include_pad)),)


def global_average_pool(X):
    return (torch.mean(X, dim=tuple(range(2, X.dim())), keepdim=True),)


def global_max_pool(X):
    return (torch.amax(X, dim=tuple(range(2, X.dim())), keepdim=True),)


def gemm(A, B, C=None, alpha=1.0, beta=1.0, transA=0, transB=0):  # noqa: N803
    a = A.t() if transA else A
    b = B.t() if transB else B
    if C is None or beta == 0:
        y = a @ b
        return (y * alpha if alpha != 1.0 else y,)
    return (torch.addmm(C.expand(a.shape[0], b.shape[1]), a, b, beta=beta, alpha=alpha),)


def matmul(A, B):
    return (torch.matmul(A, B),)


def batch_normalization(X, scale, B, input_mean, input_var, epsilon=1e-5, momentum=0.9,
                        training_mode=0):
    return (F.batch_norm(X, input_mean, input_var, scale, B, False, 0.0, epsilon),)


def layer_normalization(X, Scale, B=None, axis=-1, epsilon=1e-5, stash_type=1, *, n_outputs=1):
    axis = axis % X.dim()
    normalized = tuple(X.shape[axis:])
    if n_outputs == 1 and tuple(Scale.shape) == normalized and (B is None or B.shape == Scale.shape):
        return (F.layer_norm(X, normalized, Scale, B, epsilon),)
    dims = tuple(range(axis, X.dim()))
    x = X.float() if X.dtype in (torch.float16, torch.bfloat16) else X
    mean = x.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(((x - mean) ** 2).mean(dim=dims, keepdim=True) + epsilon)
    y = ((x - mean) * inv_std).to(X.dtype) * Scale
    y = y + B if B is not None else y
    return (y, mean, inv_std)[:n_outputs]


def softmax(input, axis=-1):  # noqa: A002
    return (torch.softmax(input, axis),)


def log_softmax(input, axis=-1):  # noqa: A002
    return (torch.log_softmax(input, axis),)


def _coerced(fn):
    """Softmax before opset 13: over the 2-D coercion of the input at ``axis``."""
    def kernel(input, axis=1):  # noqa: A002
        flat = input.reshape(math.prod(input.shape[:axis]), -1)
        return (fn(flat, 1).reshape(input.shape),)
    kernel.__name__ = f"{fn.__name__}_v1"
    return kernel


def check_conv(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if inputs and inputs[0].shape is not None and not 3 <= len(inputs[0].shape) <= 5:
        return f"Conv of rank {len(inputs[0].shape)} (torch convolves 1 to 3 spatial axes)"
    return None


def check_max_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    reason = check_conv(layer, inputs)
    if reason:
        return reason
    if layer.attrs.get("storage_order", 0):
        return "storage_order=1 (column-major indices) not supported"
    if len(layer.outputs) > 1 and layer.outputs[1]:
        rank = len(layer.attrs.get("kernel_shape", []))
        pads = layer.attrs.get("pads") or [0] * 2 * rank
        if pads[:rank] != pads[rank:] or layer.attrs.get("auto_pad", "NOTSET") != "NOTSET":
            return "MaxPool indices with asymmetric or automatic padding"
    return None


def check_average_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    reason = check_conv(layer, inputs)
    if reason:
        return reason
    if any(d != 1 for d in layer.attrs.get("dilations") or []):
        return "AveragePool with dilations (torch's average pools have none)"
    rank = len(layer.attrs.get("kernel_shape", []))
    pads = layer.attrs.get("pads") or [0] * 2 * rank
    kernel = layer.attrs.get("kernel_shape", [])
    symmetric = pads[:rank] == pads[rank:] and all(2 * p <= k for p, k in zip(pads, kernel))
    if layer.attrs.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        symmetric = False
    if not symmetric and not layer.attrs.get("count_include_pad", 0):
        return "AveragePool with padding torch cannot express that the divisor must not count"
    return None


def check_batch_normalization(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("training_mode", 0):
        return "BatchNormalization in training mode"
    return None


KERNELS: KernelTable = {
    "Conv": {1: conv},
    "MaxPool": {8: max_pool},
    "AveragePool": {7: average_pool},
    "GlobalAveragePool": {1: global_average_pool},
    "GlobalMaxPool": {1: global_max_pool},
    "Gemm": {7: gemm},
    "MatMul": {1: matmul},
    "BatchNormalization": {9: batch_normalization},
    "LayerNormalization": {17: layer_normalization},
    "Softmax": {1: _coerced(torch.softmax), 13: softmax},
    "LogSoftmax": {1: _coerced(torch.log_softmax), 13: log_softmax},
}

CHECKS = {
    "Conv": check_conv,
    "MaxPool": check_max_pool,
    "AveragePool": check_average_pool,
    "BatchNormalization": check_batch_normalization,
}

INPUT_DTYPES = {op: FLOATS for op in KERNELS}
