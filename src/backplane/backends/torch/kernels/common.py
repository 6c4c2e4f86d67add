"""What the torch kernels share: dtype maps, reading small integer inputs (shapes, axes) as lists, and
the activations that must keep NaN wherever they run.

Shape-like inputs (Reshape's shape, Slice's starts, ...) may arrive as NumPy arrays (GpuAcc keeps such
constants on the host so that reading them never waits for the GPU) or as tensors.

NaN in, NaN out: torch's own ReLU, clamp and max pool keep NaN, but oneDNN Graph, which CpuAcc's
compiled subgraphs run on (``fusion/onednn_graph.py``), fuses a ReLU or a clamp into the
convolution before it as max / min against the bound, and x86's max returns its second operand (the
bound) where the first is NaN: an all-NaN image gave finite logits. So ``relu`` and ``clamp``
spell their op differently while TorchScript traces them for oneDNN Graph
(``for_onednn_graph``); eagerly, and in a trace without oneDNN Graph's fuser (a ``Traced`` layer),
they are torch's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

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


def for_onednn_graph() -> bool:
    """Whether TorchScript is tracing for oneDNN Graph's fuser (``onednn_graph._fusion``): a
    ``Traced`` layer traces with the fuser off, and its ReLU stays torch's (the ELU below, run by
    TorchScript's interpreter, computes an exp per value: 90 against 4 us on 32x1024, 1 thread)."""
    return _is_tracing() and torch.jit.onednn_fusion_enabled()


_is_tracing = torch._C._is_tracing
"""``torch.jit.is_tracing`` without its two Python frames (outside TorchScript's compiler, which
these kernels never run under, it is this call): ``relu`` asks it at every eager call."""


_NAN_FREE = contextvars.ContextVar("backplane_nan_free_trace", default=False)


@contextlib.contextmanager
def nan_free_trace() -> Iterator[None]:
    """A trace for oneDNN Graph of a subgraph that runs only on inputs which cannot make NaN in it
    (``fusion/nan_free.py``): there ``relu``, ``clamp`` and the max pool are the ops oneDNN fuses
    (its ReLU, not the ELU's exp per value; a clamp inside the partition, not one splitting it)."""
    token = _NAN_FREE.set(True)
    try:
        yield
    finally:
        _NAN_FREE.reset(token)


def for_nan_keeping_graph() -> bool:
    """Whether TorchScript traces for oneDNN Graph a subgraph whose inputs may make NaN: ReLU,
    clamp and max pool are then spelled so that NaN stays (see above)."""
    return for_onednn_graph() and not _NAN_FREE.get()


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU that keeps NaN also where oneDNN Graph compiles it. Traced for it, ELU with alpha 0: the
    same values (0 * (exp(x) - 1) is a zero, -0.0, for x < 0; +Inf stays, -Inf gives 0), a post-op
    oneDNN Graph fuses into the convolution as it fuses ReLU, but one it computes by comparison
    and blend, so NaN stays NaN (its cost is within a busy machine's noise:
    ``bench/nan_propagation.py``, docs/torch-backends.md)."""
    if _is_tracing() and for_nan_keeping_graph() and x.is_floating_point():
        return F.elu(x, 0.0)
    return x.relu()  # the method: 0.3-0.8 us less than torch.relu on 64 values (its arg parser)


def clamp(x: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """torch.clamp, which keeps NaN; traced for oneDNN Graph, as ops it does not fuse (its fused
    clamp turns NaN into a bound): a lower bound of 0 as ``relu`` (fused, and keeping NaN), the
    other bounds as torch's clamp_min and clamp_max after the compiled partition."""
    if low is None and high is None:
        return x
    if not for_nan_keeping_graph() or not x.is_floating_point():
        return torch.clamp(x, low, high)
    y = x if low is None else relu(x) if low == 0 else torch.clamp_min(x, low)
    if high is None:
        return y
    return torch.clamp_max(x, high) if y is x else y.clamp_max_(high)


def gelu_keeps_inf(dtype: torch.dtype, strided: bool = False) -> bool:
    """Whether this CPU's GELU (erf form) of a ``dtype`` CPU tensor gives +Inf at +Inf, asked once
    a process for each layout: torch hands a contiguous tensor to oneDNN's eltwise GELU (which
    keeps +Inf on this AVX2 EPYC), a strided one to ATen's own erf, vectorized where its inner
    axis is contiguous in memory (a transpose) and scalar where not (a step of 2); ATen's AVX-512
    erf gives NaN there. All-+Inf tensors of 1 to 17 elements and of 4099 put +Inf in every lane
    of a 16-wide vector loop and of its tail. Asked with TorchScript's tracer paused (a trace
    would record it)."""
    keeps = _GELU_KEEPS_INF.get((dtype, strided))
    if keeps is None:
        tracing = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            x = torch.full((2, 2 * 4099), math.inf, dtype=dtype)
            sizes = (*range(1, 18), 4099)
            views = [v for n in sizes for v in (x[:, :n].t(), x[0, :2 * n:2])] if strided \
                else [x[0, :n] for n in sizes]
            keeps = all(bool(torch.isposinf(F.gelu(v)).all()) for v in views)
        finally:
            torch._C._set_tracing_state(tracing)
        _GELU_KEEPS_INF[(dtype, strided)] = keeps
    return keeps


_GELU_KEEPS_INF: dict[tuple[torch.dtype, bool], bool] = {}

GELU_ATEN_BELOW = 8192
"""The size below which the erf GELU of a contiguous float32 CPU tensor runs on its transpose:
torch gives a contiguous one to oneDNN's eltwise primitive, made again at each call, a strided
one to ATen's own kernel (``gelu_keeps_inf``). 1 thread, thread CPU, load 5, p10 us,
(16, n / 16), F.gelu / on the transpose: 1024 values 15.9 / 6.8, 4096 16.6 / 12.0, 16384
29.9 / 33.1, 65536 83.6 / 123.6. The values differ by a rounding (4.8e-7 on (64, 1024) x 4)."""
GELU_TANH_SIGMOID_FROM = 4096
"""The size from which the tanh GELU is ``_gelu_tanh_by_sigmoid``'s four ops: below it torch's one
kernel is the faster (its cost per op): 1 thread, thread CPU, load 6, p10 us, F.gelu tanh /
these four: 512 values 4.3 / 7.9, 2048 9.8 / 9.8, 8192 33.2 / 18.9, 32768 132 / 56."""
_TWICE_ROOT = 2 * math.sqrt(2 / math.pi)
_GELU_TANH_OFFSET: list[torch.Tensor] = []  # 2 sqrt(2 / pi) as a float32 CPU 0-d tensor


def _gelu_tanh_by_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU as x * sigmoid(2 u), u = sqrt(2 / pi) (x + 0.044715 x^3): the same function
    (0.5 (1 + tanh(u)) is sigmoid(2 u)), in four ops (addcmul, mul_, sigmoid_, mul_), because
    torch's CPU tanh (Sleef's, also inside F.gelu's tanh form) is the slow one: on this AVX2 EPYC,
    (1, 64, 1024) float32, 1 thread, thread CPU, load 9, p10 / median: F.gelu tanh 266 / 276 us,
    this 119 / 129 (torch.tanh alone 253, torch.sigmoid 74). Within 3.5e-7 of float64 where
    F.gelu is within 2.4e-7; the same at +-Inf (Inf, NaN: 0 * -Inf, as the ONNX graph's
    0.5 x (1 + tanh) gives), NaN, and overflowing cubes (+-0 or x). The offset is a constant of
    a trace (the tracer paused while it is made), not a Python float that a trace would hold as
    a double tensor cast at every run."""
    if not _GELU_TANH_OFFSET:
        tracing = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            _GELU_TANH_OFFSET.append(torch.tensor(_TWICE_ROOT, dtype=torch.float32))
        finally:
            torch._C._set_tracing_state(tracing)
    y = torch.addcmul(_GELU_TANH_OFFSET[0], x, x, value=0.044715 * _TWICE_ROOT)  # 2u / x
    return y.mul_(x).sigmoid_().mul_(x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """torch's GELU with +Inf kept: the vectorized erf form of some CPUs (AVX-512) gives NaN at
    +Inf, where x * Phi(x) is +Inf (CpuRef, ONNX Runtime). The mend (two more kernels) only where
    this CPU's GELU needs it: always but on a float32/float64 CPU tensor whose GELU keeps +Inf
    here in its layout (``gelu_keeps_inf``), outside a trace for oneDNN Graph (whose fused GELU
    is oneDNN's own)."""
    if approximate == "tanh" and x.device.type == "cpu" and x.dtype == torch.float32 \
            and x.numel() >= GELU_TANH_SIGMOID_FROM and not for_onednn_graph():
        return _gelu_tanh_by_sigmoid(x)
    if approximate == "none" and x.device.type == "cpu" and x.dtype == torch.float32 \
            and x.dim() >= 2 and min(x.shape[-2:]) > 1 and x.numel() < GELU_ATEN_BELOW \
            and x.is_contiguous() and not for_onednn_graph() and gelu_keeps_inf(x.dtype, True):
        return F.gelu(x.transpose(-1, -2)).transpose(-1, -2)  # contiguous again
    y = F.gelu(x, approximate=approximate)
    if approximate == "none" and not (
        x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
        and not for_onednn_graph() and gelu_keeps_inf(x.dtype, not x.is_contiguous())
    ):
        y = y.masked_fill_(torch.isposinf(x), math.inf)
    return y
