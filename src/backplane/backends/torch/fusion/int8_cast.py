"""Float32 values to 8-bit integer tensors for the QOperator layers' float route (``qlinear``),
in as few passes as the tensor's size and the context allow."""

from __future__ import annotations

import functools
import warnings
from typing import Any

PASSES_FROM = 16384
"""The values from which a conversion between float32 and 8-bit integers takes two vectorized
passes, not one call's casting loop (1 thread, this AMD EPYC, (1, 64, 112, 112): uint8 less a
float32 zero point 477 us in one call, 279 converted then less it; below, a trace pays the
second call's fixed cost instead)."""


def narrowed(y: Any, dtype: Any) -> Any:
    """Float32 integers within ``dtype``'s range as ``dtype``: from ``PASSES_FROM`` values through
    int32 (float32 to uint8 is a scalar loop, to int32 a vectorized one: 1 thread, this AMD EPYC,
    (1, 64, 112, 112): 583 us one call, 194 + 91 the two)."""
    import torch

    return y.to(torch.int32).to(dtype) if y.numel() >= PASSES_FROM and not y.is_cuda \
        else y.to(dtype)


def integers(v: Any, zero: float, low: int, high: int, dtype: Any) -> Any:
    """rint(v) + zero saturated to [low, high], as ``dtype`` (ONNX Runtime's requantization after
    its product: rounded half to even, then offset); ``v`` is ours to change. From
    ``PASSES_FROM`` values of an 8-bit type, run one by one on the CPU: ``v`` rounded, then torch's
    ``quantize_per_tensor`` at scale 1 (FBGEMM: the zero point added, saturated, narrowed in one
    vectorized pass; it rounds after adding the zero point, so ``v`` is rounded first, exactly),
    its integers read in place as ``dtype`` (1 thread, this AMD EPYC, (1, 64, 112, 112): 225 us
    where rounding, clamp, offset and the casts took about 600). In a trace, which holds no view
    of a quantized tensor's memory, on a GPU, or where torch has no quantized tensors, the
    elementwise steps."""
    import torch

    qtype = _quantized().get(dtype)
    if qtype is not None and v.numel() >= PASSES_FROM and not v.is_cuda \
            and not torch.jit.is_tracing() and hasattr(torch, "quantize_per_tensor"):
        q = torch.quantize_per_tensor(v.round_(), 1.0, int(zero), qtype)
        return torch.empty(0, dtype=dtype).set_(q.untyped_storage(), q.storage_offset(), q.shape,
                                                q.stride())
    return narrowed(v.round_().clamp_(low - zero, high - zero).add_(zero), dtype)


@functools.cache
def _quantized() -> dict[Any, Any]:
    """An 8-bit torch dtype -> its quantized dtype (``quantize_per_tensor``'s integers), made at
    the first call: torch is imported only when a route runs."""
    import torch

    # torch's deprecation of its quantized tensors, as int8_qlinear's routes filter it
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_")
    return {torch.uint8: torch.quint8, torch.int8: torch.qint8}
