"""What the torch kernels share: dtype maps, and reading small integer inputs (shapes, axes) as lists.

Shape-like inputs (Reshape's shape, Slice's starts, ...) may arrive as NumPy arrays (GpuAcc keeps such
constants on the host so that reading them never waits for the GPU) or as tensors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
}
TORCH_DTYPES = frozenset(NUMPY_TO_TORCH)
"""The element types the torch backends claim: torch's full-featured ones (no uint16/32/64,
complex, strings or the exotic float formats)."""
FLOATS = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
SIGNED = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))
NUMBERS = FLOATS | SIGNED | {np.dtype(np.uint8)}


def ints(value: Any) -> list[int]:
    """A small integer input (shape, axes, starts) as a list of Python ints."""
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(value).reshape(-1)]


def scalar(value: Any) -> float | int | bool:
    """A one-element input (Clip's min, ...) as a Python number."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item()
    return np.asarray(value).reshape(-1)[0].item()


def in_range(value: float, dtype: torch.dtype) -> float:
    """A Python number for a scalar argument of a torch op on ``dtype`` (clamp's bounds): torch
    refuses one that overflows the type, so a float past the type's range becomes the value a cast
    gives (its largest, or an infinity), as NumPy converts a Python float for a float16 array."""
    if dtype.is_floating_point and math.isfinite(value) and abs(value) > torch.finfo(dtype).max:
        return float(torch.tensor(value, dtype=torch.float64).to(dtype))
    return value


def torch_dtype(onnx_type: int) -> torch.dtype:
    from backplane.frontends.onnx_types import onnx_to_numpy_dtype

    return NUMPY_TO_TORCH[np.dtype(onnx_to_numpy_dtype(onnx_type))]
