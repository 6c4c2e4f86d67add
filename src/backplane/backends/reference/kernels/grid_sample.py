"""AffineGrid and GridSample (2-D and N-D): sampling an input at normalized coordinates.

A grid holds, per output point, coordinates in [-1, 1] with the last spatial axis first (x, y, z).
``align_corners`` puts -1 and 1 at the centres of the corner pixels, else at their outer edges.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo


def affine_grid(theta, size, align_corners=0):
    # theta (N, r, r+1) maps the homogeneous base grid (x, y[, z], 1) of the output to the input.
    spatial = [int(s) for s in size[2:]]
    axes = [np.linspace(-1, 1, n) if align_corners else (2 * np.arange(n) + 1) / n - 1
            for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")  # one (*spatial) array per axis
    base = np.stack([*mesh[::-1], np.ones(spatial)], axis=-1).reshape(-1, len(spatial) + 1)
    grid = base @ np.swapaxes(theta, 1, 2)  # (N, points, r)
    return (grid.reshape(len(theta), *spatial, len(spatial)).astype(theta.dtype),)


def grid_sample(X, grid, align_corners=0, mode="linear", padding_mode="zeros"):
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)  # opset 16's names
    sizes = X.shape[2:]
    # Pixel coordinates, spatial axes in X's order: (N, *out) per axis.
    coords = [_denormalize(grid[..., -1 - i], n, align_corners) for i, n in enumerate(sizes)]
    if mode == "nearest":
        coords = [np.rint(c) for c in coords]  # half to even
    coords = [_fold_inside(c, n, align_corners, padding_mode) for c, n in zip(coords, sizes)]
    return (sample(X, coords, mode, align_corners, padding_mode).astype(X.dtype),)


def sample(X, coords, mode="linear", align_corners=0, padding_mode="zeros"):
    """X (N, C, *sizes) read at pixel coordinates: one (N, *out) array per spatial axis, the
    same for every channel -> (N, C, *out), interpolated (float64)."""
    sizes = X.shape[2:]
    taps = [_taps(c, mode) for c in coords]  # per axis: [(index, weight), ...]
    out = coords[0].shape[1:]
    Y = np.zeros((len(X), X.shape[1], *out), dtype=np.float64)
    batch = np.arange(len(X)).reshape(-1, *[1] * len(out))
    for combination in itertools.product(*taps):  # every corner of the interpolation window
        weight = np.prod([w for _, w in combination], axis=0)
        index, inside = zip(*(_pixel_index(i, n, align_corners, padding_mode)
                              for (i, _), n in zip(combination, sizes)))
        values = X[(batch, slice(None), *index)]  # (N, *out, C)
        values = np.where(np.logical_and.reduce(inside)[..., None], values, 0)
        Y += np.moveaxis(values * weight[..., None], -1, 1)
    return Y


def _denormalize(g, n, align_corners):
    return (g + 1) / 2 * (n - 1) if align_corners else ((g + 1) * n - 1) / 2


def _bounds(n, align_corners):
    return (0.0, n - 1.0) if align_corners else (-0.5, n - 0.5)


def _fold_inside(x, n, align_corners, padding_mode):
    """A coordinate outside the image: clamped to it (border) or mirrored into it (reflection)."""
    if padding_mode == "border":
        low, high = _bounds(n, align_corners)
        return np.where((x < low) | (x > high), np.clip(x, 0, n - 1), x)
    if padding_mode == "reflection":
        return _reflect(x, *_bounds(n, align_corners))
    return x


def _reflect(x, low, high):
    # Mirror at the borders until inside: an even number of folds keeps the direction.
    span = high - low
    if span == 0:
        return np.full_like(x, low)
    beyond = np.where(x < low, low - x, x - high)
    folds = np.floor(beyond / span)
    rest = beyond - folds * span
    even = folds % 2 == 0
    from_low = np.where(even, low + rest, high - rest)
    from_high = np.where(even, high - rest, low + rest)
    return np.where(x < low, from_low, np.where(x > high, from_high, x))


def _taps(x, mode):
    """The pixels around x on one axis and their weights (each list sums to 1)."""
    if mode == "nearest":
        return [(x.astype(np.int64), np.ones_like(x))]
    first = np.floor(x)
    t = x - first
    first = first.astype(np.int64)
    if mode == "linear":
        return [(first, 1 - t), (first + 1, t)]
    return [(first + k, _cubic(d)) for k, d in zip((-1, 0, 1, 2), (t + 1, t, 1 - t, 2 - t))]


def _cubic(d, a=-0.75):
    # Keys' cubic convolution kernel at distance d (0 <= d < 2), a = -0.75.
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


def _pixel_index(i, n, align_corners, padding_mode):
    """Where an integer tap reads, and whether it reads the image (zeros padding: else 0)."""
    if padding_mode == "border":
        return np.clip(i, 0, n - 1), np.ones(i.shape, bool)
    if padding_mode == "reflection":
        return np.clip(_reflect(i.astype(np.float64), *_bounds(n, align_corners)).astype(np.int64),
                       0, n - 1), np.ones(i.shape, bool)
    return np.clip(i, 0, n - 1), (i >= 0) & (i < n)


def check_grid_sample(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "linear")
    padding = layer.attrs.get("padding_mode", "zeros")
    if mode not in ("linear", "bilinear", "nearest", "cubic", "bicubic"):
        return f"GridSample mode {mode!r} not known"
    if padding not in ("zeros", "border", "reflection"):
        return f"GridSample padding_mode {padding!r} not known"
    return None


KERNELS: KernelTable = {
    "AffineGrid": {20: affine_grid},
    "GridSample": {16: grid_sample},  # N-D inputs (20) are a superset of the 4-D ones
}

CHECKS = {"GridSample": check_grid_sample}
