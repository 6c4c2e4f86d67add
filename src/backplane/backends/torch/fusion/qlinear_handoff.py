"""Fused QLinear layers that hand each other float32 integers, not 8-bit tensors.

Why: on the float route (``qlinear_float._float_route``) a QLinearConv whose 8-bit output only the
next QLinearConvs read rounded its scaled sums, saturated them, added its zero point and narrowed
them to uint8 (``int8_cast.integers``), and each reader widened them to float32 again and took the
zero point off (``qlinear_float._centring``): in the traced full-tier QOperator MobileNet five
passes over each activation between layers (add, three casts, sub: ~1 ms of a 41 ms run per
boundary of 800K values, 1 thread, this AMD EPYC). The integers less the zero point are the
rounded, saturated sums before the offset, and exactly what the reader's product wants: so the
writer stops there and the reader takes them as they are. The same integers either way: the outputs
are unchanged bit for bit.

Only between layers that are both on the float route for certain (``CpuAcc.int8`` "exact", which
"auto" is where this CPU's int8 kernels saturate: ``int8_exact``): the int8 route reads and writes
the 8-bit tensors themselves. Only where every reader of the tensor is such a layer reading it as
its input (not a residual operand, a ``Lookup``, a layer left unfused or on another backend, the
graph's output), with the writer's zero point, and computing in float32.
"""

from __future__ import annotations

from backplane.backends.api.optimization import Substitution
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.backends.torch.fusion.quantized import quant_params
from backplane.ir.graph import Layer, SubgraphView

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
        written = _written(layer)
        out = layer.outputs[0] if layer.outputs else ""
        takers = readers.get(out, [])
        if written is None or not takers or out in ctx.graph.outputs \
                or any(id(user) not in ctx.inside or id(user) not in ctx.taken
                       for user in ctx.consumers.get(out, [])):
            continue
        how = [_takes(user, out, layer.attrs, *written) for user in takers]
        if not all(how):
            continue
        for marked in (layer, *takers):
            marked.attrs["int8"] = None  # the int8 route reads and writes 8-bit tensors
        layer.attrs["hands_centred"] = True
        for user, keys in zip(takers, how):
            user.attrs.update(dict.fromkeys(keys, True))  # type: ignore[arg-type]
        handed += 1
    return handed + _quantized_handoffs(substitutions, ctx, readers)


def _quantized_handoffs(substitutions: list[Substitution], ctx: Context,
                        readers: dict[str, list[Layer]]) -> int:
    """Each free per-tensor QuantizeLinear of a float32 tensor whose 8-bit output only fused
    float-route readers take (a QOperator ResNet's block input: Add -> Relu -> QuantizeLinear, read
    by a block's first convolution and its shortcut's) as a ``QuantizeCentred`` that writes the
    integers less the zero point as float32 (``qlinear_float.quantize_centred_workload``), the
    readers marked to take them so: where it wrote uint8 (a cast) that each reader widened and
    centred again, and which oneDNN Graph's fuser cannot take (its partitions stopped there, and
    the subgraph failed to compile: 'bad optional access')."""
    handed = 0
    for layer in ctx.view.layers:
        out = layer.outputs[0] if len(layer.outputs) == 1 else ""
        if layer.op_type != "QuantizeLinear" or layer.domain or id(layer) in ctx.taken \
                or not out or out in ctx.graph.outputs \
                or ctx.graph.info(layer.inputs[0]).dtype != F32:
            continue
        into = quant_params(layer, ctx, 1, None)
        takers = readers.get(out, [])
        if into is None or into["scale"].ndim or not takers or any(
                id(user) not in ctx.inside or id(user) not in ctx.taken
                for user in ctx.consumers.get(out, [])):
            continue
        zero = float(into["zero"])
        how = [_takes(user, out, {}, zero, None) for user in takers]
        if not all(how):
            continue
        for user, keys in zip(takers, how):
            user.attrs["int8"] = None
            user.attrs.update(dict.fromkeys(keys, True))  # type: ignore[arg-type]
        fused = Layer(f"{layer.name}(centred)", "QuantizeCentred", layer.inputs[:1], [out],
                      {"into": into, "x_zero": zero}, FUSED_DOMAIN, 1)
        substitutions.append(Substitution(SubgraphView.of(ctx.graph, [layer]), [fused]))
        ctx.taken.add(id(layer))
        handed += 1
    return handed


def _written(layer: Layer) -> tuple[float, float | None] | None:
    """The zero point of the integers a fused layer writes, and the scale where it writes them
    dequantized (its DequantizeLinear taken, on the same zero point, then nothing but a Relu its
    clamp's floor: ``qlinear_float._finisher``); None where it writes anything else."""
    a = layer.attrs
    if layer.op_type not in HANDING or a.get("compute"):
        return None
    residual, back = a.get("residual"), a.get("back")
    if residual is not None:
        return float(residual["sum_zero"]), \
            float(residual["sum_scale"]) if residual.get("dequantized") else None
    if back is None:
        return float(a["y_zero"]), None
    relu = a["activation"] is not None and a["activation"][0] == "relu" \
        and bool((back["scale"] > 0).all())
    if back["scale"].ndim or float(back["zero"]) != a["y_zero"] or a["add"] is not None \
            or not (a["activation"] is None or relu):
        return None
    return float(a["y_zero"]), float(back["scale"])


def _takes(user: Layer, name: str, writer: dict, zero: float, scale: float | None,
           ) -> list[str] | None:
    """How ``user`` takes the integers less ``zero`` in place of ``name``, or None: as its input
    ("takes_centred": 8-bit integers on that zero point, or, where ``scale``, the values its
    QuantizeLinear takes back to them on that step), as its residual sum's other 8-bit operand
    ("takes_centred_other"), or both; only a float32 layer reading ``name`` nowhere else."""
    a = user.attrs
    if user.op_type not in HANDING or a.get("compute") or name in user.inputs[2:]:
        return None
    keys = []
    if user.inputs[0] == name:
        into = a.get("into")
        same = into is None if scale is None else (
            into is not None and into["scale"].ndim == 0 and float(into["scale"]) == scale
            and float(into["zero"]) == zero
            and (into["low"], into["high"]) == (writer["y_low"], writer["y_high"]))
        if float(a["x_zero"]) != zero or not same:
            return None
        keys.append("takes_centred")
    if user.inputs[1:2] == [name]:
        residual = a.get("residual")
        if scale is not None or residual is None or float(residual["other_zero"]) != zero:
            return None
        keys.append("takes_centred_other")
    return keys or None
