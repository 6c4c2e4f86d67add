"""Resize and Upsample: separable interpolation, one (out, in) weight matrix per resized axis.

Nearest, linear and cubic interpolation are all separable, so an N-d resize is a 1-d resize along
each axis in turn, and a 1-d resize weighs each output position's taps, the nonzero entries of its
row of a small weight matrix (onnx's reference computes the same taps one point at a time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.api.memory import check_allocation
from backplane.ir.graph import Layer, TensorInfo

COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                    "asymmetric", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def resize(X, roi=None, scales=None, sizes=None, antialias=0, axes=None,
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
           extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", mode="nearest",
           nearest_mode="round_prefer_floor"):
    axes = list(range(X.ndim)) if axes is None else [a % X.ndim for a in axes]
    in_sizes = [X.shape[a] for a in axes]
    if sizes is not None and len(sizes):
        out_sizes, factors = _from_sizes(in_sizes, [int(s) for s in sizes], keep_aspect_ratio_policy)
    else:
        factors = [float(s) for s in scales]
        out_sizes = [math.floor(n * f) for n, f in zip(in_sizes, factors)]
    shape = list(X.shape)
    for axis, size in zip(axes, out_sizes):
        shape[axis] = size
    check_allocation(shape, np.float64, "Resize's output")  # computed in float64
    roi = None if roi is None or not len(roi) else np.asarray(roi, dtype=np.float64)
    y = X.astype(np.float64)
    outside = np.zeros((), dtype=bool)  # tf_crop_and_resize: positions sampled outside the input
    for i, (axis, n_in, n_out, factor) in enumerate(zip(axes, in_sizes, out_sizes, factors)):
        box = None if roi is None else (roi[i], roi[i + len(axes)])
        coords = _source_coordinates(coordinate_transformation_mode, n_in, n_out, factor, box)
        if mode == "nearest":
            weights = _nearest_weights(coords, n_in, nearest_mode)
        else:
            taps = _cubic_taps(cubic_coeff_a) if mode == "cubic" else _linear_taps
            stretch = min(factor, 1.0) if antialias else 1.0
            weights = _filter_weights(coords, n_in, taps, 2 if mode == "cubic" else 1, stretch,
                                      exclude_outside)
        y = _resized(y, axis, *taps_of(weights))
        if coordinate_transformation_mode == "tf_crop_and_resize":
            outside = outside | _along(axis, X.ndim, (coords < 0) | (coords > n_in - 1))
    y = np.where(outside, extrapolation_value, y)
    return (_round_like(y, X.dtype),)


def taps_of(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each output position's taps, the input positions its row of ``weights`` does not weigh 0:
    indices and weights, both (out, k) for k the most taps a position has (a position with fewer
    repeats a tap with the weight 0). Summing over the taps alone, not over the whole row as a
    matrix product does, keeps a NaN or Inf to the outputs that read it: 0 * NaN is NaN, and the
    product spread one NaN pixel over its whole row and column (and made an Inf NaN)."""
    nonzero = weights != 0
    k = max(int(nonzero.sum(axis=1).max(initial=0)), 1)
    index = np.argsort(~nonzero, axis=1, kind="stable")[:, :k]
    return index, np.take_along_axis(weights, index, axis=1)


def _resized(y: np.ndarray, axis: int, index: np.ndarray, weights: np.ndarray) -> np.ndarray:
    moved = np.moveaxis(y, axis, -1)
    out = np.zeros((*moved.shape[:-1], index.shape[0]))
    with np.errstate(invalid="ignore"):  # Inf * 0 where a row has fewer taps: masked out
        for tap in range(index.shape[1]):
            w = weights[:, tap]
            out += np.where(w != 0, moved[..., index[:, tap]] * w, 0.0)
    return np.moveaxis(out, -1, axis)


def _from_sizes(in_sizes, sizes, policy):
    if policy == "stretch":
        return sizes, [o / n for o, n in zip(sizes, in_sizes)]
    ratios = [o / n for o, n in zip(sizes, in_sizes)]
    factor = min(ratios) if policy == "not_larger" else max(ratios)
    return [math.floor(n * factor + 0.5) for n in in_sizes], [factor] * len(in_sizes)


def _source_coordinates(mode, n_in, n_out, factor, box):
    """Where each output position samples the input, in input coordinates."""
    x = np.arange(n_out, dtype=np.float64)
    float_out = factor * n_in  # onnx uses scale * input size, not the rounded output size
    if mode == "half_pixel":
        return (x + 0.5) / factor - 0.5
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / float_out)
        return offset + (x + 0.5) / factor - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / factor - 0.5 if float_out > 1 else np.full(n_out, -0.5)
    if mode == "align_corners":
        return x * (n_in - 1) / (float_out - 1) if float_out != 1 else np.zeros(n_out)
    if mode == "asymmetric":
        return x / factor
    start, end = box  # tf_crop_and_resize: the region of interest, as fractions of the input
    if float_out == 1:
        return np.full(n_out, (end - start) * (n_in - 1) / 2 + start * (n_in - 1))
    return x * (end - start) * (n_in - 1) / (float_out - 1) + start * (n_in - 1)


def _nearest_weights(coords, n_in, nearest_mode):
    picks = {
        "round_prefer_floor": np.ceil(coords - 0.5),
        "round_prefer_ceil": np.floor(coords + 0.5),
        "floor": np.floor(coords),
        "ceil": np.ceil(coords),
    }[nearest_mode]
    picks = np.clip(picks, 0, n_in - 1).astype(np.int64)
    weights = np.zeros((len(coords), n_in))
    weights[np.arange(len(coords)), picks] = 1
    return weights


def _linear_taps(distance):
    return np.clip(1 - np.abs(distance), 0, 1)


def _cubic_taps(a):
    def taps(distance):  # Keys' cubic convolution kernel
        d = np.abs(distance)
        near = ((a + 2) * d - (a + 3)) * d * d + 1
        far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
        return np.where(d <= 1, near, np.where(d < 2, far, 0))
    return taps


def _filter_weights(coords, n_in, taps, support, stretch, exclude_outside):
    """Rows of filter taps around each coordinate; edges repeat unless exclude_outside drops them.

    ``stretch`` < 1 widens the filter for antialiased downscaling; the taps are then normalized.
    """
    base = np.ceil(coords) - 1  # so that the fraction lies in (0, 1], as in onnx's reference
    first = math.floor(-support / stretch) + 1
    offsets = np.arange(first, 2 - first)  # symmetric about the fraction's midpoint
    index = base[:, None] + offsets[None, :]  # (out, taps)
    w = taps(stretch * (index - coords[:, None]))
    inside = (index >= 0) & (index <= n_in - 1)
    if exclude_outside:
        w = np.where(inside, w, 0)
    if stretch != 1.0 or exclude_outside:
        w = w / w.sum(axis=1, keepdims=True)
    weights = np.zeros((len(coords), n_in))
    rows = np.broadcast_to(np.arange(len(coords))[:, None], index.shape)
    np.add.at(weights, (rows, np.clip(index, 0, n_in - 1).astype(np.int64)), w)
    return weights


def _along(axis, ndim, mask):
    return mask.reshape([-1 if d == axis else 1 for d in range(ndim)])


def _round_like(y, dtype):
    if dtype.kind in "iu":  # integers round half to even and saturate, as ONNX Runtime does
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def resize_v10(X, scales, mode="nearest"):
    # Opset 10 (and Upsample): asymmetric coordinates, nearest rounds down.
    return resize(X, scales=scales, coordinate_transformation_mode="asymmetric", mode=mode,
                  nearest_mode="floor")


def upsample_v7(X, scales, mode="nearest"):
    return resize_v10(X, np.asarray(scales), mode)


def check_resize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    attrs = layer.attrs
    choices = {"mode": ("nearest", "linear", "cubic"), "nearest_mode": NEAREST_MODES,
               "coordinate_transformation_mode": COORDINATE_MODES,
               "keep_aspect_ratio_policy": ("stretch", "not_larger", "not_smaller")}
    for name, known in choices.items():
        if name in attrs and attrs[name] not in known:
            return f"{name}={attrs[name]!r} not known (known: {list(known)})"
    return None


KERNELS: KernelTable = {
    "Resize": {10: resize_v10, 11: resize},  # attributes added at 18 and 19 default to the old ways
    "Upsample": {7: upsample_v7, 9: resize_v10},
}

CHECKS = {"Resize": check_resize, "Upsample": check_resize}
