"""GELU written out with Erf where no Linear takes it as its post-op (dynamo's erf form, after a
convolution or a norm): one ``GeluChain`` layer, torch's GELU (``common.gelu``), one kernel
instead of five.

x * 0.5 * (1 + erf(x / sqrt(2))) is what both torch exporters write for ``nn.GELU`` (dynamo as
x * (0.5 * (1 + erf(...))), which a Linear leaves apart: ``linear._times_half``): Div, Erf, Add,
Mul, Mul, each a kernel call and a tensor of its own in a trace. audio_conv1d_dyn19 has three,
after its group norm and its 1-d convolutions: its trace's torch ops a run 132 -> 96, thread CPU
time a run 0.80 (1 thread) and 0.77 (2 threads) of before; encoder_padmask_dyn17's two after its
products 0.87 and 0.84 (sessions with and without in one process, alternating blocks, load 4.6-5,
this 2-core AMD EPYC, with ``common.gelu`` running a small contiguous tensor on ATen's kernel).
Taken only where this CPU's GELU keeps +Inf on a float32 tensor (``common.gelu_keeps_inf``):
elsewhere torch's GELU needs a mend of two more kernels, and three kernels in a trace cost more
than the five (encoder_padmask_dyn17's trace 123 -> 141 us at 1 thread on an AVX-512 EPYC). A
strided input (a convolution's channels-last output) goes to ATen's own kernel, mended only where
that does not keep +Inf (``common.gelu``). The values differ from the five steps' by a rounding or two
(torch multiplies by 1/sqrt(2) where the export divides by sqrt(2)); NaN stays NaN, -Inf gives
NaN and +Inf +Inf as the five do."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.linear import _times_half
from backplane.backends.torch.fusion.patterns import Context, scalar_op
from backplane.ir.graph import Layer

Matcher = Callable[[Layer, Context], "tuple[list[Layer], Layer] | None"]


def match_gelu(scale: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The GELU chain whose x / sqrt(2) (or x * (1 / sqrt(2))) is ``scale``, or None."""
    if scale.op_type not in ("Div", "Mul") or scale.domain or len(scale.inputs) != 2:
        return None
    x = scale.inputs[0] if ctx.const(scale.inputs[0]) is None else scale.inputs[1]
    if not (scalar_op(scale, x, ctx, "Div", math.sqrt(2))
            or scalar_op(scale, x, ctx, "Mul", 1 / math.sqrt(2))):
        return None
    info = ctx.graph.info(x)
    if info.dtype is None or info.dtype.name != "float32" or x in ctx.graph.outputs:
        return None
    users = list({id(u): u for u in ctx.consumers.get(x, [])}.values())
    if len(users) != 2 or any(id(u) not in ctx.inside or id(u) in ctx.taken or u.domain
                              for u in users):
        return None
    erf = ctx.sole(scale.outputs[0])
    if erf is None or erf.op_type != "Erf":
        return None
    one = ctx.sole(erf.outputs[0])
    if one is None or not scalar_op(one, erf.outputs[0], ctx, "Add", 1.0):
        return None
    first = next(u for u in users if u is not scale)
    body = [scale, erf, one]
    group = (_times_half(x, first, one.outputs[0], ctx, body, inner_half=True)
             or _times_half(x, first, one.outputs[0], ctx, body))
    if group is None or not _one_kernel():
        return None
    fused = Layer("+".join(lay.name for lay in group), "GeluChain", [x], [group[-1].outputs[0]],
                  {}, FUSED_DOMAIN, 1)
    return group, fused


def or_else(other: Matcher) -> Matcher:
    """``match_gelu``, else ``other`` (the matcher the layer's type had: a Linear may start at
    any layer)."""
    def match(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
        return match_gelu(layer, ctx) or other(layer, ctx)

    return match


def _one_kernel() -> bool:
    """Whether torch's float32 GELU here is one kernel in a trace (keeps +Inf unmended)."""
    import torch

    from backplane.backends.torch.kernels.common import gelu_keeps_inf

    return gelu_keeps_inf(torch.float32)


def gelu_workload(layer: Layer, backend: Any, inputs: Any) -> Workload:
    from backplane.backends.torch.kernels.common import gelu

    return lambda x: (gelu(x),)
