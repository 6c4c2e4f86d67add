"""QDQ convolutions chained in 8-bit integers, as ONNX Runtime's QOperator format runs them.

Why: in the QDQ format each convolution reads DequantizeLinear(x_q) and writes QuantizeLinear(y);
as ``QuantDequant`` layers (``quantized``) each int8 convolution quantized its input and
dequantized its output again (two passes over the activation a layer), and the residual adds,
max pools and hard-swishes between them ran in float with a round trip each. But DequantizeLinear
-> Conv (weight int8 times a scale) -> QuantizeLinear is a QLinearConv: x_q in, y_q out, the
requantization the convolution's own. So a large one becomes the fused ``QLinearConv`` layer
``qlinear`` makes of the QOperator format's (its int8 route,
``int8_qlinear.qlinear_int8_route``; its float route, exact integer products requantized in
float64), and the integer tensor passes from one to the next as in a QOperator model:

- DequantizeLinear(x_q) -> Conv -> QuantizeLinear reads x_q (taking the DequantizeLinear where
  the convolution alone reads it, and the QuantizeLinear of a float input before it: the stem);
- then DequantizeLinear -> Add(DequantizeLinear(other_q)) -> QuantizeLinear (a residual block's
  sum) is the layer's residual (``torch.ops.quantized.add``), DequantizeLinear -> MaxPool ->
  QuantizeLinear on the same step its pool (on integers: exact), and a DequantizeLinear read by
  nothing that takes integers (a GlobalAveragePool) its float output;
- a hard-swish between them (DequantizeLinear -> HardSigmoid -> QuantizeLinear -> DequantizeLinear
  -> Mul -> QuantizeLinear) is a ``Lookup`` of the integer tensor (``lookup``);
- a DequantizeLinear that no layer reads any more (each reader took the integers) is dropped
  (``fusion._in_order``).

Taken from ``CHAIN_MACS`` multiply-adds a run (any group; now every size), a rule by shape at
load. From ``int8.KNOWN_MACS`` the int8 convolution is known faster than the float one with its
round trip, and more so without the quantize and dequantize passes. Below it (the small tier's
CNNs) the QDQ layers were traced whole and compiled by oneDNN Graph, the round trips as
post-ops, 7-11 partitions of 5-20 us each; chained, a trace holds the int8 convolutions
themselves (``int8_traced``), and run layer by layer they measured even. Never with
``CpuAcc.int8`` "exact" (the requantization is the kernel's: within one
quantization step of CpuRef's, as ONNX Runtime's own QLinearConv is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.optimization import Substitution
from backplane.backends.reference.kernels.conv import spatial_pads
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer, SubgraphView

CHAIN_MACS = 0
"""The multiply-adds an image from which a QDQ convolution is chained in integers: every size.
``int8.KNOWN_MACS`` (2^20) it was, where the int8 convolution with its quantize and dequantize
passes was already faster than the float route (1 thread, this 2-core AMD EPYC: 16ch 32x32 3x3
110 / 43 us); below it the small tier's resnet_qdq_ort17 ran even chained or not (575 against
588 us, its int8 layers one by one). With the int8 convolution in the trace (``int8_traced``)
it is faster chained: process CPU a run, alternating processes, load 6-8, 1 thread 194-204 ->
156-173 us, 2 threads 186-215 -> 164-167 (outputs ONNX Runtime's)."""
ADDS_AND_POOLS = frozenset({"Add", "MaxPool"})
"""Readers of a DequantizeLinear that may take the integer tensor instead (with ``lookup.OPS``)."""


def match_qdq_conv(conv: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """DequantizeLinear(x_q) -> Conv -> QuantizeLinear as one fused QLinearConv reading x_q (see
    above), with what follows it; None where it does not apply."""
    found = _convolution(conv, ctx)
    if found is None:
        return None
    before, x, attrs = found
    quantize = ctx.sole(conv.outputs[0])
    y_params = _step(quantize, ctx, "QuantizeLinear")
    if y_params is None:
        return None
    y_scale, y_zero, (y_low, y_high) = y_params
    multiplier = (np.float32(attrs["x_scale"]) * attrs["w_scale"] / np.float32(y_scale))
    attrs.update(multiplier=np.array(multiplier.reshape(1, -1, 1, 1), F32), y_zero=float(y_zero),
                 y_low=y_low, y_high=y_high, back=None, add=None, activation=None,
                 residual=None, pool=None)
    after, out, others = _output(quantize, ctx, attrs)
    attrs["int8"] = _int8(attrs, ctx.graph.info(x).dtype, y_scale, y_zero, y_low)
    group = [*before, conv, quantize, *after]
    fused = Layer("+".join(lay.name for lay in group), "QLinearConv", [x, *others], [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _convolution(conv: Layer, ctx: Context) -> tuple[list[Layer], str, dict[str, Any]] | None:
    """The convolution's side: the DequantizeLinear it reads (and the QuantizeLinear before that,
    of a float tensor), the integer weight and bias, the FusedConv attributes ``qlinear`` reads."""
    from backplane.backends.torch.fusion.int8 import integer_weight
    from backplane.backends.torch.fusion.qlinear import _exact_split

    if not chains(conv, ctx):
        return None
    dequantize = ctx.graph.producers()[conv.inputs[0]]
    x_params = _step(dequantize, ctx, "DequantizeLinear", reads=True)
    weight = ctx.const(conv.inputs[1])
    found = integer_weight(weight) if weight is not None and weight.dtype == F32 else None
    if x_params is None or found is None:
        return None
    (x_scale, x_zero, (low, high)), (ints, w_scale) = x_params, found
    x_q = dequantize.inputs[0]
    bias = ctx.const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] else None
    if len(conv.inputs) > 2 and conv.inputs[2] and (bias is None or bias.dtype != F32):
        return None
    units = np.zeros(len(w_scale)) if bias is None else \
        bias.astype(np.float64) / (np.float64(x_scale) * w_scale.astype(np.float64))
    before, x, into = _taken_before(dequantize, conv, ctx)
    info = ctx.graph.info(conv.inputs[0])
    strides = list(conv.attrs.get("strides") or [1, 1])
    dilations = list(conv.attrs.get("dilations") or [1, 1])
    begins, ends = spatial_pads(info.shape[2:], ints.shape[2:], strides, dilations,
                                conv.attrs.get("auto_pad", "NOTSET"), conv.attrs.get("pads"))
    if begins != ends:  # torch's int8 convolution pads symmetrically
        return None
    attrs = {"weight": ints.astype(F32), "bias": units, "strides": strides,
             "dilations": dilations, "group": int(conv.attrs.get("group", 1)), "begins": begins,
             "ends": ends, "input_shape": list(info.shape),
             "output_shape": list(ctx.graph.info(conv.outputs[0]).shape or []),
             "binary": False, "unary": None, "x_zero": float(x_zero),
             "reach": max(high - x_zero, x_zero - low), "into": into,
             "x_scale": x_scale, "w_scale": w_scale, "int_weight": ints, "float_bias": bias}
    if x == x_q and ctx.graph.info(x_q).dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        return None
    split = _exact_split(attrs["weight"], units, attrs["reach"], attrs["group"])
    if split is None:  # the float route's sums could pass 2^24 even split
        return None
    attrs["weight"], attrs["bias"], attrs["split"] = split
    return before, x, attrs


def chains(conv: Layer, ctx: Context) -> bool:
    """Whether ``conv`` is a QDQ convolution this module takes, by its shape: a 2-D one of a
    static input made by a DequantizeLinear, from ``CHAIN_MACS`` multiply-adds."""
    from backplane.backends.torch.fusion.int8 import known_faster

    if conv.op_type != "Conv" or conv.domain or len(conv.inputs) < 2:
        return False
    made = ctx.graph.producers().get(conv.inputs[0])
    weight, info = ctx.const(conv.inputs[1]), ctx.graph.info(conv.inputs[0])
    if made is None or made.op_type != "DequantizeLinear" or made.domain or weight is None \
            or weight.ndim != 4 or not info.is_static or len(info.shape) != 4:
        return False
    strides = list(conv.attrs.get("strides") or [1, 1])
    dilations = list(conv.attrs.get("dilations") or [1, 1])
    begins, ends = spatial_pads(info.shape[2:], weight.shape[2:], strides, dilations,
                                conv.attrs.get("auto_pad", "NOTSET"), conv.attrs.get("pads"))
    shape = {"weight": weight, "input_shape": list(info.shape), "group": 1, "strides": strides,
             "dilations": dilations, "begins": begins, "ends": ends}
    return known_faster(shape, CHAIN_MACS)


def _step(layer: Layer | None, ctx: Context, op: str,
          reads: bool = False) -> tuple[float, int, tuple[int, int]] | None:
    """A QuantizeLinear's or DequantizeLinear's per-tensor 8-bit step (scale, zero point, range),
    or None. ``reads``: the DequantizeLinear must be free (its integer input still made)."""
    from backplane.backends.torch.fusion.quantized import quant_params

    if layer is None or layer.op_type != op or layer.domain or id(layer) not in ctx.inside \
            or reads and id(layer) in ctx.taken:
        return None
    params = quant_params(layer, ctx, 1, None)
    if params is None or params["scale"].ndim != 0 or params["high"] - params["low"] != 255 \
            or op == "DequantizeLinear" and layer.attrs.get("output_dtype", 0) not in (0, 1):
        return None
    return float(params["scale"]), int(params["zero"]), (params["low"], params["high"])


def _taken_before(dequantize: Layer, conv: Layer, ctx: Context,
                  ) -> tuple[list[Layer], str, dict[str, Any] | None]:
    """The layers taken before the convolution, the layer's input and the QuantizeLinear's
    parameters where it takes one: the DequantizeLinear where the convolution alone reads it, and
    then the QuantizeLinear of a float32 tensor that alone makes its integers (the stem)."""
    from backplane.backends.torch.fusion.quantized import quant_params

    x_q = dequantize.inputs[0]
    if ctx.sole(dequantize.outputs[0]) is not conv:
        return [], x_q, None
    quantize = ctx.graph.producers().get(x_q)
    if quantize is None or ctx.sole(x_q) is not dequantize or quantize.op_type != "QuantizeLinear" \
            or quantize.domain or id(quantize) not in ctx.inside or id(quantize) in ctx.taken \
            or ctx.graph.info(quantize.inputs[0]).dtype != F32:
        return [dequantize], x_q, None
    into = quant_params(quantize, ctx, 1, None)
    if into is None or into["scale"].ndim != 0:
        return [dequantize], x_q, None
    return [quantize, dequantize], quantize.inputs[0], into


def _output(quantize: Layer, ctx: Context, attrs: dict[str, Any],
            ) -> tuple[list[Layer], str, list[str]]:
    """What the layer takes after its QuantizeLinear (``attrs`` updated): a residual sum, a max
    pool, or the DequantizeLinear where nothing after it reads integers; its output and the other
    inputs it reads."""
    from backplane.backends.torch.fusion.quantized import quant_params

    y_q = quantize.outputs[0]
    dequantize = ctx.sole(y_q)
    y_step = _step(dequantize, ctx, "DequantizeLinear")
    if y_step is None or y_step[:2] != (float(quant_params(quantize, ctx, 1, None)["scale"]),
                                        int(attrs["y_zero"])):
        return [], y_q, []
    readers = ctx.consumers.get(dequantize.outputs[0], [])
    found = _residual(dequantize, ctx, y_step)
    if found is not None:
        taken, out, other, attrs["residual"] = found
        after = _dequantized_sum(out, ctx, attrs["residual"])
        if after is not None:  # nothing after the sum reads integers (ResNet's last block)
            taken, out = [*taken, after], after.outputs[0]
        return [dequantize, *taken], out, [other]
    pooled = _pool(dequantize, ctx, y_step)
    if pooled is not None:
        taken, out, attrs["pool"] = pooled
        return [dequantize, *taken], out, []
    if any(_takes_integers(reader, ctx) for reader in readers):
        return [], y_q, []
    back = quant_params(dequantize, ctx, 1, None)
    attrs["back"] = back
    return [dequantize], dequantize.outputs[0], []


def _dequantized_sum(total: str, ctx: Context, residual: dict[str, Any]) -> Layer | None:
    """The DequantizeLinear on the sum's step that alone reads the residual sum ``total``, where
    none of its readers takes integers (then ``residual["dequantized"]``: the layer's output is
    float, and CpuAcc's DequantizeLinear kernel, 1.25 ms for (1, 128, 28, 28) channels-last on 1
    thread of this AMD EPYC, is not run)."""
    dequantize = ctx.sole(total)
    step = _step(dequantize, ctx, "DequantizeLinear")
    if step is None or step[:2] != (float(residual["sum_scale"]), residual["sum_zero"]) \
            or any(_takes_integers(reader, ctx) for name in dequantize.outputs  # type: ignore
                   for reader in ctx.consumers.get(name, [])):
        return None
    residual["dequantized"] = True
    return dequantize


def _takes_integers(reader: Layer, ctx: Context) -> bool:
    """Whether a DequantizeLinear's reader may read its integers instead (a convolution this
    module takes, an Add or a MaxPool, an elementwise op a ``Lookup`` takes): then the layer
    before keeps its integer output."""
    from backplane.backends.torch.fusion.lookup import OPS

    if reader.domain:
        return (reader.domain, reader.op_type) in OPS
    if reader.op_type == "Conv":
        return chains(reader, ctx)
    if reader.op_type in ADDS_AND_POOLS:  # a QDQ one: its result quantized, its inputs integers
        after = ctx.sole(reader.outputs[0])
        producers = ctx.graph.producers()
        return after is not None and after.op_type == "QuantizeLinear" and not after.domain \
            and all(getattr(producers.get(name), "op_type", None) == "DequantizeLinear"
                    for name in reader.inputs if name)
    return ("", reader.op_type) in OPS


def _residual(dequantize: Layer, ctx: Context, y_step: tuple[float, int, tuple[int, int]],
              ) -> tuple[list[Layer], str, str, dict[str, Any]] | None:
    """Add(DequantizeLinear(y_q), DequantizeLinear(other_q)) -> QuantizeLinear, all of one 8-bit
    type, per tensor: the Add and the QuantizeLinear, the sum, other_q and the scales and zero
    points ``qlinear``'s residual reads. other_q must be made already (by a layer taken before,
    which keeps it as its output, or outside this subgraph)."""
    add = ctx.sole(dequantize.outputs[0])
    if add is None or add.op_type != "Add" or add.domain or len(add.inputs) != 2 \
            or add.inputs[0] == add.inputs[1]:
        return None
    other = add.inputs[1] if add.inputs[0] == dequantize.outputs[0] else add.inputs[0]
    producers = ctx.graph.producers()
    other_dq = producers.get(other)
    other_step = _step(other_dq, ctx, "DequantizeLinear", reads=True)
    total = ctx.sole(add.outputs[0])
    sum_step = _step(total, ctx, "QuantizeLinear")
    if other_step is None or sum_step is None:
        return None
    other_q = other_dq.inputs[0]  # type: ignore[union-attr]
    maker = producers.get(other_q)
    if maker is not None and id(maker) in ctx.inside and id(maker) not in ctx.taken:
        return None  # made later, or by a layer a later match may take with its DequantizeLinear
    if len({y_step[2], other_step[2], sum_step[2]}) != 1 \
            or ctx.graph.info(other_q).dtype != ctx.graph.info(dequantize.inputs[0]).dtype:
        return None
    residual = {"mine_scale": np.array(y_step[0], F32), "mine_zero": y_step[1],
                "other_scale": np.array(other_step[0], F32), "other_zero": other_step[1],
                "sum_scale": np.array(sum_step[0], F32), "sum_zero": sum_step[1]}
    return [add, total], total.outputs[0], other_q, residual  # type: ignore[union-attr]


def _pool(dequantize: Layer, ctx: Context, y_step: tuple[float, int, tuple[int, int]],
          ) -> tuple[list[Layer], str, dict[str, Any]] | None:
    """DequantizeLinear -> MaxPool -> QuantizeLinear on the same step: the pool of the integers
    (dequantizing keeps order, so the largest integer is the largest value: exact)."""
    from backplane.backends.torch.fusion.qlinear import _max_pool_after

    pool = ctx.sole(dequantize.outputs[0])
    if pool is None or pool.op_type != "MaxPool":
        return None
    proxy = Layer(dequantize.name, "DequantizeLinear", [], dequantize.outputs, {}, "", 1)
    window = _max_pool_after(proxy, ctx)
    quantize = ctx.sole(pool.outputs[0]) if window is not None else None
    if window is None or _step(quantize, ctx, "QuantizeLinear") != y_step:
        return None
    return [pool, quantize], quantize.outputs[0], window[1]  # type: ignore[union-attr]


def _int8(attrs: dict[str, Any], x_type: np.dtype, y_scale: float, y_zero: int,
          y_low: int) -> dict[str, Any]:
    """What ``int8_qlinear.qlinear_int8_route`` reads: the int8 weight and its scales, the float
    bias, x's and y's steps in quint8's range (int8 shifted by 128, ``int8_qlinear.SHIFTS``)."""
    from backplane.backends.torch.fusion.int8_qlinear import SHIFTS

    into = attrs["into"]
    x_type = np.dtype(np.uint8) if into is not None and into["low"] == 0 else \
        np.dtype(np.int8) if into is not None else x_type
    w_scale, bias = attrs.pop("w_scale"), attrs.pop("float_bias")
    weight = attrs.pop("int_weight")
    shift = SHIFTS[x_type]
    real = np.zeros(weight.shape[0], F32) if bias is None else np.array(bias, F32)
    return {"weight": weight, "scales": w_scale.astype(np.float64), "bias": real,
            "x_scale": float(attrs.pop("x_scale")), "x_zero": int(attrs["x_zero"]) + shift,
            "x_shift": shift, "y_scale": float(y_scale), "y_zero": int(y_zero) - int(y_low),
            "y_shift": -int(y_low)}


Matcher = Callable[[Layer, Context], "tuple[list[Layer], Layer] | None"]


def first_of(*matchers: Matcher) -> Matcher:
    """The first of ``matchers`` that matches."""
    def match(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
        for matcher in matchers:
            found = matcher(layer, ctx)
            if found is not None:
                return found
        return None
    return match


def unless_chained(matcher: Matcher) -> Matcher:
    """``matcher`` (the QuantizeLinear -> DequantizeLinear round trip's) but for a pair whose
    DequantizeLinear only convolutions this module takes read: those take the pair (the stem)."""
    def match(quantize: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
        dequantize = ctx.sole(quantize.outputs[0])
        readers = ctx.consumers.get(dequantize.outputs[0], []) if dequantize is not None else []
        if readers and all(_convolution(reader, ctx) is not None and _step(
                ctx.sole(reader.outputs[0]), ctx, "QuantizeLinear") is not None
                for reader in readers):
            return None
        return matcher(quantize, ctx)
    return match


def without_unread(substitutions: list[Substitution], ctx: Context) -> list[Substitution]:
    """``substitutions`` with each DequantizeLinear left that no layer reads any more (each of its
    readers took the integers instead: a residual block's input, which its first convolution and
    its sum read) dropped: merged, with the substitutions of its readers, into one substitution
    that replaces them all by their fused layers (a run of the layer was a dequantize of the
    whole activation, 0.7-13 ms at 224x224)."""
    subs = list(substitutions)
    for layer in ctx.view.layers:
        if layer.op_type != "DequantizeLinear" or layer.domain or id(layer) in ctx.taken:
            continue
        users = [user for name in layer.outputs for user in ctx.consumers.get(name, [])]
        if not users or any(name in ctx.graph.outputs for name in layer.outputs) \
                or any(id(user) not in ctx.inside or id(user) not in ctx.taken for user in users):
            continue
        readers = {id(user) for user in users}
        merged = [sub for sub in subs if any(id(lay) in readers
                                             for lay in sub.substitutable.layers)]
        if any(name in new.inputs for sub in merged for new in sub.replacement
               for name in layer.outputs):
            continue  # a fused layer still reads it
        group = {id(lay) for sub in merged for lay in sub.substitutable.layers} | {id(layer)}
        layers = [lay for lay in ctx.view.layers if id(lay) in group]
        replacement = [new for sub in merged for new in sub.replacement]
        subs = [sub for sub in subs if all(sub is not other for other in merged)]
        subs.append(Substitution(SubgraphView.of(ctx.graph, layers), replacement))
        ctx.taken.add(id(layer))
    return subs
