"""RoiAlign: each region of interest pooled to a fixed (output_height, output_width) grid from
bilinear samples, averaged or maxed per cell."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo


def roi_align(X, rois, batch_indices, coordinate_transformation_mode="half_pixel", mode="avg",
              output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0):
    # rois (R, 4) are (x1, y1, x2, y2) in X's scale / spatial_scale -> Y (R, C, out_h, out_w).
    half_pixel = coordinate_transformation_mode == "half_pixel"
    Y = np.zeros((len(rois), X.shape[1], output_height, output_width), dtype=X.dtype)
    for r, (roi, batch) in enumerate(zip(rois.astype(np.float64), batch_indices)):
        x1, y1, x2, y2 = roi * spatial_scale - (0.5 if half_pixel else 0.0)
        height, width = y2 - y1, x2 - x1
        if not half_pixel:  # the legacy mode makes every region at least one pixel
            height, width = max(height, 1.0), max(width, 1.0)
        # Samples per cell and axis: sampling_ratio, else as many as the cell is pixels wide.
        grid_h = sampling_ratio or math.ceil(height / output_height)
        grid_w = sampling_ratio or math.ceil(width / output_width)
        ys = _samples(y1, height, output_height, grid_h)  # (out_h * grid_h,)
        xs = _samples(x1, width, output_width, grid_w)
        terms = [wy[:, None] * wx[None, :] * X[batch][:, iy[:, None], ix[None, :]]
                 for iy, wy in _bilinear(ys, X.shape[2]) for ix, wx in _bilinear(xs, X.shape[3])]
        if mode == "avg":
            cells = sum(terms).reshape(-1, output_height, grid_h, output_width, grid_w)
            Y[r] = cells.sum(axis=(2, 4)) / max(grid_h * grid_w, 1)
        else:  # "max": the largest weighted corner of any sample in the cell
            cells = np.max(terms, axis=0).reshape(-1, output_height, grid_h, output_width, grid_w)
            Y[r] = cells.max(axis=(2, 4))
    return (Y,)


def roi_align_v10(X, rois, batch_indices, mode="avg", output_height=1, output_width=1,
                  sampling_ratio=0, spatial_scale=1.0):
    # Before opset 16 regions had no half-pixel shift: "output_half_pixel" names that.
    return roi_align(X, rois, batch_indices, "output_half_pixel", mode, output_height,
                     output_width, sampling_ratio, spatial_scale)


def _samples(start, length, cells, per_cell):
    """Sample coordinates on one axis: per_cell evenly spaced in each of `cells` equal cells."""
    return start + (np.arange(cells)[:, None] + (np.arange(per_cell) + 0.5) / per_cell) \
        .reshape(-1) * (length / cells)


def _bilinear(coords, size):
    """The two pixels around each coordinate and their weights. A sample further than one pixel
    outside the image reads 0; one at or past the last pixel reads that pixel."""
    valid = (coords >= -1.0) & (coords <= size)
    coords = np.maximum(coords, 0)
    low = coords.astype(np.int64)
    at_edge = low >= size - 1
    low = np.where(at_edge, size - 1, low)
    high = np.where(at_edge, size - 1, low + 1)
    frac = np.where(at_edge, 0.0, coords - low)
    return [(low, (1 - frac) * valid), (high, frac * valid)]


def check_roi_align(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "avg")
    transform = layer.attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode not in ("avg", "max"):
        return f"RoiAlign mode {mode!r} not known (known: avg, max)"
    if transform not in ("half_pixel", "output_half_pixel"):
        return f"RoiAlign coordinate_transformation_mode {transform!r} not known"
    return None


KERNELS: KernelTable = {
    "RoiAlign": {10: roi_align_v10, 16: roi_align},
}

CHECKS = {"RoiAlign": check_roi_align}
