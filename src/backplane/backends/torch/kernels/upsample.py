"""Resize through torch's own upsampling kernels, where they compute what CpuRef does
(``vision.resize`` calls ``interpolated`` first, and takes the taps path where it returns None).

Why a module of its own: the probes and the mending of the outputs torch reads an input of at
weight 0 are most of the code, and ``kernels/vision.py`` holds the taps path they check against.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from backplane.backends.torch.kernels import vision


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
"""The fewest outputs worth mending by the taps: below, that mending (four taps passes over
slices, ~300 us of calls) costs more than the taps path. A bilinear x2 on 1 thread, this project's
2-core AMD EPYC, taps / torch and mending: (1, 8, 16, 16) 326-344 / 337-342 us, (1, 16, 32, 32)
961-2910 / 403-624 us, (1, 16, 64, 64) 5000-11800 / 670 us. Outputs that copy an input
(``_copies``) are mended at every size: taps / torch and copies, thread CPU us, load 11-13:
(1, 4, 8, 8) 430-473 / 341-440, (1, 8, 16, 16) 587-742 / 418-490, (1, 16, 16, 16) 963-1039 /
380-468."""


def interpolated(X, axes, in_sizes, out_sizes, factors, transformation, mode, nearest_mode,
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
    copies = None
    if any(len(rows) for rows in mended):
        copies = _copies(tuple(tuple(rows) for rows in mended), tuple(spatial), transformation,
                         mode, nearest_mode, cubic_coeff_a, exclude_outside) if rank <= 2 else None
        if copies is None and X.shape[0] * X.shape[1] * math.prod(size) < _MEND_FROM:
            return None  # mending by the taps costs more than the taps path saves
    op = getattr(torch._C._nn, _TORCH_OPS[kind, rank])
    if (copies is not None and align is False and all(_doubling(*axis) for axis in spatial)
            and X.shape[0] * X.shape[1] * math.prod(size) <= _REPLICATED_UP_TO):
        return _replicated(X, op, spatial)
    scales = [factor for _, _, factor in spatial]
    y = op(X, size, align, *scales) if align is not None else op(X, size, *scales)
    if copies is not None:
        return _copied(X, y, kind, align, spatial, copies)
    for axis, rows in enumerate(mended, start=2):
        if len(rows):
            y.index_copy_(axis, *_mend(X, axis, tuple(rows), tuple(spatial), transformation,
                                       mode, nearest_mode, cubic_coeff_a, exclude_outside))
    return y


_REPLICATED_UP_TO = 1 << 17
"""The most outputs ``_replicated`` makes: its result is a view into a padded output, and the full
tier's U-Net ((1, 16, 128, 128) x2, its Concat in a oneDNN Graph partition) ran 1.05x slower with it
(1 thread, thread CPU, 31 alternating blocks, load 5.8), though the resize alone was faster there
(2.19 -> 1.74 ms)."""


def _doubling(n_in: int, n_out: int, factor: float) -> bool:
    """An axis upsampled by 2, 4 or 8 exactly: its source coordinates (o + 0.5) / factor - 0.5 are
    exact in float32, and none but the clamped borders' falls on an input."""
    return factor in (2.0, 4.0, 8.0) and n_out == n_in * factor


def _replicated(X, op, spatial):
    """A half-pixel linear upsampling by 2, 4 or 8 (``_doubling``) whose border outputs copy the
    border input (``_copies``): torch's kernel on X padded by one replicated line on each side,
    and the outputs ``factor`` in from each end. There each source coordinate is the unpadded one
    plus 1, the same weights (exact: a power of two), and a border output reads the border input
    twice (its line and the replicated one) where the unpadded kernel read its neighbour at weight
    0: NaN and infinities where CpuRef has them, the interior bit for bit torch's, a border value
    w * x + (1 - w) * x within a rounding of x. Two calls where ``_copied`` made 17 (index_select,
    movedim, reshape, the 1-d kernel, index_copy_ per axis, the corners' index and index_put_):
    unet_resize_ts13's (1, 16, 16, 16) x2, 1 thread, thread CPU us, load 5.4: NCHW 394 -> 128,
    channels-last 372 -> 59."""
    import torch.nn.functional as F

    P = F.pad(X, [1, 1] * len(spatial), mode="replicate")
    factors = [factor for _, _, factor in spatial]
    y = op(P, [n_out + 2 * int(factor) for _, n_out, factor in spatial], False, *factors)
    for axis, (_, n_out, factor) in enumerate(spatial, start=2):
        y = y.narrow(axis, int(factor), n_out)
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
        taps = vision._taps(transformation, n_in, n_out, factor, None, mode, nearest_mode,
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
    coords = vision.spec._source_coordinates(transformation, n_in, n_out, factor, None)
    want = vision._weights(coords, n_in, mode, nearest_mode, cubic_coeff_a, 0, factor,
                           exclude_outside)
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
    y = vision._resized(X.index_select(axis, read).to(torch.float64), axis, picked)
    for other, axis_taps in enumerate(taps, start=2):
        if other != axis:
            y = vision._resized(y, other, axis_taps)
    return where, y.to(X.dtype)


@functools.lru_cache(maxsize=256)
def _mend_plan(axis, rows, spatial, transformation, mode, nearest_mode, cubic_coeff_a,
               exclude_outside):
    """``_mend``'s host work, once per sizes: the rows, the inputs they read (renumbered from 0
    in their taps), and every axis's taps."""
    taps = [vision._taps(transformation, n_in, n_out, factor, None, mode, nearest_mode,
                         cubic_coeff_a, 0, exclude_outside) for n_in, n_out, factor in spatial]
    rows = np.asarray(rows, dtype=np.int64)
    some = taps[axis - 2]
    read = np.unique(some.index[rows])
    index = np.searchsorted(read, some.index[rows])
    weights, nonzero = some.weights[rows], some.nonzero[rows]
    flat = np.ascontiguousarray(index.reshape(-1))
    picked = vision._Taps(index, weights, nonzero, flat, some.outside[rows],
                          (torch.from_numpy(flat), torch.from_numpy(np.ascontiguousarray(weights)),
                           torch.from_numpy(np.ascontiguousarray(nonzero))), False)
    return torch.from_numpy(rows), torch.from_numpy(read), picked, taps
