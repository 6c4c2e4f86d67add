"""Convolutions written over their sliding blocks: Col2Im (blocks back into an image, overlaps
summed) and DeformConv (each kernel tap read at a learned offset, bilinearly), N-D both."""

from __future__ import annotations

import math

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.grid_sample import sample


def col2im(input, image_shape, block_shape, dilations=None, pads=None, strides=None):  # noqa: A002
    # input (N, C * prod(block), L): column l of channel (c, k0, k1, ...) is kernel offset k of
    # block l; blocks tile the padded image by strides, row-major.
    image, kernel = [int(s) for s in image_shape], [int(s) for s in block_shape]
    rank = len(image)
    dilations, strides = dilations or [1] * rank, strides or [1] * rank
    pads = pads or [0] * 2 * rank
    padded = [n + pads[i] + pads[i + rank] for i, n in enumerate(image)]
    blocks = [(p - d * (k - 1) - 1) // s + 1
              for p, k, d, s in zip(padded, kernel, dilations, strides)]
    n, channels = input.shape[0], input.shape[1] // math.prod(kernel)
    columns = input.reshape(n, channels, *kernel, *blocks)
    output = np.zeros((n, channels, *padded), dtype=input.dtype)
    for offset in np.ndindex(*kernel):  # add every block's value at this kernel offset
        window = tuple(slice(o * d, o * d + (b - 1) * s + 1, s)
                       for o, d, b, s in zip(offset, dilations, blocks, strides))
        output[(slice(None), slice(None), *window)] += columns[(slice(None), slice(None), *offset)]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(rank))
    return (output[(slice(None), slice(None), *crop)],)


def deform_conv(X, W, offset, B=None, mask=None, dilations=None, group=1, kernel_shape=None,
                offset_group=1, pads=None, strides=None):
    # offset (N, offset_group * prod(kernel) * rank, *out): per offset group, kernel tap and output
    # point, a shift (one per spatial axis) of where the tap reads X; mask scales what it reads.
    rank = X.ndim - 2
    kernel = list(kernel_shape or W.shape[2:])
    dilations, strides = dilations or [1] * rank, strides or [1] * rank
    pads = pads or [0] * 2 * rank
    n, channels, out = len(X), X.shape[1], offset.shape[2:]
    taps = math.prod(kernel)
    offset = offset.reshape(n, offset_group, *kernel, rank, *out)
    mask = np.ones((n, offset_group, *kernel, *out)) if mask is None \
        else mask.reshape(n, offset_group, *kernel, *out)
    regular = _regular_positions(kernel, out, dilations, strides, pads)  # per axis (*k, *out)
    per_group = channels // offset_group
    columns = []  # (N, C/offset_group, *kernel, *out) per offset group
    for g in range(offset_group):
        coords = [regular[i] + np.take(offset[:, g], i, axis=1 + rank) for i in range(rank)]
        read = sample(X[:, g * per_group:(g + 1) * per_group], coords)  # zeros outside X
        columns.append(read * mask[:, g][:, None])
    cols = np.concatenate(columns, axis=1).reshape(n, group, channels // group, taps, -1)
    weights = W.reshape(group, W.shape[0] // group, channels // group, taps)
    Y = np.einsum("ngckp,gmck->ngmp", cols, weights).reshape(n, W.shape[0], *out)
    if B is not None:
        Y = Y + B.reshape(-1, *[1] * rank)
    return (Y.astype(X.dtype),)


def _regular_positions(kernel, out, dilations, strides, pads):
    """Where each kernel tap of each output point reads without offsets: per axis, (*k, *out)."""
    rank = len(kernel)
    positions = []
    for i in range(rank):
        tap = (np.arange(kernel[i]) * dilations[i]).reshape(
            [-1 if d == i else 1 for d in range(2 * rank)])
        start = (np.arange(out[i]) * strides[i] - pads[i]).reshape(
            [-1 if d == rank + i else 1 for d in range(2 * rank)])
        positions.append(tap + start)
    return positions


KERNELS: KernelTable = {
    "Col2Im": {18: col2im},
    "DeformConv": {19: deform_conv},
}
