"""Pools: MaxPool (with Indices), AveragePool, LpPool and their Global forms over sliding windows;
MaxUnpool.

Explicit padding is filled with a value the pool ignores (-inf for max, 0 for sums); ceil_mode adds
padding at the end so the last, partial window exists. AveragePool divides by the number of input
elements in the window, plus the explicit padding when count_include_pad (never the ceil padding).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import AUTO_PADS, sliding_windows, spatial_pads
from backplane.ir.graph import Layer, TensorInfo


def _geometry(x, kernel_shape, auto_pad, ceil_mode, dilations, pads, strides):
    """Strides, dilations, explicit (begins, ends) and the extra ends that ceil_mode needs."""
    rank = x.ndim - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(x.shape[2:], kernel_shape, strides, dilations, auto_pad, pads)
    extras = []
    for size, k, s, d, b, e in zip(x.shape[2:], kernel_shape, strides, dilations, begins, ends):
        extent = (k - 1) * d + 1
        count = (size + b + e - extent) / s + 1
        out = math.ceil(count) if ceil_mode else math.floor(count)
        if ceil_mode and (out - 1) * s >= size + b:  # the last window must start inside the input
            out -= 1
        extras.append(max(0, (out - 1) * s + extent - (size + b + e)))
    return strides, dilations, begins, ends, extras


def _pad(x, begins, ends, extras, value):
    widths = [(0, 0), (0, 0), *((b, e + x_) for b, e, x_ in zip(begins, ends, extras))]
    return np.pad(x, widths, constant_values=value)


def _lowest(dtype):
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


def max_pool(X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
             storage_order=0, strides=None, *, n_outputs=1):
    strides, dilations, begins, ends, extras = _geometry(X, kernel_shape, auto_pad, ceil_mode,
                                                         dilations, pads, strides)
    padded = _pad(X, begins, ends, extras, _lowest(X.dtype))
    windows = sliding_windows(padded, kernel_shape, strides, dilations)  # (N, C, *out, *k)
    y = functools.reduce(np.maximum, (windows[(Ellipsis, *offset)]  # one maximum per kernel offset
                                      for offset in itertools.product(*map(range, kernel_shape))))
    if n_outputs == 1:
        return (y,)
    flat = windows.reshape(*windows.shape[:X.ndim], -1)
    return y, _argmax_indices(X.shape, flat, kernel_shape, strides, dilations, begins, storage_order)


def _argmax_indices(shape, flat, kernel, strides, dilations, begins, storage_order):
    """The flat index into X of each window's (first) maximum, row- or column-major spatially."""
    rank = len(kernel)
    offsets = np.unravel_index(flat.argmax(axis=-1), kernel)
    out = flat.shape[2:2 + rank]
    coords = [np.arange(o).reshape([-1 if j == i else 1 for j in range(rank)]) * s - b + off * d
              for i, (o, s, b, off, d) in enumerate(zip(out, strides, begins, offsets, dilations))]
    coords = np.broadcast_arrays(*coords)
    spatial = np.ravel_multi_index(coords, shape[2:], order="F" if storage_order else "C")
    planes = np.arange(shape[0] * shape[1]).reshape(shape[0], shape[1], *[1] * rank)
    return (planes * math.prod(shape[2:]) + spatial).astype(np.int64)


def average_pool(X, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 kernel_shape=None, pads=None, strides=None):
    strides, dilations, begins, ends, extras = _geometry(X, kernel_shape, auto_pad, ceil_mode,
                                                         dilations, pads, strides)
    rank = len(kernel_shape)
    window_axes = tuple(range(-rank, 0))
    sums = sliding_windows(_pad(X, begins, ends, extras, 0), kernel_shape, strides, dilations)
    # The divisor: ones over the input (and the explicit padding when it counts), zeros elsewhere.
    ones = np.ones((1, 1, *X.shape[2:]), dtype=X.dtype)
    if count_include_pad:
        ones = np.pad(ones, [(0, 0), (0, 0), *zip(begins, ends)], constant_values=1)
        counted = _pad(ones, [0] * rank, [0] * rank, extras, 0)
    else:
        counted = _pad(ones, begins, ends, extras, 0)
    counts = sliding_windows(counted, kernel_shape, strides, dilations).sum(axis=window_axes)
    return ((sums.sum(axis=window_axes) / counts).astype(X.dtype),)


def lp_pool(X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None,
            strides=None):
    strides, dilations, begins, ends, extras = _geometry(X, kernel_shape, auto_pad, ceil_mode,
                                                         dilations, pads, strides)
    padded = _pad(np.abs(X) ** p, begins, ends, extras, 0)
    windows = sliding_windows(padded, kernel_shape, strides, dilations)
    return ((windows.sum(axis=tuple(range(X.ndim, windows.ndim))) ** (1 / p)).astype(X.dtype),)


def max_unpool(X, I, output_shape=None, kernel_shape=None, pads=None, strides=None):  # noqa: N803
    # I holds MaxPool's flat indices into the unpooled tensor of the default shape; everything
    # else is zero. A larger output_shape adds zeros after the end of each axis.
    rank = X.ndim - 2
    strides, pads = list(strides or [1] * rank), list(pads or [0] * 2 * rank)
    spatial = [(size - 1) * s + k - b - e for size, s, k, b, e
               in zip(X.shape[2:], strides, kernel_shape, pads[:rank], pads[rank:])]
    unpooled = np.zeros((*X.shape[:2], *spatial), dtype=X.dtype)
    unpooled.reshape(-1)[I.reshape(-1)] = X.reshape(-1)
    if output_shape is None:
        return (unpooled,)
    output = np.zeros([int(d) for d in output_shape], dtype=X.dtype)
    output[tuple(slice(0, d) for d in unpooled.shape)] = unpooled
    return (output,)


def global_average_pool(X):
    return (np.mean(X, axis=tuple(range(2, X.ndim)), keepdims=True, dtype=X.dtype),)


def global_max_pool(X):
    return (np.max(X, axis=tuple(range(2, X.ndim)), keepdims=True),)


def global_lp_pool(X, p=2):
    sums = np.sum(np.abs(X) ** p, axis=tuple(range(2, X.ndim)), keepdims=True)
    return ((sums ** (1 / p)).astype(X.dtype),)


def check_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if "kernel_shape" not in layer.attrs:
        return "kernel_shape attribute missing"
    return None


KERNELS: KernelTable = {
    "MaxPool": {1: max_pool},  # later opsets add attributes whose defaults keep the old behaviour
    "AveragePool": {1: average_pool},
    "LpPool": {2: lp_pool},
    "MaxUnpool": {9: max_unpool},
    "GlobalAveragePool": {1: global_average_pool},
    "GlobalMaxPool": {1: global_max_pool},
    "GlobalLpPool": {2: global_lp_pool},
}

CHECKS = {"MaxPool": check_pool, "AveragePool": check_pool, "LpPool": check_pool}
