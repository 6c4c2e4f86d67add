"""The steps of the DequantizeLinears constant folding made into float constants.

Why: folding ``DequantizeLinear(w_q, scale, zero)`` of a constant weight leaves only its float
values, and the int8 plans (``native/qcnn_layers.py``) need the integers and the scale back: the
scale is what ONNX Runtime multiplies by (x_scale * w_scale, a float bias's rounding), and where
a channel has few values (a 1x1 depthwise kernel: one) many scales give the same floats. The
folded array is looked up by identity (constants are shared, never copied, by the graph's
copies) and held weakly: a dropped model's weights are not kept.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

_STEPS: dict[int, tuple[Any, np.ndarray, np.ndarray | None, int]] = {}


def note(folded: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, axis: int) -> None:
    """``folded`` was dequantized with ``scale``, ``zero`` (None: 0) along ``axis``."""
    key = id(folded)
    try:
        ref = weakref.ref(folded, lambda _, key=key: _STEPS.pop(key, None))
    except TypeError:
        return
    _STEPS[key] = (ref, np.array(scale, copy=True), None if zero is None else np.array(zero),
                   axis)


def step(folded: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, int] | None:
    """(scale, zero point, axis) ``folded`` was dequantized with, or None."""
    found = _STEPS.get(id(folded))
    if found is None or found[0]() is not folded:
        return None
    return found[1], found[2], found[3]
