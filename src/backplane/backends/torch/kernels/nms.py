"""CpuAcc's and GpuAcc's NonMaxSuppression (in ``indexing.KERNELS``): the overlaps of every two
boxes in a few array calls, NumPy's for CPU tensors (a handful of small NumPy calls cost less
than torch's: a 32-box detector's NMS 4x less), torch's where the boxes are elsewhere; then the
greedy walk on the host with Python ints, each box's overlaps the bits of one int (one ``|`` per
kept box). The selections are CpuRef's (``reference/kernels/nms.py``), box for box."""

from __future__ import annotations

import numpy as np
import torch

from backplane.backends.torch.kernels.common import scalar

ONE_WORD = 64
"""Up to this many boxes every pair's overlaps are computed at once (each box's bits one word)."""


def non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, center_point_box=0):
    # boxes (B, N, 4), scores (B, C, N) -> selected_indices (K, 3): [batch, class, box] rows
    limit = 0 if max_output_boxes_per_class is None else max(int(_one(max_output_boxes_per_class)), 0)
    iou_limit = 0.0 if iou_threshold is None else _one(iou_threshold)
    threshold = None if score_threshold is None else float(_one(score_threshold))
    host_scores = scores.cpu().float().numpy() if scores.dtype == torch.bfloat16 else scores.cpu().numpy()
    if not limit or not host_scores.size:
        return (torch.zeros((0, 3), dtype=torch.int64, device=boxes.device),)
    on_host = boxes.device.type == "cpu" and boxes.dtype != torch.bfloat16
    if on_host:
        found = _on_host(boxes.numpy(), host_scores, center_point_box, iou_limit, limit, threshold)
        return (torch.from_numpy(found),)
    found = _on_host(boxes, host_scores, center_point_box, iou_limit, limit, threshold, torch)
    return (torch.from_numpy(found).to(boxes.device),)


def host_non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                             score_threshold=None, center_point_box=0):
    """The same selections of NumPy arrays (float16, 32 or 64), as NumPy: a detector's HostChain
    (``fusion/host_chain.py``) runs it on its inputs' NumPy views, one step with the layers after
    it, no torch tensor made between them."""
    limit = 0 if max_output_boxes_per_class is None \
        else max(int(_host_one(max_output_boxes_per_class)), 0)
    iou_limit = 0.0 if iou_threshold is None else _host_one(iou_threshold)
    threshold = None if score_threshold is None else float(_host_one(score_threshold))
    if not limit or not scores.size:
        return (np.zeros((0, 3), np.int64),)
    return (_on_host(boxes, scores, center_point_box, iou_limit, limit, threshold),)


def _on_host(boxes, scores, center_point_box, iou_limit, limit, threshold, xp=np):
    """The rows of the boxes (NumPy's, or torch's where ``xp`` is torch: the overlaps there, the
    walk on the host) and NumPy scores: past ``ONE_WORD`` boxes with a score threshold given, per
    batch item the overlaps of its candidates alone (the boxes above the threshold in some class:
    no other box is walked or suppresses one), where every pair's were (B, 2, N, N) arrays: 8400
    boxes, a YOLOv8 export's, 560 MB each."""
    host = (lambda overlaps: overlaps) if xp is np else (lambda overlaps: overlaps.cpu().numpy())
    if threshold is None or boxes.shape[-2] <= ONE_WORD:
        overlaps = _suppressing(boxes, center_point_box, iou_limit, xp)
        return _selected(host(overlaps), scores, limit, threshold)
    found = []
    for b in range(boxes.shape[0]):
        kept = np.flatnonzero((scores[b] > threshold).any(0))  # in box order: ties stay in it
        if not kept.size:
            continue
        at = kept if xp is np else torch.from_numpy(kept).to(boxes.device)
        overlaps = _suppressing(boxes[b:b + 1, at], center_point_box, iou_limit, xp)
        rows = _selected(host(overlaps), scores[b:b + 1, :, kept], limit, threshold)
        rows[:, 0], rows[:, 2] = b, kept[rows[:, 2]]
        found.append(rows)
    return np.concatenate(found) if found else np.zeros((0, 3), np.int64)


def _selected(overlaps, scores, limit, threshold):
    """The (K, 3) int64 rows [batch, class, box] of the greedy walk over ``overlaps`` (B, N, N)
    in each class's order of ``scores`` (B, C, N), NumPy arrays on the host."""
    return selected_by_rows(_bit_rows(overlaps), scores, limit, threshold)


def selected_by_rows(masks, scores, limit, threshold):
    """``_selected`` of the overlaps as bit rows (``_bit_rows``' per batch item a list of Python
    ints, bit j of row i where boxes i and j overlap; a negative int: bit 63 set), as GpuAcc's
    whole run computes them on the GPU (``gpu_nms.device_rows``)."""
    # best first; equal scores: the lower box index first; NaN last (CpuRef's order), so the
    # boxes above a threshold are the first of each order, as many as there are
    orders = np.argsort(-scores, axis=-1, kind="stable").tolist()
    counts = (scores > threshold).sum(-1).tolist() if threshold is not None \
        else [[scores.shape[-1]] * scores.shape[1]] * scores.shape[0]
    selected: list[int] = []  # the rows' values one after the other
    for b, (per_class, above) in enumerate(zip(orders, counts)):
        rows = masks[b]
        for c, (order, count) in enumerate(zip(per_class, above)):
            for box in _greedy(order[:count], rows, limit):
                selected += (b, c, box)
    return np.array(selected, dtype=np.int64).reshape(-1, 3)


def _host_one(value):
    """A one-element array's value (CpuRef's reading: its first element): ``item(0)``, one C call
    where reshape, index and item were three (0.96 -> 0.12 us, three a call)."""
    if isinstance(value, np.ndarray):
        return value.item(0)
    return np.asarray(value).reshape(-1)[0].item()


def _one(value):
    """A one-element tensor's value in one call (``scalar`` makes three)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else scalar(value)


def _bit_rows(overlaps):
    """(B, N, N) symmetric booleans as (B, N) Python ints, bit j of row i set where boxes i and j
    overlap: the greedy walk then suppresses with one ``|`` per kept box instead of a NumPy call."""
    batch, count = overlaps.shape[:2]
    packed = np.packbits(overlaps, axis=-1, bitorder="little")  # row i's bytes: box j's bit
    width = packed.shape[-1]
    if width in (1, 2, 4, 8):  # up to 64 boxes: each row one word, all converted in one call
        return packed.view(f"<u{width}")[..., 0].tolist()
    if width < 8:
        padded = np.zeros((batch, count, 8), np.uint8)
        padded[..., :width] = packed
        return padded.view("<u8")[..., 0].tolist()
    return [[int.from_bytes(row.tobytes(), "little") for row in rows] for rows in packed]


def _greedy(order, rows, limit):
    """The boxes kept from one class's candidates in ``order`` (best first), each kept box
    suppressing those its row of ``rows`` marks (IoU above the threshold with it)."""
    kept: list[int] = []
    suppressed = 0
    for box in order:
        if not suppressed >> box & 1:  # no kept box overlaps it
            kept.append(box)
            if len(kept) == limit:
                break
            suppressed |= rows[box]
    return kept


def _suppressing(boxes, center_point_box, limit, xp):
    """(B, N, N): where box i's IoU with box j is above ``limit`` (CpuRef's: 0 where the boxes do
    not overlap or the union is not positive; every pair for a NaN limit, which no IoU is at or
    under), in the order of CpuRef's arithmetic (the same roundings). The coordinates as planes
    (B, 4, N), so that every product runs along N (as (N, N, 2) NumPy's inner loops ran 2 long:
    3-6x the time at 64 boxes). ``xp``: NumPy or torch, as ``boxes`` is."""
    planes = np.ascontiguousarray(boxes.swapaxes(-1, -2)) if xp is np \
        else boxes.transpose(-1, -2).contiguous()
    first, second = planes[..., :2, :], planes[..., 2:, :]
    if center_point_box:  # (x_center, y_center, width, height)
        half = second / 2
        low, high = first - half, first + half
    else:  # any two opposite corners, y before x
        low, high = xp.minimum(first, second), xp.maximum(first, second)
    sides = xp.minimum(high[..., :, None], high[..., None, :]) \
        - xp.maximum(low[..., :, None], low[..., None, :])  # (B, 2, N, N): height, width
    size = high - low
    area = size[..., 0, :] * size[..., 1, :]
    intersection = sides[..., 0, :, :] * sides[..., 1, :, :]
    union = area[..., :, None] + area[..., None, :] - intersection
    overlap = (xp.minimum(sides[..., 0, :, :], sides[..., 1, :, :]) > 0) & (union > 0)
    if limit != limit:
        return xp.ones_like(overlap)
    if xp is np:  # no division where they do not overlap (no warning there)
        ratio = np.divide(intersection, union, out=np.zeros_like(intersection), where=overlap)
    else:
        ratio = torch.where(overlap, intersection / torch.where(overlap, union, 1), 0)
    return ratio > limit
