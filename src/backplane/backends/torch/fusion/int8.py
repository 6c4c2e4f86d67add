"""Quantized convolutions and matrix products on torch's int8 kernels, where they measure faster
than the float route: the QDQ format's convolutions (FBGEMM / oneDNN through
``torch.ops.quantized``, a Relu or Clip(0, bound) after them), its Gemm / MatMul
(``torch._int_mm``, int32 products), and ONNX Runtime's QLinearConv between 8-bit tensors (the
QOperator format, ``qlinear``). Below, the QDQ convolution's case; the others follow it.

A ``QuantDequant`` layer holding a FusedConv (``quantized.then_quant_dequant``) whose input is the
DequantizeLinear of a uint8 tensor and whose weight is an int8 tensor times a per-channel scale
(the DequantizeLinear of the weight is folded into a float constant before fusion: the integers
and scales are found again from it, and kept only where they give back every float weight bit for
bit) may run as quantize -> int8 convolution (with its Relu) -> dequantize. The integer sums are
exact; the rounding of the result to the output's step is done by the kernel's own float
arithmetic instead of the graph's float convolution, so a value within a float32 rounding of a
halfway point may land one step away: the result is within one quantization step of CpuRef's and
ONNX Runtime's (ONNX Runtime's own optimized graph runs these as QLinearConv, the same way).

A convolution of one group with at least ``KNOWN_MACS`` multiply-adds takes the int8 route without
timing, on a busy machine too; for the others the int8 route and the float one
(``quantized.quant_dequant_workload``) are timed at load on the layer's shape and the faster kept
(``CpuAcc.int8``: "auto", the default; "kernels" forces the int8 route where it applies; "exact"
never takes it, for results bit for bit CpuRef's). On the tiny
corpus CNNs the float route often wins (quantizing and dequantizing cost a pass each); on a
224x224 ResNet-18 the int8 convolutions are several times faster.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.torch.fusion import int8_exact
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer

log = logging.getLogger("backplane.torch")
MODES = ("auto", "kernels", "exact")


def int8_conv(fused: Layer, ctx: Context, out_params: dict[str, Any]) -> dict[str, Any] | None:
    """What the int8 route needs of a FusedConv followed by a uint8 round trip (``out_params``):
    its input's step and zero point, the integer weight and its scales; None where it does not
    apply (another layout of quantization, a residual, an activation other than Relu or
    Clip(0, bound), padding oneDNN does not take, a weight that is not int8 times a scale per
    channel)."""
    a = fused.attrs
    if fused.op_type != "FusedConv" or a["binary"] or a["begins"] != a["ends"] \
            or _ceiling(a["unary"]) is False or _as_uint8(out_params) is None:
        return None
    made = ctx.graph.producers().get(fused.inputs[0])
    if made is None or made.op_type != "DequantizeLinear" or made.domain:
        return None
    from backplane.backends.torch.fusion.quantized import quant_params

    x_params = quant_params(made, ctx, 1, None)
    x_step = _as_uint8(x_params) if x_params is not None else None
    found = integer_weight(a["weight"])
    if x_step is None or found is None:
        return None
    (x_scale, x_zero), (weight, scales) = x_step, found
    return {"x_scale": x_scale, "x_zero": x_zero, "weight": weight, "scales": scales}


def _ceiling(unary: Any) -> float | None | bool:
    """The upper bound of a FusedConv's activation the int8 route runs: None for none or Relu,
    the bound of a Clip(0, bound) (ReLU6: Relu, then the quantized result clamped at the bound,
    which gives the bound's step as rounding keeps order); False for any other activation."""
    if unary is None or unary[0] == "relu":
        return None
    if unary[0] == "hardtanh" and unary[1][0] == 0 and 0 < unary[1][1] < float("inf"):
        return float(unary[1][1])
    return False


def _as_uint8(params: dict[str, Any]) -> tuple[float, int] | None:
    """A per-tensor 8-bit quantization as torch's quint8 one (scale, zero point): int8's q with
    zero point z is uint8's q + 128 with z + 128, the same values and the same saturation."""
    if params["scale"].ndim != 0 or params["high"] - params["low"] != 255:
        return None
    return float(params["scale"]), int(params["zero"]) - params["low"]


def integer_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(int8 k, float32 scale per output channel) with (k * scale) rounded to float32 equal to
    ``weight`` everywhere (as DequantizeLinear computes it), or None. The scale is found from the
    largest |w| of the tensor (a per-tensor scale) or of each channel, which a symmetric quantizer
    maps to 127 (ONNX Runtime) or 128."""
    flat = weight.reshape(weight.shape[0], -1).astype(np.float64)
    whole = _scaled(flat)
    if whole is not None:
        return whole[0].reshape(weight.shape), np.full(flat.shape[0], whole[1], F32)
    ints, scales = np.zeros(flat.shape, np.int8), np.zeros(flat.shape[0], F32)
    for channel, row in enumerate(flat):
        found = _scaled(row)
        if found is None:
            return None
        ints[channel], scales[channel] = found
    return ints.reshape(weight.shape), scales


def _scaled(values: np.ndarray) -> tuple[np.ndarray, np.float32] | None:
    """``values`` as int8 times one float32 scale, exactly, or None. The largest |value| is tried
    as each integer from 128 down to 64 times the scale (a symmetric quantizer puts it at 127 or
    128; a trained one may leave it lower), the scale rounded either way; each guess is checked on
    a few values before all of them."""
    peak = float(np.max(np.abs(values)))
    if peak == 0:
        return np.zeros(values.shape, np.int8), np.float32(1.0)
    head = values[:16]
    for levels in (127, 128, *range(126, 63, -1)):
        guess = np.float32(peak / levels)
        for scale in (guess, np.nextafter(guess, F32.type(0)), np.nextafter(guess, F32.type(1))):
            if _exact(head, float(scale)) and _exact(values, float(scale)):
                return np.rint(values / float(scale)).astype(np.int8), scale
    return None


def _exact(values: np.ndarray, scale: float) -> bool:
    """Whether each value is an int8 times ``scale`` rounded to float32 (DequantizeLinear's)."""
    k = np.rint(values / scale)
    return bool(k.min() >= -128 and k.max() <= 127 and
                np.array_equal((k * scale).astype(F32), values.astype(F32)))


def int8_route(layer: Layer) -> Any:
    """The int8 convolution of a QuantDequant layer with ``int8`` attributes: quantize the input to
    its uint8 step, the convolution (and Relu) requantizing to the output's, dequantize.

    torch 2.13 deprecates its quantized tensors (pytorch/pytorch#184982) and says so once per
    process; should a later torch drop them, building this route fails and the float one runs."""
    import torch

    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_")
    a, conv = layer.attrs, layer.attrs["layers"][0].attrs
    q = a["int8"]
    weight = torch._make_per_channel_quantized_tensor(
        torch.from_numpy(np.array(q["weight"], np.int8)),
        torch.from_numpy(q["scales"].astype(np.float64)),
        torch.zeros(len(q["scales"]), dtype=torch.long), 0)
    bias = torch.from_numpy(np.array(conv["bias"], F32))
    packed = per_thread_count(lambda: torch.ops.quantized.conv2d_prepack(
        weight, bias, conv["strides"], conv["begins"], conv["dilations"], conv["group"]))
    run_conv = torch.ops.quantized.conv2d_relu if conv["unary"] else torch.ops.quantized.conv2d
    out_scale, out_zero = _as_uint8(a["back"])  # type: ignore[misc]
    x_scale, x_zero = q["x_scale"], q["x_zero"]
    cl, ceiling = torch.channels_last, _ceiling(conv["unary"])

    def run(x):
        qx = torch.quantize_per_tensor(x.contiguous(memory_format=cl), x_scale, x_zero,
                                       torch.quint8)
        y = run_conv(qx, packed(), out_scale, out_zero)
        return ((y if ceiling is None else torch.clamp(y, max=ceiling)).dequantize(),)
    return run


def per_thread_count(prepack: Callable[[], Any]) -> Callable[[], Any]:
    """A packed weight per intra-op thread count, each made by ``prepack`` (the first now, the
    others at the first call at their count), the calling thread's returned.

    Why: torch's oneDNN int8 convolution keeps the primitive of a packed weight's first call, for
    that call's thread count; a call at another count makes its primitive again each time, on the
    calling thread. CpuAcc times a partition at one thread before it runs at two
    (``small.fewer_threads``), so at two threads every call paid that, about 40 us: the calling
    thread's CPU a call (1, 64, 56, 56) 3x3 64 -> 64 361 -> 319 us, 1x1 stride 2 to 128 channels
    96 -> 56, (1, 32, 112, 112) 1x1 to 64 190 -> 151 (the other thread's 280 / 28 / 111 either
    way; 2 threads, 200 calls, this AMD EPYC)."""
    import torch

    packs = {torch.get_num_threads(): prepack()}

    def packed() -> Any:
        count = torch.get_num_threads()
        found = packs.get(count)
        return found if found is not None else packs.setdefault(count, prepack())
    packed.packs = packs  # type: ignore[attr-defined]  # for tests
    return packed


KNOWN_MACS = 1 << 20
"""The multiply-adds a run from which torch's int8 convolution of one group (quantizing its
input and dequantizing its output included) is taken without timing it against the float
route: 1 thread, this 2-core AMD EPYC (AVX512-VNNI), float / int8 us: 16ch 16x16 3x3 (0.6 M)
31 / 30, 16ch 32x32 3x3 (2.4 M) 110 / 43, 64ch 7x7 3x3 (1.8 M) 74 / 34, 64ch 56x56 3x3
2113 / 603, ResNet's 7x7 stem at 224x224 2384 / 920. Below it, and for grouped (depthwise)
convolutions (32ch 112x112 3x3 depthwise: 120 / 221), the routes are timed at load, and a busy
machine takes the float route."""
KNOWN_FASTER = "int8: known faster than float at this size (int8.known_faster), not timed"


GROUP_CHANNELS = 8
"""A grouped QDQ convolution with this many input channels a group is taken as a dense one: 4
groups of 12 channels, 64 outputs at 56x112, float route and round trip / int8 us 1421 / 441 (1
thread, this AMD EPYC); a depthwise one measured even (64ch 112x112 550 / 502, 128ch 56x56
297 / 313) and stays timed."""
QOPERATOR_MACS = 1 << 16
"""The same for a QLinearConv of any group: its float route centres, convolves and requantizes
in float64 (five passes where the int8 route makes one call): 1 thread, this AMD EPYC, float
route / int8 us: depthwise 16ch 28x28 3x3 (0.11 M) 82 / 28, 96ch 56x112 6954 / 271, 4 groups
64ch 56x112 1726 / 343, dense 64ch 56x56 3x3: see ``KNOWN_MACS``."""


def known_faster(conv: dict[str, Any], least: int = KNOWN_MACS, grouped: bool = False) -> bool:
    """Whether a convolution's int8 route is taken without timing: at least ``least``
    multiply-adds a run, and (unless ``grouped``) one group or at least ``GROUP_CHANNELS`` input
    channels a group (``conv``: FusedConv's or QLinearConv's attributes)."""
    weight, shape = conv["weight"].shape, conv["input_shape"]
    if conv["group"] != 1 and weight[1] < GROUP_CHANNELS and not grouped \
            or len(weight) != 4 or len(shape) != 4:
        return False
    outputs = 1
    for size, kernel, stride, dilation, begin, end in zip(
            shape[2:], weight[2:], conv["strides"], conv["dilations"], conv["begins"],
            conv["ends"]):
        outputs *= max((size + begin + end - dilation * (kernel - 1) - 1) // stride + 1, 0)
    halves = 2 if conv.get("split") else 1  # a split QLinearConv weight: twice the channels
    return weight[0] // halves * weight[1] * weight[2] * weight[3] * outputs >= least


def fastest_route(layer: Layer, backend: Any, float_route: Any) -> Any:
    """The int8 route or ``float_route()``, as ``CpuAcc.int8`` says (see above): measured once
    per shape and kept in the route cache."""
    import torch

    from backplane.backends.api.backend import OptionError
    from backplane.backends.torch.fusion.patterns import because, fastest

    inner = layer.attrs["layers"][0]
    linear = inner.op_type == "Linear"
    mode = backend.options.get("CpuAcc.int8", "auto")
    if mode not in MODES:
        raise OptionError(f"CpuAcc.int8 {mode!r} is not one of {', '.join(MODES)}")
    mode = int8_exact.mode(mode)
    if mode == "exact" or not linear and "x86" not in torch.backends.quantized.supported_engines:
        return float_route()

    def made() -> Any:
        return _int8_or_float(lambda: int8_linear_route(layer) if linear else int8_route(layer),
                              float_route, layer.name)
    conv = inner.attrs
    if mode == "kernels" or not linear and known_faster(conv):
        return because(made(), KNOWN_FASTER if mode == "auto" else "CpuAcc.int8=kernels")
    keys = ("input_shape", "unary") if linear else ("input_shape", "strides", "dilations",
                                                    "group", "begins", "unary")
    described = {k: conv[k] for k in keys}
    described["weight"] = list(conv["weight"].shape)

    def sample() -> list[Any]:
        x = torch.rand(conv["input_shape"])
        return [x if linear else x.contiguous(memory_format=torch.channels_last)]
    return fastest("qdq_linear" if linear else "qdq_conv", described,
                   {"float": float_route, "int8": made}, sample, backend)


# -- QDQ matrix products: torch._int_mm ---------------------------------------------------------
def int8_linear(fused: Layer, ctx: Context, out_params: dict[str, Any]) -> dict[str, Any] | None:
    """What the int8 route needs of a Linear (a QDQ Gemm or MatMul, its weight's DequantizeLinear
    folded) followed by a round trip: its input the DequantizeLinear of an 8-bit tensor per
    tensor, its weight int8 times a scale per output (found again bit for bit), no post-op but
    Relu, no residual and no Reshape taken; else None."""
    a = fused.attrs
    if fused.op_type != "Linear" or a.get("binary") or a.get("output_shape") \
            or (a["unary"] is not None and a["unary"][0] != "relu") \
            or _as_uint8(out_params) is None:
        return None
    producers = ctx.graph.producers()
    made = producers.get(fused.inputs[0])
    while made is not None and made.op_type in RESHAPES and not made.domain:
        made = producers.get(made.inputs[0])  # values as they are (Flatten before a Gemm)
    if made is None or made.op_type != "DequantizeLinear" or made.domain:
        return None
    from backplane.backends.torch.fusion.quantized import quant_params

    x_params = quant_params(made, ctx, 1, None)
    x_step = _as_uint8(x_params) if x_params is not None else None
    found = integer_weight(a["weight"])  # (N, K): a scale per output
    if x_step is None or found is None:
        return None
    (x_scale, x_zero), (weight, scales) = x_step, found
    return {"x_scale": x_scale, "x_zero": x_zero, "weight": weight, "scales": scales}


RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def int8_linear_route(layer: Layer) -> Any:
    """The input back on its 8-bit grid (x is its DequantizeLinear's output: exact), shifted to
    int8, its integer product with the int8 weight by ``torch._int_mm`` (int32, exact; VNNI),
    less the shift's share, times the scales, plus the bias, Relu, then the layer's round trip.
    The float route sums the dequantized products in float32 instead: the two differ by float32
    roundings, so a result near a halfway point may land one step away."""
    import torch

    from backplane.backends.torch.fusion.quantized import _round_trip

    a, lin = layer.attrs, layer.attrs["layers"][0].attrs
    q = a["int8"]
    weight = torch.from_numpy(np.ascontiguousarray(np.array(q["weight"], np.int8).T))  # (K, N)
    shift = int(q["x_zero"]) - 128  # quint8's zero point, as int8's
    correction = weight.sum(0, dtype=torch.int32).mul_(shift)
    multiplier = torch.from_numpy((np.float32(q["x_scale"]) * np.array(q["scales"], F32)))
    bias = None if lin["bias"] is None else torch.from_numpy(np.array(lin["bias"], F32))
    relu, x_scale = lin["unary"] is not None, q["x_scale"]
    round_trip = _round_trip(a["into"], a["back"])
    k, n = weight.shape

    def run(x):
        rows = torch.round(x.reshape(-1, k) / x_scale).add_(shift).clamp_(-128, 127)
        acc = torch._int_mm(rows.to(torch.int8), weight).sub_(correction)
        y = acc.float().mul_(multiplier)
        y = y.add_(bias) if bias is not None else y
        y = y.relu_() if relu else y
        return (round_trip(y.reshape(*x.shape[:-1], n), True),)
    return run


# -- ONNX Runtime's QOperator format: QLinearConv between 8-bit integer tensors -------------------
def qlinear_int8(conv: Layer, ctx: Context, attrs: dict[str, Any]) -> dict[str, Any] | None:
    """What a fused QLinearConv (``qlinear``) needs to run on torch's int8 convolution: an 8-bit
    integer input (or a float one and the QuantizeLinear taken, per tensor) and output (or its
    DequantizeLinear taken, per tensor, then a constant added or an activation), an int8 weight
    with zero points 0 and a float32 scale per tensor or channel, symmetric padding; else None.
    int8 tensors are torch's quint8 ones shifted by 128 (``_as_uint8``)."""
    weight, w_zero = ctx.const(conv.inputs[3]), ctx.const(conv.inputs[5])
    x_scale, w_scale = ctx.const(conv.inputs[1]), ctx.const(conv.inputs[4])
    y_scale = ctx.const(conv.inputs[6])
    x_type = ctx.graph.info(conv.inputs[0]).dtype
    if any(attrs[k] is not None and attrs[k]["scale"].ndim for k in ("into", "back")) \
            or attrs["begins"] != attrs["ends"] \
            or weight is None or weight.dtype != np.int8 or (w_zero is not None and w_zero.any()) \
            or x_type not in SHIFTS or x_scale is None or y_scale is None \
            or w_scale is None or w_scale.dtype != F32:
        return None
    bias = ctx.const(conv.inputs[8]) if len(conv.inputs) > 8 else None
    scales = np.broadcast_to(w_scale.astype(np.float64).reshape(-1), (weight.shape[0],))
    x_step, y_step = float(x_scale.reshape(())), float(y_scale.reshape(()))
    real_bias = np.zeros(weight.shape[0]) if bias is None else bias * x_step * scales
    return {"weight": weight, "scales": np.array(scales),
            "bias": real_bias.astype(F32), "x_scale": x_step,
            "x_zero": int(attrs["x_zero"]) + SHIFTS[x_type], "x_shift": SHIFTS[x_type],
            "y_scale": y_step, "y_zero": int(attrs["y_zero"]) - int(attrs["y_low"]),
            "y_shift": -int(attrs["y_low"])}


SHIFTS = {np.dtype(np.uint8): 0, np.dtype(np.int8): 128}
"""What an 8-bit type's values add to become quint8's."""


def qlinear_int8_route(layer: Layer) -> Any:
    """The layer's QLinearConv as torch's int8 convolution requantizing to y's step, its integer
    output, or (a residual QLinearAdd taken) y's values handed to the add (``qlinear``)."""
    import torch

    from backplane.backends.torch.fusion.qlinear import max_pooled

    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_")
    a, q = layer.attrs, layer.attrs["int8"]
    weight = torch._make_per_channel_quantized_tensor(
        torch.from_numpy(np.array(q["weight"], np.int8)),
        torch.from_numpy(np.array(q["scales"], np.float64)),
        torch.zeros(len(q["scales"]), dtype=torch.long), 0)
    bias = torch.from_numpy(np.array(q["bias"], F32))
    packed = per_thread_count(lambda: torch.ops.quantized.conv2d_prepack(
        weight, bias, a["strides"], a["begins"], a["dilations"], a["group"]))
    x_scale, x_zero, x_shift = q["x_scale"], q["x_zero"], q["x_shift"]
    y_scale, y_zero, y_shift = q["y_scale"], q["y_zero"], q["y_shift"]
    cl, conv = torch.channels_last, torch.ops.quantized.conv2d
    into = _quantizer(a["into"], x_shift, x_scale, x_zero)

    def quantized(x):
        if into is not None:
            return conv(into(x), packed(), y_scale, y_zero)
        u8 = x.view(torch.uint8).bitwise_xor(128) if x_shift else x
        return conv(quint8(u8.contiguous(memory_format=cl), x_scale, x_zero), packed(), y_scale,
                    y_zero)

    def integers(x):
        return _raw(quantized(x))  # quint8's: y + y_shift

    pool = max_pooled(a.get("pool"))
    if pool is not None:
        convolved = quantized
        quantized = lambda x: pool(convolved(x))  # noqa: E731  # on quint8: integers, exact
    if a["back"] is not None:
        return _dequantized(a, quantized, y_shift)
    if a.get("residual") is not None:
        return _residual(a, quantized, y_shift)
    if y_shift:
        return lambda x: (integers(x).bitwise_xor_(128).view(torch.int8),)
    return lambda x: (integers(x),)


def _raw(q: Any) -> Any:
    """A quint8 tensor's integers as a uint8 tensor sharing its memory: ``int_repr`` copies them
    one by one (112 us for (1, 64, 56, 56), 1 thread, this AMD EPYC; this 2 us)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(),
                                                  q.shape, q.stride())


def quint8(u8: Any, scale: float, zero: int) -> Any:
    """A dense uint8 tensor's integers as a quint8 tensor (``scale``, ``zero``) sharing its memory,
    as ``_raw`` does the other way. torch's ``_make_per_tensor_quantized_tensor`` copies them on
    the calling thread, a pass no second thread shares: 20 us for (1, 64, 112, 112) (2 us this
    way; 1 thread, this AMD EPYC), 17 copies a run of the full tier's QDQ MobileNet. A tensor that
    is not dense (a strided view) is copied, as that function would."""
    import torch

    if not (u8.is_contiguous() or u8.dim() == 4 and u8.is_contiguous(
            memory_format=torch.channels_last)):
        return torch._make_per_tensor_quantized_tensor(u8, scale, zero)
    empty = torch._empty_affine_quantized([0], scale=scale, zero_point=zero, dtype=torch.quint8)
    return empty.set_(u8.untyped_storage(), u8.storage_offset(), u8.shape, u8.stride())


def _residual(a: dict[str, Any], quantized: Callable[[Any], Any], y_shift: int) -> Any:
    """The route of a QLinearConv that took its residual QLinearAdd: ``torch.ops.quantized.add``
    of the convolution's quint8 result and the other operand (its integers as quint8, shifted by
    128 where int8), requantizing to the sum's step: one pass where dequantizing both, adding and
    quantizing were seven (1 thread, this AMD EPYC: (1, 32, 112, 112) about 0.6 -> 0.1 ms). Its
    float arithmetic may round a value at a half step the other way (within one step, as the
    convolution's own requantization). Where the add reads the convolution's output on another
    step than the convolution's own, the kernel's arithmetic (``qlinear._residual_finisher``)."""
    import torch

    from backplane.backends.torch.fusion.qlinear import _residual_finisher, sum_dequantizer

    r, q = a["residual"], a["int8"]
    back = sum_dequantizer(r)
    if float(r["mine_scale"]) != q["y_scale"] or r["mine_zero"] + y_shift != q["y_zero"]:
        add = _residual_finisher(a)
        return lambda x, other: (back(add(_raw(quantized(x)).float().sub_(y_shift), other)),)
    other_scale, other_zero = float(r["other_scale"]), r["other_zero"] + y_shift
    sum_scale, sum_zero = float(r["sum_scale"]), r["sum_zero"] + y_shift

    def run(x, other):
        u8 = other.view(torch.uint8).bitwise_xor(128) if y_shift else other
        q_other = quint8(u8, other_scale, other_zero)
        total = torch.ops.quantized.add(quantized(x), q_other, sum_scale, sum_zero)
        if r.get("dequantized"):  # a QDQ sum's DequantizeLinear taken (qdq_chain)
            return (total.dequantize(),)
        total = _raw(total)
        return (total.bitwise_xor_(128).view(torch.int8) if y_shift else total,)
    return run


def _quantizer(into: dict[str, Any] | None, shift: int, x_scale: float,
               x_zero: int) -> Callable[[Any], Any] | None:
    """A taken QuantizeLinear (per tensor) as a function of the float input giving the quint8
    tensor, channels-last, that the convolution reads; None where none was taken.

    Where its step is the convolution's own: x / s rounded half to even (CpuRef's rounding: a
    NaN replaced by -z, which quantizes to 0 as CpuRef's cast makes it), times s, then torch's
    ``quantize_per_tensor``, whose product by 1 / s gives those integers back exactly (|k| * 2^-22
    is far from a half) and adds z: CpuRef's values in six passes where its steps and the copies to
    channels-last and into a quint8 tensor were eight (ResNet's 224x224 input 271-316 -> 141 us
    in five, 1 thread, this AMD EPYC, before the clamp). Else ``quantized.to_grid``, shifted into
    quint8's range.
    """
    import torch

    from backplane.backends.torch.fusion.quantized import to_grid, torch_params

    if into is None:
        return None
    params = torch_params(into)
    scale, zero, low, high = params
    cl = torch.channels_last
    if scale.__class__ is float and scale == x_scale and zero + shift == x_zero \
            and high - low == 255:
        def per_tensor(x):
            # clamped before the product: torch 2.11's quantize_per_tensor on an Intel Xeon
            # (the GPU machine's) gave +inf the grid's lowest integer, not its highest, silently
            # (test_int8_stem); the clamp leaves it only values on the grid
            k = torch.div(x, scale).round_().nan_to_num_(-zero).clamp_(low - zero, high - zero)
            k = k.mul_(scale)
            return torch.quantize_per_tensor(k, x_scale, x_zero, torch.quint8).contiguous(
                memory_format=cl)
        return per_tensor

    def on_grid(x):
        u8 = to_grid(x, params).add_(shift).to(torch.uint8)
        return quint8(u8.contiguous(memory_format=cl), x_scale, x_zero)
    return on_grid


def _dequantized(a: dict[str, Any], quantized: Callable[[Any], Any], y_shift: int) -> Any:
    """The route of a QLinearConv that took its DequantizeLinear (per tensor): the quantized
    result less the DequantizeLinear's zero point (in quint8's range), times its scale in float32
    (an integer times a float32 scale, rounded once: CpuRef's, torch's ``dequantize`` where the
    step is the convolution's own), then the constant added and the activation."""
    import torch

    from backplane.backends.torch.backend import _numpy_to_torch
    from backplane.backends.torch.fusion.patterns import torch_post_op

    scale, zero = float(a["back"]["scale"]), float(a["back"]["zero"]) + y_shift
    own = scale == a["int8"]["y_scale"] and zero == a["int8"]["y_zero"]
    add = _numpy_to_torch(a["add"]) if a["add"] is not None else None
    post = torch_post_op(a["activation"])

    def run(x):
        y = quantized(x)
        out = y.dequantize() if own else _raw(y).float().sub_(zero).mul_(scale)
        out = out.add_(add) if add is not None else out
        return (post(out) if post else out,)
    return run


def fastest_qlinear(layer: Layer, backend: Any, float_route: Any) -> Any:
    """The int8 route of a fused QLinearConv or ``float_route()`` (bit for bit CpuRef's), as
    ``CpuAcc.int8`` says: "auto" the int8 one where known faster, else the faster measured once
    per shape, "kernels" the int8 one, "exact" the float one. In a trace (``Traced``) "auto"
    takes the float route, which TorchScript holds, below ``KNOWN_MACS``: the small tier's
    QOperator ResNet ran its int8 layers one by one, untraced, 0.36 -> 0.78 ms a run (2 threads);
    from it the int8 route, which no trace holds (the full tier's QOperator ResNet traced on the
    float route ran 20.3 ms, its int8 layers one by one 4.0, 1 thread)."""
    import torch

    from backplane.backends.torch.fusion.patterns import because, fastest
    from backplane.backends.torch.fusion.quantized import _for_a_trace

    mode = _mode(backend)
    if mode == "exact" or "x86" not in torch.backends.quantized.supported_engines \
            or mode == "auto" and _for_a_trace(backend) \
            and not known_faster(layer.attrs, KNOWN_MACS, grouped=True):
        return float_route()

    def made() -> Any:
        return _int8_or_float(lambda: qlinear_int8_route(layer), float_route, layer.name)
    a = layer.attrs
    if mode == "kernels" or known_faster(a, QOPERATOR_MACS, grouped=True):
        return because(made(), KNOWN_FASTER if mode == "auto" else "CpuAcc.int8=kernels")
    described = {k: a[k] for k in ("input_shape", "strides", "dilations", "group", "begins")}
    described.update(weight=list(a["weight"].shape), residual=a.get("residual") is not None,
                     pool=a.get("pool"))
    x_type = torch.int8 if a["int8"]["x_shift"] else torch.uint8
    y_type = torch.int8 if a["int8"]["y_shift"] else torch.uint8

    def sample() -> list[Any]:
        x = torch.randn(a["input_shape"]) if a["into"] is not None else torch.randint(
            -128 if x_type == torch.int8 else 0, 128 if x_type == torch.int8 else 256,
            a["input_shape"], dtype=x_type)
        if a.get("residual") is None:
            return [x]
        shape = a["output_shape"]
        return [x, torch.randint(-128 if y_type == torch.int8 else 0, 128 if y_type ==
                                 torch.int8 else 256, shape, dtype=y_type)]
    return fastest("qlinear_conv", described, {"float": float_route, "int8": made}, sample,
                   backend)


def _mode(backend: Any) -> str:
    from backplane.backends.api.backend import OptionError

    mode = backend.options.get("CpuAcc.int8", "auto")
    if mode not in MODES:
        raise OptionError(f"CpuAcc.int8 {mode!r} is not one of {', '.join(MODES)}")
    return int8_exact.mode(mode)


def _int8_or_float(make: Callable[[], Any], float_route: Callable[[], Any], name: str) -> Any:
    """The int8 route ``make`` makes, named so; the float one where torch has no quantized
    tensors (a build without them)."""
    try:
        run = make()
    except (RuntimeError, AttributeError) as exc:
        log.debug("%s: no int8 route (%s); the float one", name, exc)
        return float_route()
    run.route = "int8"
    return run
