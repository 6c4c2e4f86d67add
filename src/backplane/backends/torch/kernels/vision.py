"""Vision torch kernels: Resize and Upsample, RoiAlign, DeformConv.

Resize is separable: along each resized axis it weighs each output's taps, the nonzero entries of an (out, in) weight matrix
whose rows hold each output position's taps (nearest, linear or cubic, antialiased or not). The
weights depend on the sizes, scales and region of interest only, never on the data, so they are
built on the host by the spec's own code (CpuRef's ``resize`` helpers) and the product runs in
float64 on the tensor's device, as CpuRef runs it: every mode, coordinate transformation, nearest
rounding, cubic coefficient, antialias, aspect-ratio policy and axes subset CpuRef knows is claimed.

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
    fast = _interpolated(X, axes, in_sizes, out_sizes, factors, coordinate_transformation_mode,
                         mode, nearest_mode, antialias, cubic_coeff_a, exclude_outside)
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


# torch's own upsampling kernels (float32 arithmetic, one pass, channels-last aware) compute what
# CpuRef does where ONNX's mode and coordinate transformation are theirs: (mode, transformation,
# nearest_mode) -> (torch's kernel family, align_corners). pytorch_half_pixel differs on a size-1
# output, the probe below finds it.
_TORCH_MODES = {
    ("nearest", "asymmetric", "floor"): ("nearest", None),
    ("nearest", "half_pixel", "round_prefer_ceil"): ("nearest_exact", None),
    ("nearest", "pytorch_half_pixel", "round_prefer_ceil"): ("nearest_exact", None),
    ("linear", "half_pixel", None): ("linear", False),
    ("linear", "pytorch_half_pixel", None): ("linear", False),
    ("linear", "align_corners", None): ("linear", True),
}
_TORCH_OPS = {("nearest", 1): "upsample_nearest1d", ("nearest", 2): "upsample_nearest2d",
              ("nearest", 3): "upsample_nearest3d",
              ("nearest_exact", 1): "_upsample_nearest_exact1d",
              ("nearest_exact", 2): "_upsample_nearest_exact2d",
              ("nearest_exact", 3): "_upsample_nearest_exact3d", ("linear", 1): "upsample_linear1d",
              ("linear", 2): "upsample_bilinear2d", ("linear", 3): "upsample_trilinear3d"}
_MOST_MENDED = 8  # outputs per axis: past one in this many mended, the taps path is cheaper
_MEND_FROM = 1 << 14
"""The fewest outputs worth mending: below, mending (four taps passes over slices, ~300 us of
calls) costs more than the taps path. A bilinear x2 on 1 thread, this project's 2-core AMD EPYC,
taps / torch and mending: (1, 8, 16, 16) 326-344 / 337-342 us, (1, 16, 32, 32) 961-2910 /
403-624 us, (1, 16, 64, 64) 5000-11800 / 670 us."""


def _interpolated(X, axes, in_sizes, out_sizes, factors, transformation, mode, nearest_mode,
                  antialias, cubic_coeff_a, exclude_outside):
    """X resized by torch's upsampling kernel, or None where that computes other than CpuRef.

    Each axis is probed once (``_probe``): torch's weights within float32 rounding of CpuRef's, the
    inputs each output reads a superset of CpuRef's taps. Where torch also reads an input at weight
    0 (linear at a clamped border or an exact input position: 0 * NaN would spread a NaN pixel, the
    issue test_resize_nan guards), those outputs are recomputed by the taps path and copied in."""
    family = _TORCH_MODES.get((mode, transformation, nearest_mode if mode == "nearest" else None))
    rank = X.dim() - 2
    # the CPU only: the probes run torch's CPU kernels (GpuAcc keeps the taps, untried on CUDA)
    if (family is None or antialias or X.dtype not in (torch.float32, torch.float64)
            or not 1 <= rank <= 3 or X.numel() == 0 or X.device.type != "cpu"):
        return None
    plan = dict(zip(axes, zip(in_sizes, out_sizes, factors)))
    if any(plan.get(a, (0, X.shape[a], 1.0))[1:] != (X.shape[a], 1.0) for a in (0, 1)):
        return None  # batch or channels resized: not torch's
    spatial = [plan.get(a) for a in range(2, X.dim())]
    if any(p is None or p[1] == 0 for p in spatial):
        return None  # an axis not resized (torch resizes all), or an empty output
    if rank > 1 and any(n_in == n_out for n_in, n_out, _ in spatial):
        # an axis of one size in and out: torch's 1-d kernel (the probe) copies it, its 2-d and
        # 3-d kernels weigh it, and an Inf column came out NaN (H x2, W x1)
        return None
    kind, align = family
    dtype = str(X.dtype)
    mended = [_probe(kind, align, n_in, n_out, factor, dtype, transformation, mode, nearest_mode,
                     cubic_coeff_a, exclude_outside) for n_in, n_out, factor in spatial]
    if any(m is None for m in mended):
        return None
    size = [n_out for _, n_out, _ in spatial]
    if any(len(rows) for rows in mended) and X.shape[0] * X.shape[1] * math.prod(size) < _MEND_FROM:
        return None  # mending costs more than the taps path saves
    op = getattr(torch._C._nn, _TORCH_OPS[kind, rank])
    scales = [factor for _, _, factor in spatial]
    y = op(X, size, align, *scales) if align is not None else op(X, size, *scales)
    if not any(len(rows) for rows in mended):
        return y
    copies = _copies(tuple(tuple(rows) for rows in mended), tuple(spatial), transformation, mode,
                     nearest_mode, cubic_coeff_a, exclude_outside) if rank <= 2 else None
    if copies is not None:
        return _copied(X, y, kind, align, spatial, copies)
    for axis, rows in enumerate(mended, start=2):
        if len(rows):
            y.index_copy_(axis, *_mend(X, axis, tuple(rows), tuple(spatial), transformation,
                                       mode, nearest_mode, cubic_coeff_a, exclude_outside))
    return y


@functools.lru_cache(maxsize=256)
def _copies(mended, spatial, transformation, mode, nearest_mode, cubic_coeff_a, exclude_outside):
    """Per spatial axis, the outputs to mend and the one input each copies (CpuRef's taps: one,
    at weight 1), None for an axis with none to mend; None where a mended output weighs two."""
    copies = []
    for rows, (n_in, n_out, factor) in zip(mended, spatial):
        if not rows:
            copies.append(None)
            continue
        taps = _taps(transformation, n_in, n_out, factor, None, mode, nearest_mode,
                     cubic_coeff_a, 0, exclude_outside)
        rows = np.asarray(rows, dtype=np.int64)
        if not ((taps.nonzero[rows].sum(axis=1) == 1).all()
                and (taps.weights[rows][taps.nonzero[rows]] == 1.0).all()):
            return None
        sources = taps.index[rows, taps.nonzero[rows].argmax(axis=1)]
        copies.append((torch.from_numpy(rows), torch.from_numpy(sources)))
    return tuple(copies)


def _copied(X, y, kind, align, spatial, copies):
    """``y`` (torch's resize of X, 1-d or 2-d) mended where its outputs copy one input (the
    borders of a half-pixel upsampling): along one axis a mended output is that input line
    resized along the other axis by torch's 1-d kernel, and where both axes' mended outputs cross,
    the input itself. The 1-d kernel reads at weight 0 only at the other axis's mended outputs,
    the crossings, which are written last. Where the taps path took 13 torch calls an axis in
    float64 (a U-Net's (1, 64, 128, 128) x2: 5.4-6.2 ms with it, torch's kernel alone 2.6-2.8)."""
    if X.dim() == 3:
        rows, sources = copies[0]
        return y.index_copy_(2, rows, X.index_select(2, sources))
    line = getattr(torch._C._nn, _TORCH_OPS[kind, 1])
    n, channels = X.shape[0], X.shape[1]
    for axis, copy in enumerate(copies, start=2):
        if copy is None:
            continue
        rows, sources = copy
        n_in, n_out, factor = spatial[3 - axis]  # the other axis's
        lines = X.index_select(axis, sources).movedim(axis, 2)  # (N, C, mended, other axis)
        flat = lines.reshape(n, channels * len(rows), n_in)
        out = line(flat, [n_out], align, factor) if align is not None else \
            line(flat, [n_out], factor)
        y.index_copy_(axis, rows, out.reshape(n, channels, len(rows), n_out).movedim(2, axis))
    if copies[0] is not None and copies[1] is not None:
        (rows_h, from_h), (rows_w, from_w) = copies
        y[:, :, rows_h[:, None], rows_w[None, :]] = X[:, :, from_h[:, None], from_w[None, :]]
    return y


@functools.lru_cache(maxsize=256)
def _probe(kind, align, n_in, n_out, factor, dtype, transformation, mode, nearest_mode,
           cubic_coeff_a, exclude_outside) -> np.ndarray | None:
    """One axis run through torch's 1-d kernel on probes: the outputs torch reads an input of at
    weight 0 that CpuRef does not read (to mend), or None where its weights or reads differ."""
    coords = spec._source_coordinates(transformation, n_in, n_out, factor, None)
    want = _weights(coords, n_in, mode, nearest_mode, cubic_coeff_a, 0, factor, exclude_outside)
    op = getattr(torch._C._nn, _TORCH_OPS[kind, 1])
    eye = torch.eye(n_in, dtype=getattr(torch, dtype.removeprefix("torch."))).unsqueeze(0)
    poisoned = eye.masked_fill(eye.bool(), float("nan"))  # input j is NaN in channel j
    args = (align,) if align is not None else ()
    with torch.no_grad():
        got = op(eye, [n_out], *args, factor)[0].T.double().numpy()
        reads = op(poisoned, [n_out], *args, factor)[0].T.isnan().numpy()
    taps = want != 0
    tolerance = 8 * n_in * float(torch.finfo(eye.dtype).eps)
    if (taps & ~reads).any() or not np.allclose(got, want, rtol=0, atol=tolerance):
        return None
    rows = np.flatnonzero((reads & ~taps).any(axis=1))
    return rows if len(rows) * _MOST_MENDED <= n_out else None


def _mend(X, axis, rows, spatial, transformation, mode, nearest_mode, cubic_coeff_a,
          exclude_outside):
    """Where the outputs at ``rows`` along ``axis`` go, and their values by the taps path (those
    rows first: the fewest outputs)."""
    where, read, picked, taps = _mend_plan(axis, rows, spatial, transformation, mode,
                                           nearest_mode, cubic_coeff_a, exclude_outside)
    y = _resized(X.index_select(axis, read).to(torch.float64), axis, picked)
    for other, axis_taps in enumerate(taps, start=2):
        if other != axis:
            y = _resized(y, other, axis_taps)
    return where, y.to(X.dtype)


@functools.lru_cache(maxsize=256)
def _mend_plan(axis, rows, spatial, transformation, mode, nearest_mode, cubic_coeff_a,
               exclude_outside):
    """``_mend``'s host work, once per sizes: the rows, the inputs they read (renumbered from 0
    in their taps), and every axis's taps."""
    taps = [_taps(transformation, n_in, n_out, factor, None, mode, nearest_mode, cubic_coeff_a, 0,
                  exclude_outside) for n_in, n_out, factor in spatial]
    rows = np.asarray(rows, dtype=np.int64)
    some = taps[axis - 2]
    read = np.unique(some.index[rows])
    index = np.searchsorted(read, some.index[rows])
    weights, nonzero = some.weights[rows], some.nonzero[rows]
    flat = np.ascontiguousarray(index.reshape(-1))
    picked = _Taps(index, weights, nonzero, flat, some.outside[rows],
                   (torch.from_numpy(flat), torch.from_numpy(np.ascontiguousarray(weights)),
                    torch.from_numpy(np.ascontiguousarray(nonzero))), False)
    return torch.from_numpy(rows), torch.from_numpy(read), picked, taps


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
