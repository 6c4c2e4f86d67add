"""Quantized convolutions and matrix products on torch's int8 kernels, where they measure faster
than the float route: the QDQ format's convolutions (FBGEMM / oneDNN through
``torch.ops.quantized``, a Relu or Clip(0, bound) after them), its Gemm / MatMul
(``torch._int_mm``, int32 products), and ONNX Runtime's QLinearConv between 8-bit tensors (the
QOperator format, ``qlinear``; its route in ``int8_qlinear``). Below, the QDQ convolution's case;
the others follow it.

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
    mode = int8_exact.mode(mode, product=linear)
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
