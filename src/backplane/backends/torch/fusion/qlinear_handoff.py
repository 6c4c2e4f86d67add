"""Fused QLinear layers that hand each other float32 integers, not 8-bit tensors.

Why: on the float route (``qlinear._float_route``) a QLinearConv whose 8-bit output only the next
QLinearConvs read rounded its scaled sums, saturated them, added its zero point and narrowed them
to uint8 (``int8_cast.integers``), and each reader widened them to float32 again and took the zero
point off (``qlinear._centring``): in the traced full-tier QOperator MobileNet five passes over each
activation between layers (add, three casts, sub: ~1 ms of a 41 ms run per boundary of 800K
values, 1 thread, this AMD EPYC). The integers less the zero point are the rounded, saturated sums
before the offset, and exactly what the reader's product wants: so the writer stops there and the
reader takes them as they are. The same integers either way: the outputs are unchanged bit for
bit.

Only between layers that are both on the float route for certain (``CpuAcc.int8`` "exact", which
"auto" is where this CPU's int8 kernels saturate: ``int8_exact``): the int8 route reads and writes
the 8-bit tensors themselves. Only where every reader of the tensor is such a layer reading it as
its input (not a residual operand, a ``Lookup``, a layer left unfused or on another backend, the
graph's output), with the writer's zero point, and computing in float32.
"""

from __future__ import annotations

from backplane.backends.api.optimization import Substitution
from backplane.backends.torch.fusion.patterns import Context
from backplane.ir.graph import Layer

HANDING = frozenset({"QLinearConv", "QLinearMatMul"})
"""The fused layers (``qlinear``, ``qdq_chain``) whose float route can write and read centred
float32 integers."""


def centred_handoffs(substitutions: list[Substitution], ctx: Context, int8: str) -> int:
    """Mark each fused writer whose integer output only fused float-route readers take
    (``hands_centred``) and those readers (``takes_centred``); the number of tensors so handed."""
    if int8 != "exact":
        return 0
    fused = [new for sub in substitutions for new in sub.replacement]
    readers: dict[str, list[Layer]] = {}
    for layer in fused:
        for name in dict.fromkeys(layer.inputs):
            readers.setdefault(name, []).append(layer)
    handed = 0
    for layer in fused:
        zero = _written_zero(layer)
        out = layer.outputs[0] if layer.outputs else ""
        takers = readers.get(out, [])
        if zero is None or not takers or out in ctx.graph.outputs \
                or any(id(user) not in ctx.inside or id(user) not in ctx.taken
                       for user in ctx.consumers.get(out, [])) \
                or not all(_takes(user, out, zero) for user in takers):
            continue
        for marked in (layer, *takers):
            marked.attrs["int8"] = None  # the int8 route reads and writes 8-bit tensors
        layer.attrs["hands_centred"] = True
        for user in takers:
            user.attrs["takes_centred"] = True
        handed += 1
    return handed


def _written_zero(layer: Layer) -> float | None:
    """The zero point of the 8-bit tensor a fused layer writes, or None where it writes none (a
    DequantizeLinear taken: float values) or computes in another type."""
    a = layer.attrs
    if layer.op_type not in HANDING or a.get("back") is not None or a.get("compute"):
        return None
    residual = a.get("residual")
    if residual is None:
        return float(a["y_zero"])
    return None if residual.get("dequantized") else float(residual["sum_zero"])


def _takes(user: Layer, name: str, zero: float) -> bool:
    """Whether ``user`` reads ``name`` only as its integer input (no QuantizeLinear of its own),
    on the zero point ``zero``, in float32."""
    a = user.attrs
    return user.op_type in HANDING and user.inputs[0] == name and name not in user.inputs[1:] \
        and a.get("into") is None and not a.get("compute") and float(a["x_zero"]) == zero
