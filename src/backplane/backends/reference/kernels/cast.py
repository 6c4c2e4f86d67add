"""Casts: Cast, CastLike and BitCast, between every element type the frontend makes: NumPy's own,
strings, and ml_dtypes' bfloat16, float8, float4 and 2- / 4-bit integers.

A conversion is ml_dtypes' ``astype`` (round to nearest even; integers wrap around), except where
the spec says otherwise: float8 saturates to its largest finite value unless ``saturate=0``, and
float8e8m0 (a bare exponent) rounds by ``round_mode``.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo

FLOAT8 = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                                         ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz))
SMALL_INTEGERS = frozenset(np.dtype(t) for t in (ml_dtypes.int2, ml_dtypes.uint2, ml_dtypes.int4,
                                                 ml_dtypes.uint4))
FLOAT8E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
SUB_BYTE = SMALL_INTEGERS | {np.dtype(ml_dtypes.float4_e2m1fn)}  # stored one per byte by ml_dtypes


def is_integer(dtype: np.dtype) -> bool:
    """NumPy's integer types and ml_dtypes' 2- and 4-bit ones (whose kind is "V")."""
    return dtype.kind in "iu" or dtype in SMALL_INTEGERS


def saturate_cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x in ``dtype``, out-of-range values (infinities too) clipped to its range; NaN stays NaN.
    Integers are rounded half to even first."""
    dtype = np.dtype(dtype)
    if is_integer(dtype):
        info = ml_dtypes.iinfo(dtype)
        return np.clip(np.rint(x), info.min, info.max).astype(dtype)
    finfo = ml_dtypes.finfo(dtype)
    return np.clip(x, float(finfo.min), float(finfo.max)).astype(dtype)


def cast(input, to, saturate=1, round_mode="up"):  # noqa: A002
    dtype = _TO.get(to)
    if dtype is None:  # ONNX's element type as NumPy's, looked up once (two frames and onnx's map)
        dtype = _TO[to] = onnx_to_numpy_dtype(to)
    return (_cast_to(input, dtype, saturate, round_mode),)


_TO: dict[int, np.dtype] = {}


def cast_like(input, target_type, saturate=1, round_mode="up"):  # noqa: A002
    return (_cast_to(input, target_type.dtype, saturate, round_mode),)


def _cast_to(x, dtype, saturate, round_mode):
    if dtype == object:  # to string: str of each value, as an object array like every string tensor
        return np.vectorize(str, otypes=[object])(x) if x.size else x.astype(object)
    if x.dtype == object:  # from string: parse each value ("NaN", "INF", "1e-5")
        return np.vectorize(lambda s: dtype.type(float(s)), otypes=[dtype])(x) if x.size \
            else x.astype(dtype)
    if dtype in FLOAT8 and saturate:
        return saturate_cast(x, dtype)
    if dtype == FLOAT8E8M0:
        return _to_float8e8m0(x, saturate, round_mode)
    return x.astype(dtype)


def _to_float8e8m0(x, saturate, round_mode):
    # e8m0 is a float32's biased exponent alone (no sign, no mantissa, 0xFF is NaN): the mantissa
    # only decides whether the exponent rounds up. Infinities and NaN become NaN.
    bits = x.astype(np.float32).view(np.uint32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if round_mode == "up":  # any fraction rounds away from zero
        carry = mantissa > 0
    elif round_mode == "nearest":  # ties round up
        carry = mantissa >= 0x400000
    else:  # "down": truncate
        carry = np.zeros(bits.shape, bool)
    carry &= exponent != 0xFF
    if saturate:  # never round the largest exponent up into NaN
        carry &= exponent != 0xFE
    return (exponent + carry).astype(np.uint8).view(FLOAT8E8M0)


def bit_cast(input, to):  # noqa: A002
    return (input.view(onnx_to_numpy_dtype(to)),)


def check_cast(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    to = layer.attrs.get("to", 0)
    if onnx_to_numpy_dtype(to) is None:
        return f"cast to ONNX type {to} not supported (no NumPy type for it)"
    return _check_round_mode(layer)


def check_cast_like(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    return _check_round_mode(layer)


def _check_round_mode(layer: Layer) -> str | None:
    mode = layer.attrs.get("round_mode", "up")
    known = ("up", "down", "nearest")
    return None if mode in known else f"round_mode {mode!r} not known (known: {known})"


def check_bit_cast(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    to = onnx_to_numpy_dtype(layer.attrs.get("to", 0))
    source = inputs[0].dtype if inputs else None
    if to is None or to == object or source is None or source == object:
        return f"BitCast from {source} to {to} not supported (numeric types only)"
    if to.itemsize != source.itemsize or to in SUB_BYTE or source in SUB_BYTE:
        return f"BitCast from {source} to {to} not supported (the bit widths must be equal, bytes)"
    return None


KERNELS: KernelTable = {
    "Cast": {6: cast},  # saturate (19) and round_mode (25) default to the older behaviour
    "CastLike": {15: cast_like},
    "BitCast": {26: bit_cast},
}

CHECKS = {"Cast": check_cast, "CastLike": check_cast_like, "BitCast": check_bit_cast}

ANY_DTYPE = frozenset(KERNELS)
