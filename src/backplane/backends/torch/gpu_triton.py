"""GpuAcc's DynamicQuantizeLinear in one Triton kernel, where its input is small (issue 28).

A captured graph replays every kernel, about 2 us each at the small tier's sizes
(bench/gpu_profile.py), and a DynamicQuantizeLinear's reduction (its min and max) is a kernel of
its own before any elementwise one can read them: two kernels through torch and jiterator
(``gpu_int8._dynamic_quantize``), 19.2 and 25.8 us of gpt_dynquant_ort15's 134.7 a run for its
nine (an H200). A tensor of at most ``LIMIT`` elements fits one Triton program: it loads x once,
takes its min and max, computes the scale and zero point and writes x's value less its zero point,
one kernel.

The arithmetic is ``gpu_jit.DYNAMIC_QUANTIZE``'s step for step, so the values are the layer's bit
for bit: the range widened to hold 0 in float64, the scale rounded once to float32 (1 for an
empty or NaN range), the zero point ``rint(-low / scale)`` with an IEEE division (``div_rn``:
Triton's own float32 ``/`` is an approximate one) saturated to [0, 255], NaN to 0; a NaN anywhere
in x makes its min and max NaN, as ``torch.aminmax`` gives them.

Triton comes with torch's CUDA wheels; where it is missing, its compile fails, the tensor is
larger, not contiguous or not float32, or a trace is running (``gpu_jit._tracing``),
``dynamic_quantize`` answers None and the caller takes the two kernels.
"""

from __future__ import annotations

import logging
from typing import Any

from backplane.backends.torch import gpu_jit

log = logging.getLogger(__name__)

LIMIT = 4096
"""Elements of x one program takes (gpt_dynquant_ort15's are 256 to 1024)."""

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # noqa: BLE001 - no Triton (a CPU build of torch): the caller's kernels run
    triton = None

if triton is not None:
    @triton.jit
    def _dynamic_quantize(x_ptr, centred_ptr, params_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001
        offsets = tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
        nan = tl.max(tl.where(inside & (x != x), 1, 0), axis=0) > 0
        lo = tl.where(nan, float("nan"), tl.min(tl.where(inside, x, float("inf")), axis=0))
        hi = tl.where(nan, float("nan"), tl.max(tl.where(inside, x, float("-inf")), axis=0))
        low = tl.where(lo > 0, 0.0, lo.to(tl.float64))
        high = tl.where(hi < 0, 0.0, hi.to(tl.float64))
        s = tl.where(high > low, ((high - low) / 255.0).to(tl.float32), 1.0)
        z = libdevice.rint(libdevice.div_rn(-(low.to(tl.float32)), s))
        z = tl.where(z != z, 0.0, tl.where(z < 0.0, 0.0, tl.where(z > 255.0, 255.0, z)))
        q = libdevice.rint(libdevice.div_rn(x, s)) + z
        q = tl.where(q != q, 0.0, tl.where(q < 0.0, 0.0, tl.where(q > 255.0, 255.0, q)))
        tl.store(centred_ptr + offsets, q - z, mask=inside)
        tl.store(params_ptr, s)
        tl.store(params_ptr + 1, z)

_refused: set[Any] = set()  # devices where the kernel could not be made or run


def dynamic_quantize(x: Any) -> tuple[Any, Any, Any] | None:
    """DynamicQuantizeLinear of a float32 CUDA tensor as (x's uint8 value less its zero point, as
    float32; the scale, 0-d; the zero point as float32, 0-d) in one kernel, or None (see above)."""
    import torch

    if triton is None or x.device in _refused or x.dtype != torch.float32 or not x.is_cuda \
            or not 0 < x.numel() <= LIMIT or not x.is_contiguous() or gpu_jit._tracing():
        return None
    try:
        centred = torch.empty_like(x)
        params = torch.empty(2, dtype=torch.float32, device=x.device)
        block = max(16, triton.next_power_of_2(x.numel()))
        _dynamic_quantize[(1,)](x, centred, params, x.numel(), BLOCK=block)
    except Exception as exc:  # noqa: BLE001 - a compile or launch refused: two kernels instead
        log.info("GpuAcc: DynamicQuantizeLinear stays two kernels (%s)", exc)
        _refused.add(x.device)
        return None
    return centred, params[0], params[1]
