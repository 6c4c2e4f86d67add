"""NonMaxSuppression: per batch and class, keep the best-scoring boxes that do not overlap a kept
one by more than the IoU threshold."""

from __future__ import annotations

import numpy as np

from backplane.backends.api.kernels import KernelTable


def non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, center_point_box=0):
    # boxes (B, N, 4), scores (B, C, N) -> selected_indices (K, 3): [batch, class, box] rows.
    limit = 0 if max_output_boxes_per_class is None else max(int(_scalar(max_output_boxes_per_class)), 0)
    iou_limit = 0.0 if iou_threshold is None else float(_scalar(iou_threshold))
    corners = _corners(boxes, center_point_box)  # (B, N, 4): y_min, x_min, y_max, x_max
    selected = []
    for b, c in np.ndindex(scores.shape[:2]):
        candidates = np.arange(scores.shape[2])
        if score_threshold is not None:
            candidates = candidates[scores[b, c] > _scalar(score_threshold)]
        # Best score first; equal scores keep the lower box index first.
        order = candidates[np.argsort(-scores[b, c, candidates], kind="stable")]
        kept: list[int] = []
        for box in order:
            if len(kept) == limit:
                break
            if all(_iou(corners[b, box], corners[b, k]) <= iou_limit for k in kept):
                kept.append(int(box))
        selected += [(b, c, box) for box in kept]
    return (np.array(selected, dtype=np.int64).reshape(-1, 3),)


def _scalar(x):
    return np.reshape(x, -1)[0]


def _corners(boxes, center_point_box):
    if center_point_box:  # (x_center, y_center, width, height)
        x, y, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)  # any two opposite corners
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2),
                     np.maximum(x1, x2)], axis=-1)


def _iou(a, b) -> float:
    height = min(a[2], b[2]) - max(a[0], b[0])
    width = min(a[3], b[3]) - max(a[1], b[1])
    if height <= 0 or width <= 0:
        return 0.0
    intersection = height * width
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - intersection
    return float(intersection / union) if union > 0 else 0.0


KERNELS: KernelTable = {
    "NonMaxSuppression": {10: non_max_suppression},
}
