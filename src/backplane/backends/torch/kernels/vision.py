"""Vision torch kernels: Resize and Upsample, RoiAlign, DeformConv.

Resize is separable: along each resized axis it weighs each output's taps, the nonzero entries of an (out, in) weight matrix
whose rows hold each output position's taps (nearest, linear or cubic, antialiased or not). The
weights depend on the sizes, scales and region of interest only, never on the data, so they are
built on the host by the spec's own code (CpuRef's ``resize`` helpers) and the product runs in
float64 on the tensor's device, as CpuRef runs it: every mode, coordinate transformation, nearest
rounding, cubic coefficient, antialias, aspect-ratio policy and axes subset CpuRef knows is claimed.
Where one of torch's upsampling kernels computes what CpuRef does, it runs instead, its border
outputs mended (``kernels/upsample.py``).

RoiAlign reads its regions on the host (how many samples a cell takes comes from the region's size
when sampling_ratio is 0), so GpuAcc does not capture it; DeformConv samples X bilinearly at the
offsets on the device.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.api.memory import check_allocation
from backplane.backends.reference.kernels import resize as spec
from backplane.backends.reference.kernels.roi_align import _bilinear, _samples
from backplane.backends.torch.kernels import upsample
from backplane.backends.torch.kernels.common import FLOATS, NUMBERS
from backplane.ir.graph import Layer, TensorInfo


def _host(value: Any) -> np.ndarray | None:
    """An optional host-read input (roi, scales, sizes) as a NumPy array, None if absent or empty."""
    if value is None:
        return None
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array if array.size else None


# -- Resize, Upsample ------------------------------------------------------------------------------
def resize(X, roi=None, scales=None, sizes=None, antialias=0, axes=None,
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
           extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", mode="nearest",
           nearest_mode="round_prefer_floor"):
    axes = list(range(X.dim())) if axes is None else [a % X.dim() for a in axes]
    in_sizes = [int(X.shape[a]) for a in axes]  # a trace's sizes are tensors: the taps need ints
    sizes, scales, roi = _host(sizes), _host(scales), _host(roi)
    if sizes is not None:
        out_sizes, factors = spec._from_sizes(in_sizes, [int(s) for s in sizes],
                                              keep_aspect_ratio_policy)
    else:
        factors = [float(s) for s in scales]
        out_sizes = [math.floor(n * f) for n, f in zip(in_sizes, factors)]
    shape = list(X.shape)
    for axis, n_out in zip(axes, out_sizes):
        shape[axis] = n_out
    check_allocation(shape, torch.float64, "Resize's output")  # computed in float64 (taps)
    fast = upsample.interpolated(X, axes, in_sizes, out_sizes, factors,
                                 coordinate_transformation_mode, mode, nearest_mode, antialias,
                                 cubic_coeff_a, exclude_outside)
    if fast is not None:
        return (fast,)
    y = X.to(torch.float64)
    outside = np.zeros((), dtype=bool)  # tf_crop_and_resize: positions sampled outside the input
    for i, (axis, n_in, n_out, factor) in enumerate(zip(axes, in_sizes, out_sizes, factors)):
        box = None if roi is None else (float(roi[i]), float(roi[i + len(axes)]))
        taps = _taps(coordinate_transformation_mode, n_in, n_out, factor, box, mode, nearest_mode,
                     cubic_coeff_a, antialias, exclude_outside)
        if not taps.identity:
            y = _resized(y, axis, taps)
        if coordinate_transformation_mode == "tf_crop_and_resize":
            outside = outside | spec._along(axis, X.dim(), taps.outside)
    if outside.any():
        y = y.masked_fill(_on_device(np.ascontiguousarray(outside), y.device), extrapolation_value)
    return (_round_like(y, X.dtype),)


class _Taps(NamedTuple):
    """One axis's taps: (out, k) input indices and weights (CpuRef's ``taps_of``), whether each
    weighs (``nonzero``), the indices flat, and the positions sampled outside the input."""

    index: np.ndarray
    weights: np.ndarray
    nonzero: np.ndarray
    flat: np.ndarray
    outside: np.ndarray
    on_cpu: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # flat, weights, nonzero as tensors
    identity: bool
    """Each output is its own input at weight 1, none sampled outside: the axis is left as it is
    (a batch or channel axis of scales 1: half the passes of a U-Net's 2-d Resize, 20-45 us of
    unet_resize_ts13's 340-370 a compiled run; a -0.0 stays -0.0, where a sum from zeros made it
    0.0)."""


@functools.lru_cache(maxsize=256)
def _taps(transformation, n_in, n_out, factor, box, mode, nearest_mode, cubic_coeff_a, antialias,
          exclude_outside) -> _Taps:
    """An axis's taps, made once per sizes and attributes: they depend on no value of the data,
    and making them (CpuRef's weights, a dense (out, in) matrix) costs more than the resize."""
    coords = spec._source_coordinates(transformation, n_in, n_out, factor, box)
    weights = _weights(coords, n_in, mode, nearest_mode, cubic_coeff_a, antialias, factor,
                       exclude_outside)
    index, weighs = spec.taps_of(weights)
    nonzero, flat = weighs != 0, np.ascontiguousarray(index.reshape(-1))
    outside = (coords < 0) | (coords > n_in - 1)
    identity = (n_out == n_in and index.shape[1] == 1 and bool((flat == np.arange(n_in)).all())
                and bool((weighs == 1).all()) and not outside.any())
    return _Taps(index, weighs, nonzero, flat, outside,
                 (torch.from_numpy(flat), torch.from_numpy(weighs), torch.from_numpy(nonzero)),
                 identity)


def _resized(y, axis: int, taps: _Taps):
    """``y`` resized along ``axis``, each output the weighed sum of its taps alone (CpuRef's
    ``taps_of``: a NaN or Inf reaches only the outputs that read it), summed in CpuRef's order.
    All taps are read in one gather, weighed in one product."""
    moved = y.movedim(axis, -1)
    if y.device.type == "cpu":
        flat, weights, nonzero = taps.on_cpu
    else:
        flat, weights, nonzero = (_on_device(a, y.device)
                                  for a in (taps.flat, taps.weights, taps.nonzero))
    read = moved.index_select(-1, flat).unflatten(-1, tuple(taps.index.shape))
    weighed = torch.where(nonzero, read * weights, 0.0)
    out = moved.new_zeros((*moved.shape[:-1], taps.index.shape[0]))
    for tap in range(taps.index.shape[1]):  # not in place: oneDNN Graph's fuser fails on add_
        out = out + weighed[..., tap]  # ("bad optional access", a OneDnnGraph holding a Resize)
    return out.movedim(-1, axis)


_UPLOADED: dict[tuple[str, str, tuple[int, ...], bytes], torch.Tensor] = {}
_UPLOAD_LIMIT = 64 << 20  # bytes of device memory the uploads below may keep
_uploaded_bytes = [0]


def _on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` (taps, weights, masks: made from shapes alone) as a tensor on ``device``, uploaded
    once per content and kept: the warm-up runs before a CUDA graph's capture upload it, and the
    capture reads the kept tensor (a copy from pageable host memory is refused during a capture,
    and the captured graph reads the tensor at every replay, so it is never freed). Past
    ``_UPLOAD_LIMIT`` bytes an upload is made per call and not kept: a capture then fails, and the
    subgraph runs layer by layer."""
    if device.type == "cpu":
        return torch.from_numpy(array)
    key = (str(device), array.dtype.str, array.shape, array.tobytes())
    tensor = _UPLOADED.get(key)
    if tensor is None:
        tensor = torch.from_numpy(array).to(device)
        if _uploaded_bytes[0] + array.nbytes <= _UPLOAD_LIMIT:
            _UPLOADED[key] = tensor  # a race uploads twice at worst: the same values
            _uploaded_bytes[0] += array.nbytes
    return tensor


def _weights(coords, n_in, mode, nearest_mode, cubic_coeff_a, antialias, factor,
             exclude_outside) -> np.ndarray:
    """The (out, in) float64 weights of one axis, built by CpuRef's code."""
    if mode == "nearest":
        return spec._nearest_weights(coords, n_in, nearest_mode)
    taps = spec._cubic_taps(cubic_coeff_a) if mode == "cubic" else spec._linear_taps
    stretch = min(factor, 1.0) if antialias else 1.0
    return spec._filter_weights(coords, n_in, taps, 2 if mode == "cubic" else 1, stretch,
                                exclude_outside)


def _round_like(y, dtype):
    if dtype.is_floating_point:
        return y.to(dtype)
    info = torch.iinfo(dtype)  # integers round half to even and saturate, as CpuRef
    return torch.clamp(torch.round(y), info.min, info.max).to(dtype)


def resize_v10(X, scales, mode="nearest"):
    # Opset 10 (and Upsample 9): asymmetric coordinates, nearest rounds down.
    return resize(X, scales=scales, coordinate_transformation_mode="asymmetric", mode=mode,
                  nearest_mode="floor")


def upsample_v7(X, scales, mode="nearest"):
    return resize_v10(X, np.asarray(scales, dtype=np.float32), mode)


def check_resize(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    return spec.check_resize(layer, inputs)


# -- RoiAlign --------------------------------------------------------------------------------------
def roi_align(X, rois, batch_indices, coordinate_transformation_mode="half_pixel", mode="avg",
              output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0):
    # rois (R, 4) are (x1, y1, x2, y2) in X's scale / spatial_scale -> Y (R, C, out_h, out_w);
    # where each cell samples is worked out on the host, the samples are read on the device
    half_pixel = coordinate_transformation_mode == "half_pixel"
    boxes = rois.detach().cpu().numpy().astype(np.float64)
    batches = batch_indices.detach().cpu().numpy().reshape(-1)
    Y = X.new_zeros((len(boxes), X.shape[1], output_height, output_width))
    for r, (roi, batch) in enumerate(zip(boxes, batches)):
        x1, y1, x2, y2 = roi * spatial_scale - (0.5 if half_pixel else 0.0)
        height, width = y2 - y1, x2 - x1
        if not half_pixel:  # the legacy mode makes every region at least one pixel
            height, width = max(height, 1.0), max(width, 1.0)
        grid_h = sampling_ratio or math.ceil(height / output_height)
        grid_w = sampling_ratio or math.ceil(width / output_width)
        ys = _bilinear(_samples(y1, height, output_height, grid_h), X.shape[2])
        xs = _bilinear(_samples(x1, width, output_width, grid_w), X.shape[3])
        image = X[int(batch)].to(torch.float64)
        terms = [_tensor(wy[:, None] * wx[None, :], X) * image[:, _index(iy, X)[:, None],
                                                               _index(ix, X)[None, :]]
                 for iy, wy in ys for ix, wx in xs]
        if mode == "avg":
            cells = sum(terms).reshape(-1, output_height, grid_h, output_width, grid_w)
            Y[r] = (cells.sum(dim=(2, 4)) / max(grid_h * grid_w, 1)).to(X.dtype)
        else:  # "max": the largest weighted corner of any sample in the cell
            cells = torch.stack(terms).amax(dim=0).reshape(-1, output_height, grid_h,
                                                           output_width, grid_w)
            Y[r] = cells.amax(dim=(2, 4)).to(X.dtype)
    return (Y,)


def _tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64)).to(like.device)


def _index(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(like.device)


def roi_align_v10(X, rois, batch_indices, mode="avg", output_height=1, output_width=1,
                  sampling_ratio=0, spatial_scale=1.0):
    return roi_align(X, rois, batch_indices, "output_half_pixel", mode, output_height,
                     output_width, sampling_ratio, spatial_scale)


def check_roi_align(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "avg")
    transform = layer.attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode not in ("avg", "max"):
        return f"RoiAlign mode {mode!r} not known (known: avg, max)"
    if transform not in ("half_pixel", "output_half_pixel"):
        return f"RoiAlign coordinate_transformation_mode {transform!r} not known"
    return None


# -- DeformConv ------------------------------------------------------------------------------------
def deform_conv(X, W, offset, B=None, mask=None, dilations=None, group=1, kernel_shape=None,
                offset_group=1, pads=None, strides=None):
    # offset (N, offset_group * prod(kernel) * rank, *out): per offset group, kernel tap and output
    # point, a shift per spatial axis of where the tap reads X; mask scales what it reads
    rank = X.dim() - 2
    kernel = list(kernel_shape or W.shape[2:])
    dilations, strides = dilations or [1] * rank, strides or [1] * rank
    pads = pads or [0] * 2 * rank
    n, channels, out = X.shape[0], X.shape[1], list(offset.shape[2:])
    taps = math.prod(kernel)
    offset = offset.to(torch.float64).reshape(n, offset_group, *kernel, rank, *out)
    mask = torch.ones((n, offset_group, *kernel, *out), dtype=torch.float64, device=X.device) \
        if mask is None else mask.to(torch.float64).reshape(n, offset_group, *kernel, *out)
    regular = _regular_positions(kernel, out, dilations, strides, pads, X.device)
    per_group = channels // offset_group
    x = X.to(torch.float64)
    columns = []  # (N, C / offset_group, *kernel, *out) per offset group
    for g in range(offset_group):
        coords = [regular[i] + offset[:, g].select(1 + rank, i) for i in range(rank)]
        read = _sample(x[:, g * per_group:(g + 1) * per_group], coords)
        columns.append(read * mask[:, g].unsqueeze(1))
    cols = torch.cat(columns, dim=1).reshape(n, group, channels // group, taps, -1)
    weights = W.to(torch.float64).reshape(group, W.shape[0] // group, channels // group, taps)
    Y = torch.einsum("ngckp,gmck->ngmp", cols, weights).reshape(n, W.shape[0], *out)
    if B is not None:
        Y = Y + B.to(torch.float64).reshape(-1, *[1] * rank)
    return (Y.to(X.dtype),)


def _regular_positions(kernel, out, dilations, strides, pads, device):
    """Where each kernel tap of each output point reads without offsets: per axis, (*k, *out)."""
    rank = len(kernel)
    positions = []
    for i in range(rank):
        tap = (torch.arange(kernel[i], dtype=torch.float64, device=device) * dilations[i]) \
            .reshape([-1 if d == i else 1 for d in range(2 * rank)])
        start = (torch.arange(out[i], dtype=torch.float64, device=device) * strides[i] - pads[i]) \
            .reshape([-1 if d == rank + i else 1 for d in range(2 * rank)])
        positions.append(tap + start)
    return positions


def _sample(x, coords):
    """x (N, C, *sizes) read bilinearly at per-axis coordinates (N, *points), zeros outside ->
    (N, C, *points), as CpuRef's grid_sample.sample with linear taps and zero padding."""
    n, channels, sizes = x.shape[0], x.shape[1], x.shape[2:]
    points = coords[0].shape[1:]
    flat = x.reshape(n, channels, -1)
    lows = [torch.floor(c) for c in coords]
    y = x.new_zeros((n, channels, *points))
    for corner in itertools.product((0, 1), repeat=len(sizes)):
        weight, index = torch.ones_like(coords[0]), torch.zeros_like(coords[0], dtype=torch.int64)
        inside = torch.ones_like(coords[0], dtype=torch.bool)
        for c, low, bit, size in zip(coords, lows, corner, sizes):
            t = c - low
            weight = weight * (t if bit else 1 - t)
            i = (low + bit).to(torch.int64)
            inside = inside & (i >= 0) & (i < size)
            index = index * size + i.clamp(0, size - 1)
        values = torch.gather(flat, 2, index.reshape(n, 1, -1).expand(n, channels, -1))
        values = torch.where(inside.reshape(n, 1, -1), values, 0.0)
        y = y + (values * weight.reshape(n, 1, -1)).reshape(n, channels, *points)
    return y


KERNELS: KernelTable = {
    "Resize": {10: resize_v10, 11: resize},  # attributes added at 18 and 19 default to the old ways
    "Upsample": {7: upsample_v7, 9: resize_v10},
    "RoiAlign": {10: roi_align_v10, 16: roi_align},
    "DeformConv": {19: deform_conv},
}

CHECKS = {"Resize": check_resize, "Upsample": check_resize, "RoiAlign": check_roi_align}

INPUT_DTYPES = {
    "Resize": NUMBERS,
    "Upsample": NUMBERS,
    "RoiAlign": FLOATS,
    "DeformConv": FLOATS,
}
"""Per op, the element types its first input may have (other inputs follow ONNX's type rules)."""
