"""QuantizeLinear -> DequantizeLinear on a float tensor (the QDQ format's activations): one
``QuantDequant`` layer, the round trip as a few in-place torch calls on one tensor.

Why: ONNX Runtime's QDQ models and QAT exports put such a pair after nearly every layer; as two
layers each one made a uint8 tensor and a float64 one, and as many calls again as the layer it
follows. The weights' DequantizeLinear of a constant is folded to a float constant before fusion
(the optimizer's constant folding), so the Conv or Gemm between the pairs becomes a FusedConv or a
Linear as in a float model, and the whole subgraph may become one OneDnnGraph.

What the pair computes, as CpuRef does it (``reference/kernels/quant.py``), in float32 throughout:
q = clamp(rint(x / s_q) + z_q, low, high), a NaN quantized to 0 (NumPy's and torch's cast of NaN
to an 8-bit integer), then y = (q - z_dq) * s_dq. The division is a division (torch's
``fake_quantize_per_tensor_affine`` multiplies by 1 / s, which rounds 15 of 600 ties otherwise),
rint rounds half to even, every step is exact on integers below 2^24, and float32's product of an
integer and a float32 scale is the float64 product rounded once, as CpuRef's.

Also shared by ``qlinear``: ``quant_params`` (a quantization's constant scale and zero point, shaped
for the tensor) and ``to_grid`` (x quantized, as float32 integers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer

Matcher = Callable[[Layer, Context], "tuple[list[Layer], Layer] | None"]

RANGES = {np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
          for t in (np.int8, np.uint8, np.int16, np.uint16)}
"""The integer types the fused layers quantize to, and their ranges (exact in float32)."""


def quant_params(layer: Layer, ctx: Context, scale_at: int, rank: int | None,
                 axis: int | None = None) -> dict[str, Any] | None:
    """The constant float32 scale and zero point read at ``layer.inputs[scale_at]`` and the one
    after, shaped to broadcast against a tensor of ``rank`` along ``axis`` (the layer's own where
    None), with the quantized type's range: or None where they are not constants this can take
    (a computed or blocked scale, another type, a per-axis scale of a tensor of unknown rank)."""
    if layer.attrs.get("block_size", 0) or layer.attrs.get("precision", 0):
        return None
    names = layer.inputs[scale_at:scale_at + 2]
    scale = ctx.const(names[0])
    zero_name = names[1] if len(names) > 1 else ""
    zero = ctx.const(zero_name)
    if scale is None or scale.dtype != F32 or (zero_name and zero is None):
        return None
    dtype = zero.dtype if zero is not None else _declared_type(layer)
    if dtype not in RANGES or (zero is not None and zero.size != scale.size):
        return None
    zero = np.zeros(scale.shape, np.float32) if zero is None else zero.astype(np.float32)
    if scale.size > 1:
        if rank is None or scale.ndim != 1:
            return None
        axis = (layer.attrs.get("axis", 1) if axis is None else axis) % rank
        shape = [-1 if d == axis else 1 for d in range(rank)]
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    low, high = RANGES[dtype]
    # np.array, not np.ascontiguousarray: that makes a 0-d scale 1-d
    return {"scale": np.array(scale.reshape(scale.shape if scale.size > 1 else ()), F32),
            "zero": np.array(zero.reshape(zero.shape if zero.size > 1 else ()), F32),
            "low": low, "high": high}


def _declared_type(layer: Layer) -> np.dtype:
    """QuantizeLinear's output type without a zero point: ``output_dtype`` (21), else uint8."""
    from backplane.frontends.onnx_types import onnx_to_numpy_dtype

    declared = layer.attrs.get("output_dtype", 0)
    return np.dtype(onnx_to_numpy_dtype(declared)) if declared else np.dtype(np.uint8)


def match_quant_dequant(quantize: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """QuantizeLinear -> DequantizeLinear of a float32 tensor, constant scales and zero points,
    the integer tensor read by the DequantizeLinear alone."""
    found = _pair(quantize.inputs[0], ctx, quantize)
    if found is None:
        return None
    group, attrs = found
    made = ctx.graph.producers().get(quantize.inputs[0])
    fresh = made is not None and not made.domain and made.op_type in FRESH_OPS \
        and ctx.sole(quantize.inputs[0]) is quantize
    fused = Layer("+".join(lay.name for lay in group), "QuantDequant", [quantize.inputs[0]],
                  [group[-1].outputs[0]], {**attrs, "layers": [], "fresh": fresh,
                                           "redundant": _on_grid(made, attrs, ctx)},
                  FUSED_DOMAIN, 1)
    return group, fused


def _on_grid(made: Layer | None, attrs: dict[str, Any], ctx: Context) -> bool:
    """Whether the round trip's input is already on its grid: a round trip's result with the same
    per-tensor scale, zero point and range, both ways, through ``ON_GRID`` ops that keep values on
    it: a MaxPool (no ceil mode; the maximum of values on a grid is one of them, a window is never
    padding alone) and views that move values without changing them (a Flatten). A round trip of a
    value on its grid gives it back (round((k * s) / s) is k for |k| < 2^16 in float32; no NaN or
    infinity comes out of a round trip): the pair computes nothing. ONNX Runtime's QDQ models
    write such a pair after each MaxPool and after the Flatten before a classifier's Gemm; traced,
    oneDNN Graph fused the pool's into the pooling's partition, which then ran oneDNN's reference
    pooling: 224 of 310 us a run of the small tier's resnet_qdq_ort17 (1 thread); the Flatten's
    was a partition of its own (a binary primitive) and split the Gemm's from its round trip."""
    if not _same_both_ways(attrs):
        return False
    producers = ctx.graph.producers()
    while made is not None and not made.domain and _keeps_grid(made):
        made = producers.get(made.inputs[0])
    if made is None or made.op_type != "DequantizeLinear" or made.domain:
        return False
    dequantize = made
    quantize = producers.get(dequantize.inputs[0])
    if quantize is None or quantize.op_type != "QuantizeLinear" or quantize.domain:
        return False  # (the pair may be taken already: a convolution's, ``then_quant_dequant``)
    shape = ctx.graph.info(dequantize.outputs[0]).shape
    rank = len(shape) if shape is not None else None
    return all(_same(quant_params(lay, ctx, 1, rank), attrs[way])
               for lay in (quantize, dequantize) for way in ("into", "back"))


ON_GRID = frozenset({"Flatten", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Transpose"})
"""Ops whose outputs are values of their first input, moved (``_on_grid``), besides MaxPool."""


def _keeps_grid(layer: Layer) -> bool:
    if layer.op_type in ON_GRID:
        return True
    return layer.op_type == "MaxPool" and not layer.attrs.get("ceil_mode", 0) \
        and not (len(layer.outputs) > 1 and layer.outputs[1])


def _same(params: dict[str, Any] | None, other: dict[str, Any]) -> bool:
    return params is not None and (params["low"], params["high"]) == (other["low"], other["high"]) \
        and all(np.array_equal(params[k], other[k]) for k in ("scale", "zero"))


def _same_both_ways(attrs: dict[str, Any]) -> bool:
    """A per-tensor round trip whose quantize and dequantize have the same scale and zero point."""
    into, back = attrs["into"], attrs["back"]
    return into["scale"].ndim == 0 and all(np.array_equal(into[k], back[k])
                                           for k in ("scale", "zero"))


FRESH_OPS = frozenset({"Add", "Sub", "Mul", "HardSigmoid"})
"""Ops whose CpuAcc kernels always return a new tensor: a round trip that alone reads one's
output runs in its memory (a QDQ hard-swish's HardSigmoid and Mul: a new tensor each was one
more pass and, at 224x224, fresh pages)."""


def then_quant_dequant(matcher: Matcher) -> Matcher:
    """``matcher`` (Conv's, Gemm's, MatMul's), its fused layer taking the QuantizeLinear ->
    DequantizeLinear pair that alone reads its output: one QuantDequant layer holding it, the
    round trip done in place on its result (one layer call and one tensor fewer)."""
    def match(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
        found = matcher(layer, ctx)
        if found is None:
            return None
        group, fused = found
        quantize = ctx.sole(fused.outputs[0])
        pair = _pair(fused.outputs[0], ctx, quantize) if quantize is not None else None
        if pair is None:
            return found
        taken, attrs = pair
        if all(np.array_equal(attrs["into"][k], attrs["back"][k]) for k in ("scale", "zero")):
            from backplane.backends.torch.fusion.int8 import int8_conv, int8_linear

            found_int8 = int8_conv if fused.op_type == "FusedConv" else int8_linear
            attrs["int8"] = found_int8(fused, ctx, attrs["back"])
        wrapped = Layer("+".join(lay.name for lay in [fused, *taken]), "QuantDequant",
                        list(fused.inputs), [taken[-1].outputs[0]], {**attrs, "layers": [fused]},
                        FUSED_DOMAIN, 1)
        return [*group, *taken], wrapped
    return match


def _pair(x: str, ctx: Context, quantize: Layer) -> tuple[list[Layer], dict[str, Any]] | None:
    """``quantize`` and the DequantizeLinear after it, with their parameters, where they round-trip
    the float32 tensor ``x`` (see ``match_quant_dequant``)."""
    if quantize.op_type != "QuantizeLinear" or quantize.domain or quantize.inputs[0] != x:
        return None
    dequantize = ctx.sole(quantize.outputs[0])
    if dequantize is None or dequantize.op_type != "DequantizeLinear" or dequantize.domain:
        return None
    if ctx.graph.info(x).dtype != F32 or dequantize.attrs.get("output_dtype", 0) not in (0, 1):
        return None
    shape = ctx.graph.info(x).shape
    rank = len(shape) if shape is not None else None
    into, back = quant_params(quantize, ctx, 1, rank), quant_params(dequantize, ctx, 1, rank)
    if into is None or back is None or (into["low"], into["high"]) != (back["low"], back["high"]):
        return None
    return [quantize, dequantize], {"into": into, "back": back}


def torch_params(params: dict[str, Any]) -> tuple[Any, Any, int, int]:
    """(scale, zero point, low, high): a per-tensor scale and zero point as Python floats (exact:
    float32 values), per-axis ones as float32 tensors."""
    from backplane.backends.torch.backend import _numpy_to_torch

    scale, zero = params["scale"], params["zero"]
    if scale.ndim == 0:
        return float(scale), float(zero), params["low"], params["high"]
    return _numpy_to_torch(scale), _numpy_to_torch(zero), params["low"], params["high"]


def float32_operand(value: Any) -> Any:
    """A Python float as a float32 tensor of one value (anything else as it is), for an operand of
    float32 tensors of one or more axes in a trace: a frozen trace holds a Python float as a
    float64 0-d tensor, which an operation not in place casts at every call, even one of float32
    (a tensor call: in a frozen trace, 1 thread, a (1, 16, 8, 8) tensor divided by it 21-22 us, by
    one value of one axis 15.5; resnet_qlinear_ort15: 14 of its 17 casts a run). The same values."""
    import torch

    return torch.tensor([value], dtype=torch.float32) if value.__class__ is float else value


def to_grid(x: Any, params: tuple[Any, Any, int, int]) -> Any:
    """x quantized (a new float32 tensor of integers): clamp(rint(x / s) + z), NaN to 0."""
    import torch

    scale, zero, low, high = params
    q = torch.round(x / scale)
    return q.add_(zero).clamp_(low, high).nan_to_num_(0.0)


FINITE = frozenset({"QuantDequant", "FusedConv", "Linear", "Relu", "MaxPool", "AveragePool",
                    "GlobalAveragePool", "GlobalMaxPool", "Add", "Flatten", "Reshape", "Squeeze",
                    "Unsqueeze", "Concat", "Identity", "Clip", "HardSigmoid", "Sigmoid"})
"""Ops whose results are finite where their inputs and constants are (a float32 sum of 8-bit steps
times finite weights does not reach 3.4e38)."""
QLINEAR = frozenset({"QLinearConv", "QLinearMatMul", "QuantizeCentred"})
"""Fused QOperator layers a OneDnnGraph may hold where they are on the float route for certain
(``onednn_graph.wrap``'s ``int8`` "exact"), traced out of place (``qlinear_traced``)."""
NO_NAN = frozenset({"Mul"})
"""Ops whose results hold no NaN where their inputs are finite (a product may overflow to an
infinity, which a round trip after it clamps; only inf * 0 makes a NaN): a QDQ hard-swish's
product of the value and its HardSigmoid."""


def fusable(layers: list[Layer], constants: dict[str, np.ndarray]) -> list[Layer]:
    """``layers`` (a subgraph to compile with oneDNN Graph, in order) with each QuantDequant a copy
    marked ``fusable``: its round trip as out-of-place torch calls that oneDNN Graph's fuser takes
    into the convolution's partition as post-ops (in place, or with a NaN step between, they stay
    outside it: 14 calls a run each), on the float route (torch's int8 kernels are opaque to the
    fuser). The NaN step is left out (``finite``) where its input can hold no NaN: computed only
    by ``FINITE`` ops from other round trips' results and finite constants, or by a ``NO_NAN``
    op of such values (a QDQ hard-swish's HardSigmoid and product: the full tier's
    QDQ MobileNet kept eight NaN steps a run for them, each a pass of its own outside the fuser's
    partitions). A HardSigmoid of finite values is a ``FiniteHardSigmoid``
    (``finite_hard_sigmoid_workload``), which the fuser takes."""
    finite = {n for n, v in constants.items() if v.dtype.kind != "f" or np.isfinite(v).all()}
    no_nan: set[str] = set()  # and the finite ones
    marked = []
    for layer in layers:
        given = [n for n in layer.inputs if n]
        if layer.op_type == "QuantDequant":
            safe = all(n in finite or n in no_nan for n in layer.inputs[:1])
            free = all(n in finite for n in layer.inputs[:1]) and _finite_constants(layer)
            layer = Layer(layer.name, layer.op_type, layer.inputs, layer.outputs,
                          {**layer.attrs, "fusable": True, "finite": safe, "nan_free": free},
                          layer.domain, layer.opset, layer.backend)
            finite.update(layer.outputs)
        elif layer.op_type in QLINEAR and layer.domain == FUSED_DOMAIN:  # ``qlinear_traced``
            layer = Layer(layer.name, layer.op_type, layer.inputs, layer.outputs,
                          {**layer.attrs, "fusable": True,
                           "finite": all(n in finite for n in layer.inputs[:1])},
                          layer.domain, layer.opset, layer.backend)
            if layer.attrs.get("add") is None or np.isfinite(layer.attrs["add"]).all():
                finite.update(layer.outputs)  # saturated integers (NaN centred to -z) times a step
        elif layer.op_type == "HardSigmoid" and not layer.domain \
                and all(n in finite for n in given):
            layer = Layer(layer.name, "FiniteHardSigmoid", layer.inputs, layer.outputs,
                          {"alpha": layer.attrs.get("alpha", 0.2),
                           "beta": layer.attrs.get("beta", 0.5)}, FUSED_DOMAIN, 1, layer.backend)
            finite.update(layer.outputs)
        elif layer.op_type in FINITE and all(n in finite for n in given):
            finite.update(layer.outputs)
        elif layer.op_type in NO_NAN and not layer.domain and all(n in finite for n in given):
            no_nan.update(layer.outputs)
        marked.append(layer)
    return marked


def _finite_constants(layer: Layer) -> bool:
    """Whether the layer a fusable round trip holds (a FusedConv, a Linear) has finite constants
    (its weight and bias: dequantized 8-bit steps): then, of a finite input (a round trip's
    result), it makes no NaN, and its trace for oneDNN Graph may spell its ReLU and clamp as the
    ops oneDNN fuses (``kernels.common.nan_free_trace``), where the NaN-keeping clamp split a QDQ
    Conv -> Clip (ReLU6) -> round trip into two partitions and two calls between them."""
    for inner in layer.attrs.get("layers", []):
        for key in ("weight", "bias"):
            value = inner.attrs.get(key)
            if isinstance(value, np.ndarray) and value.dtype.kind == "f" \
                    and not np.isfinite(value).all():
                return False
    return bool(layer.attrs.get("layers"))


def finite_hard_sigmoid_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """HardSigmoid of finite values (``fusable``) as oneDNN Graph's fuser takes it: x * alpha +
    beta clamped to [0, 1] (CpuRef's formula; products and sums by 1-element constants, as
    ``_fusable_round_trip``'s), where torch's hardsigmoid ran outside the partitions, a pass and
    a fresh tensor of its own: a QDQ hard-swish's on the full tier's QDQ MobileNet 0.2-0.7 ms
    each at (1, 96, 56, 112), 1 thread (its clamp drops no NaN: there is none)."""
    import torch

    alpha, beta = float(np.float32(layer.attrs["alpha"])), float(np.float32(layer.attrs["beta"]))
    scale, shift = torch.full((1,), alpha), torch.full((1,), beta)

    def run(x):
        a, b = (scale, shift) if x.dim() else (alpha, beta)  # a 0-d x stays 0-d
        return (torch.clamp(torch.add(torch.mul(x, a), b), 0.0, 1.0),)
    return run


def quant_dequant_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The round trip (on the result of the layer it holds, in place, where it holds one; as
    oneDNN Graph fuses it where ``fusable`` marks it)."""
    import torch

    from backplane.backends.torch.kernels.common import nan_free_trace

    if layer.attrs.get("fusable"):
        round_trip = _fusable_round_trip(layer.attrs["into"], layer.attrs["back"],
                                         layer.attrs["finite"])
    else:
        round_trip = _round_trip(layer.attrs["into"], layer.attrs["back"])
    if layer.attrs.get("redundant"):  # its input on its grid already (``_on_grid``)
        return lambda x: (x,)
    if not layer.attrs["layers"]:
        fresh = bool(layer.attrs.get("fresh"))  # x is ours to change (``FRESH_OPS``)
        return lambda x: (round_trip(x, fresh),)
    (inner,) = layer.attrs["layers"]
    if layer.attrs.get("compute"):  # inside a Reduced layer: what it holds computes alike
        inner = Layer(inner.name, inner.op_type, inner.inputs, inner.outputs,
                      {**inner.attrs, "compute": layer.attrs["compute"]}, inner.domain,
                      inner.opset, inner.backend)

    def float_route() -> Workload:
        first = backend.fused_workloads()[inner.op_type](inner, backend, inputs)

        free = bool(layer.attrs.get("nan_free"))

        def run(*values):
            if free and torch.jit.is_tracing():  # see ``_finite_constants``
                with nan_free_trace():
                    (y,) = first(*values)
            else:
                (y,) = first(*values)
            return (round_trip(y, True),)
        run.route = getattr(first, "route", None)  # type: ignore[attr-defined]
        run.weights = getattr(first, "weights", ())  # type: ignore[attr-defined]
        return run

    in_trace = layer.attrs.get("fusable") and _for_a_trace(backend) \
        and backend.options.get("CpuAcc.int8") != "kernels"
    if not layer.attrs.get("int8") or layer.attrs.get("compute") or in_trace:
        return float_route()  # traced for oneDNN Graph: what its fuser takes, unless forced
    from backplane.backends.torch.fusion import int8

    return int8.fastest_route(layer, backend, float_route)


def _for_a_trace(backend: Any) -> bool:
    """Whether ``backend`` makes the workloads of a trace: it has the routes TorchScript holds
    forced (``onednn_graph.TRACEABLE_ROUTES``). The same layers run one by one (a OneDnnGraph
    whose compile failed or measured slower) keep their int8 routes: at 224x224 the QDQ mobilenet
    of the full tier ran 13-18 ms with them, 15-26 without (1 thread)."""
    from backplane.backends.torch.fusion.onednn_graph import TRACEABLE_ROUTES

    return all(backend.options.get(k) == v for k, v in TRACEABLE_ROUTES.items())


def _round_trip(into: dict[str, Any], back: dict[str, Any]) -> Callable[[Any, bool], Any]:
    """t quantized and dequantized, in t's memory where ``fresh`` (nothing else holds it).

    With one scale and zero point z for both (the QDQ format's case), (clamp(r + z, low, high) - z)
    is clamp(r, low - z, high - z) on integers, and a NaN (quantized to 0) comes back as -z * s:
    five calls instead of seven."""
    import torch

    scale, zero, low, high = torch_params(into)
    same = scale.__class__ is float and all(
        np.array_equal(into[k], back[k]) for k in ("scale", "zero"))
    if same:
        def simple(t, fresh):
            t = t.div_(scale) if fresh else torch.div(t, scale)
            return t.round_().clamp_(low - zero, high - zero).nan_to_num_(-zero).mul_(scale)
        return simple
    out_scale, out_zero, _, _ = torch_params(back)

    def general(t, fresh):
        t = t.div_(scale) if fresh else torch.div(t, scale)
        t = t.round_().add_(zero).clamp_(low, high).nan_to_num_(0.0)
        return t.sub_(out_zero).mul_(out_scale)
    return general


def _fusable_round_trip(into: dict[str, Any], back: dict[str, Any],
                        finite: bool) -> Callable[[Any, bool], Any]:
    """The round trip as ``_round_trip`` computes it; in a trace out of place, as oneDNN Graph's
    fuser takes it (a division, rounding, a clamp and a product after a convolution are its
    post-ops), a NaN (quantized to 0) replaced before by what comes back as -z * s unless the
    input is ``finite``; run layer by layer, in place (at 224x224 each new tensor of a round trip
    costs more than the convolution it follows)."""
    import torch

    scale, zero, low, high = torch_params(into)
    out_scale, out_zero, _, _ = torch_params(back)
    same = scale.__class__ is float and all(
        np.array_equal(into[k], back[k]) for k in ("scale", "zero"))
    if not same:
        general = _round_trip(into, back)
        return lambda t, fresh: general(t, False)
    nan = -zero * scale  # (-z * s) / s rounds back to -z: the step NaN's 0 dequantizes to
    # a 1-element tensor is a constant of the frozen graph; a Python float became a tensor at
    # each call (aten::as_tensor and unsqueeze before each partition that reads it)
    step = torch.full((1,), scale)
    in_place = _round_trip(into, back)

    def run(t: Any, fresh: bool) -> Any:
        if not torch.jit.is_tracing():  # run layer by layer: in place, no new tensors
            return in_place(t, fresh)
        if not finite:
            t = torch.nan_to_num(t, nan=nan, posinf=float("inf"), neginf=float("-inf"))
        s = step if t.dim() else scale  # a 0-d t stays 0-d
        return torch.mul(torch.clamp(torch.round(torch.div(t, s)), low - zero, high - zero), s)
    return run


OFF_SHARE, FAR_SHARE = 0.10, 0.01
"""How much a compiled QDQ subgraph's output may differ from its layers' own, in units of the
output's quantization step (``within_steps``): at most this share of values off at all, and this
share off by more than one step. The yardstick is ONNX Runtime's own difference from CpuRef on the
full tier's QDQ models (its kernels round each requantization their own way, and a flip upstream
moves values downstream): mobilenet_dw_ts13's features 2.5% of values off, 0.44% by 2 to 6 steps,
its logits 5.8% off by one step; resnet_basic_dyn21's 1.0-1.9% off by one step."""


def output_steps(layers: list[Layer], outputs: list[str]) -> list[float | None]:
    """Per output of a subgraph, the step of the per-tensor QuantDequant that makes it (None for an
    output made otherwise)."""
    made = {layer.outputs[0]: layer for layer in layers if layer.op_type == "QuantDequant"}
    steps: list[float | None] = []
    for name in outputs:
        back = made[name].attrs["back"] if name in made else None
        steps.append(float(back["scale"]) if back is not None and back["scale"].ndim == 0
                     else None)
    return steps


def within_steps(got: Any, expected: Any, step: float) -> bool:
    """Whether ``got`` (a compiled QDQ subgraph's output) differs from ``expected`` (its layers')
    as a quantized model legitimately does (``OFF_SHARE``, ``FAR_SHARE``): the same shape, NaN
    and infinities in the same places, the finite values on the same grid but for that share."""
    import torch

    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)) \
            or got.dtype != expected.dtype or got.shape != expected.shape or step <= 0:
        return False
    finite = torch.isfinite(expected)
    same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    if not bool((same | finite).all()) or not bool(torch.isfinite(got[finite]).all()):
        return False
    steps = torch.round((got[finite].double() - expected[finite].double()).abs_() / step)
    count = max(steps.numel(), 1)
    return float((steps > 0).sum()) <= OFF_SHARE * count \
        and float((steps > 1).sum()) <= FAR_SHARE * count
