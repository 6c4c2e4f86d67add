"""A folded QDQ weight's integers and scales, for the int8 plan (``qcnn_layers.qdq_conv``).

Why: constant folding turns ``DequantizeLinear(w_q, scale)`` into float32 values; the plan
multiplies the integers. The fold's own step (``optimizer.dequantized``) is read first; without
it (a weight folded elsewhere) the integers are searched for: a scale per channel whose multiples
give the floats back exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

F32 = np.float32

_RECOVERED: dict[int, tuple[np.ndarray, Any]] = {}
"""``integer_weight``'s answers by the weight array's id (the array held, so the id stays its
own): a subgraph is planned twice, at the substitution and at its workload."""


def integer_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``fusion.int8.integer_weight``'s answer: (int8 k, float32 scale per output channel) with
    k * scale rounded to float32 equal to ``weight``, or None. Every candidate scale of a
    channel (its largest |w| at 127, 128, 126 ... 64 steps, rounded either way) is tried on its
    first values at once, in one array operation, before one is checked on all of them."""
    held = _RECOVERED.get(id(weight))
    if held is not None and held[0] is weight:
        return held[1]
    own = _own_step(weight)
    if own is not None:
        return own
    flat = weight.reshape(weight.shape[0], -1).astype(np.float64)
    levels = np.array([127, 128, *range(126, 63, -1)], np.float64)
    found = _scales(flat.reshape(1, -1), levels)
    if found is not None:
        ints, scales = found[0].reshape(weight.shape), np.full(flat.shape[0], found[1][0], F32)
    else:
        found = _scales(flat, levels)
        ints, scales = (None, None) if found is None else (found[0].reshape(weight.shape),
                                                            found[1])
    answer = None if ints is None else (ints, scales)
    if len(_RECOVERED) > 512:
        _RECOVERED.clear()
    _RECOVERED[id(weight)] = (weight, answer)
    return answer


def _own_step(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The integers of a folded DequantizeLinear's own step (``optimizer.dequantized``: zero
    points 0, a scale per tensor or per output channel), where they give its floats back."""
    from backplane.optimizer import dequantized

    found = dequantized.step(weight)
    if found is None or found[0].dtype != F32 or found[1] is not None and found[1].any():
        return None
    scale, oc = found[0].reshape(-1), weight.shape[0]
    if scale.size != 1 and (scale.size != oc or found[2] % weight.ndim != 0):
        return None
    scales = np.broadcast_to(scale, (oc,)).astype(F32)
    column = scales.reshape((oc,) + (1,) * (weight.ndim - 1))
    k = np.rint(weight / column)
    if k.min(initial=0) < -128 or k.max(initial=0) > 127 or not np.array_equal(
            (k * column).astype(F32), weight):
        return None
    return k.astype(np.int8), scales


def _scales(rows: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row as int8 times a float32 scale of its own, exactly, or None."""
    ints, scales = np.zeros(rows.shape, np.int8), np.zeros(rows.shape[0], F32)
    for index, row in enumerate(rows):
        peak = float(np.max(np.abs(row)))
        if peak == 0:
            scales[index] = 1.0
            continue
        guess = (peak / levels).astype(F32)
        candidates = np.stack([guess, np.nextafter(guess, F32(0)), np.nextafter(guess, F32(1))],
                              1).reshape(-1).astype(np.float64)
        head = row[:16]
        k = np.rint(head[None, :] / candidates[:, None])
        good = (np.abs(k) <= 128).all(1) & ((k * candidates[:, None]).astype(F32) ==
                                            head.astype(F32)).all(1)
        for scale in candidates[good]:
            k = np.rint(row / scale)
            if k.min() >= -128 and k.max() <= 127 and np.array_equal(
                    (k * scale).astype(F32), row.astype(F32)):
                ints[index], scales[index] = k.astype(np.int8), F32(scale)
                break
        else:
            return None
    return ints, scales
