"""Conv and ConvTranspose, for any number of spatial dimensions, through one matmul per layer.

Conv gathers every receptive field into a matrix (im2col, from a strided sliding-window view) and
multiplies it by the weights; ConvTranspose multiplies first and scatter-adds the products back, one
kernel offset at a time. The window helpers here serve the pools too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def spatial_pads(in_shape, kernel, strides, dilations, auto_pad="NOTSET", pads=None):
    """(begins, ends) of the padding of each spatial axis, explicit or from ``auto_pad``."""
    rank = len(in_shape)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(in_shape, kernel, strides, dilations):
            total = max(0, (math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2  # the odd one out goes last for UPPER
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return begins, ends
    if auto_pad == "VALID" or pads is None:
        return [0] * rank, [0] * rank
    return list(pads[:rank]), list(pads[rank:])


def sliding_windows(padded, kernel, strides, dilations):
    """A view (N, C, *out, *kernel) of every window of the already padded (N, C, *spatial)."""
    rank = len(kernel)
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    views = np.lib.stride_tricks.sliding_window_view(padded, extents, axis=tuple(range(2, 2 + rank)))
    steps = tuple(slice(None, None, s) for s in strides) + tuple(slice(None, None, d) for d in dilations)
    every = (slice(None), slice(None), *steps)
    return views[every]


def _defaults(x, strides, dilations):
    rank = x.ndim - 2
    return list(strides or [1] * rank), list(dilations or [1] * rank)


def conv(X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
         strides=None):
    strides, dilations = _defaults(X, strides, dilations)
    kernel, rank = W.shape[2:], X.ndim - 2
    begins, ends = spatial_pads(X.shape[2:], kernel, strides, dilations, auto_pad, pads)
    n, c, m, g = X.shape[0], X.shape[1], W.shape[0], group
    out = tuple((size + b + e - (k - 1) * d - 1) // s + 1 for size, b, e, k, d, s
                in zip(X.shape[2:], begins, ends, kernel, dilations, strides))
    depthwise = g == c == m and c > 1  # one multiply-add per kernel offset beats G tiny GEMMs
    acc = np.promote_types(X.dtype, np.float32) if depthwise else X.dtype  # float16 sums in float32
    if depthwise and c >= 2 * out[-1]:  # more channels than pixels in a row: NumPy's inner loop
        y = _depthwise_channels_last(X.astype(acc, copy=False), W.astype(acc, copy=False),  # along C
                                     begins, ends, strides, dilations, out)
    elif depthwise:
        padded = pad_spatial(X.astype(acc, copy=False), begins, ends)
        windows = sliding_windows(padded, kernel, strides, dilations)  # (N, C, *out, *k)
        weights = W.astype(acc, copy=False)
        y = np.zeros((n, c, *out), dtype=acc)
        for offset in itertools.product(*map(range, kernel)):
            y += windows[(Ellipsis, *offset)] * weights[(slice(None), 0, *offset)].reshape(c, *[1] * rank)
    else:
        # im2col: (N, G, C/G * k, out), one column per receptive field (a view for 1x1, stride 1)
        windows = sliding_windows(pad_spatial(X, begins, ends), kernel, strides, dilations)
        grouped = windows.reshape(n, g, c // g, *out, *kernel)
        order = (0, 1, 2, *range(3 + rank, 3 + 2 * rank), *range(3, 3 + rank))
        fields = c // g * math.prod(kernel)  # sizes, not -1: a batch of 0 has no -1
        columns = grouped.transpose(order).reshape(n, g, fields, math.prod(out))
        y = np.matmul(W.reshape(g, m // g, -1), columns).reshape(n, m, *out)  # (N, G, M/G, out)
    if B is not None:
        y += B.reshape(-1, *[1] * rank)
    return (y.astype(X.dtype, copy=False),)


def _depthwise_channels_last(X, W, begins, ends, strides, dilations, out):
    """Depthwise convolution on a zero-padded (N, *spatial, C) copy of X: each kernel offset is one
    multiply-add over contiguous channel rows, where (N, C, *spatial) gives NumPy rows as short as
    the image is narrow. Returns an (N, C, *out) view of the result."""
    n, c, *spatial = X.shape
    kernel = W.shape[2:]
    padded = np.zeros((n, *[s + b + e for s, b, e in zip(spatial, begins, ends)], c), X.dtype)
    padded[(slice(None), *[slice(b, b + s) for b, s in zip(begins, spatial)])] = np.moveaxis(X, 1, -1)
    weights = np.ascontiguousarray(np.moveaxis(W.reshape(c, *kernel), 0, -1))  # (*kernel, C)
    y = np.zeros((n, *out, c), X.dtype)
    product = np.empty_like(y)
    for offset in itertools.product(*map(range, kernel)):
        window = [slice(o * d, o * d + s * (size - 1) + 1, s)
                  for o, d, s, size in zip(offset, dilations, strides, out)]
        np.multiply(padded[(slice(None), *window)], weights[offset], out=product)
        y += product
    return np.moveaxis(y, -1, 1)


def pad_spatial(x, begins, ends):
    """Zero-pad the spatial axes of (N, C, *spatial); no copy when there is nothing to pad."""
    if not any(begins) and not any(ends):
        return x
    if min(*begins, *ends) < 0:  # negative pads crop
        return np.pad(x, [(0, 0), (0, 0), *zip(begins, ends)])
    padded = np.zeros((*x.shape[:2], *[s + b + e for s, b, e in zip(x.shape[2:], begins, ends)]),
                      x.dtype)  # np.pad costs ~0.15 ms even on a small tensor
    padded[(Ellipsis, *[slice(b, b + s) for b, s in zip(begins, x.shape[2:])])] = x
    return padded


def conv_transpose(X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    strides, dilations = _defaults(X, strides, dilations)
    n, c, g = X.shape[0], X.shape[1], group
    kernel, ins, rank = W.shape[2:], X.shape[2:], X.ndim - 2
    m = W.shape[1] * g
    # Every input pixel times the whole kernel: (G, N * in, C/G) @ (G, C/G, M/G * k)
    pixels = X.reshape(n, g, c // g, math.prod(ins)).transpose(1, 0, 3, 2) \
        .reshape(g, n * math.prod(ins), c // g)  # sizes, not -1: a batch of 0 has no -1
    products = np.matmul(pixels, W.reshape(g, c // g, -1)).reshape(g, n, *ins, m // g, *kernel)
    products = products.transpose(1, 0, 2 + rank, *range(2, 2 + rank), *range(3 + rank, 3 + 2 * rank))
    products = products.reshape(n, m, *ins, *kernel)
    # Scatter-add into the unpadded output, one kernel offset at a time.
    full = np.zeros((n, m, *[s * (i - 1) + (k - 1) * d + 1
                             for i, k, s, d in zip(ins, kernel, strides, dilations)]), X.dtype)
    for offset in itertools.product(*map(range, kernel)):
        target = tuple(slice(o * d, o * d + s * (i - 1) + 1, s)
                       for o, d, s, i in zip(offset, dilations, strides, ins))
        into, source = (slice(None), slice(None), *target), (Ellipsis, *offset)
        full[into] += products[source]
    begins, sizes = _transpose_crop(full.shape[2:], ins, strides, auto_pad, output_padding,
                                    output_shape, pads)
    y = _window(full, begins, sizes)
    if B is not None:
        y = y + B.reshape(-1, *[1] * rank)
    return (y.astype(X.dtype),)


def _transpose_crop(full, ins, strides, auto_pad, output_padding, output_shape, pads):
    """Where the output starts in the unpadded result, and its size, per spatial axis."""
    rank = len(full)
    extra = list(output_padding or [0] * rank)
    if pads is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # The output is in * stride (or output_shape); the padding is split as in onnx's reference.
        sizes = list(output_shape[-rank:]) if output_shape else [i * s for i, s in zip(ins, strides)]
        totals = [f + e - o for f, e, o in zip(full, extra, sizes)]
        begins = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        return begins, sizes
    pads = list(pads or [0] * 2 * rank)
    if output_shape:
        return pads[:rank], list(output_shape[-rank:])
    return pads[:rank], [f + e - b - a for f, e, b, a in zip(full, extra, pads[:rank], pads[rank:])]


def _window(x, begins, sizes):
    """x[..., begin:begin+size] on each spatial axis, zeros where that runs past x's edges."""
    widths = [(max(0, -b), max(0, b + s - f)) for b, s, f in zip(begins, sizes, x.shape[2:])]
    padded = np.pad(x, [(0, 0), (0, 0), *widths])
    crop = (slice(None), slice(None), *(slice(max(b, 0), max(b, 0) + s) for b, s in zip(begins, sizes)))
    return padded[crop]


def check_conv(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    return None


KERNELS: KernelTable = {
    "Conv": {1: conv},
    "ConvTranspose": {1: conv_transpose},
}

CHECKS = {"Conv": check_conv, "ConvTranspose": check_conv}
