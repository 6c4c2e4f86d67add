"""ONNX Runtime's QOperator format on torch's int8 kernels: a fused QLinearConv (``qlinear``, or
a QDQ convolution chained in integers, ``qdq_chain``) between 8-bit integer tensors runs as
``torch.ops.quantized.conv2d`` requantizing to y's step, where ``CpuAcc.int8`` lets it and it is
known or measured faster than the float route (``fastest_qlinear``; the rules and modes are
``int8``'s). int8 tensors are torch's quint8 ones shifted by 128; an integer tensor is handed to
the kernels as a quint8 view of its memory (``quint8``) and read back the same way (``_raw``);
a residual QLinearAdd, the QuantizeLinear before (the stem), the DequantizeLinear after and a
MaxPool after are taken into the route."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.torch.fusion import int8  # its thresholds read at each call
from backplane.backends.torch.fusion.int8 import (_int8_or_float, _mode, known_faster,
                                                  per_thread_count)
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer

def qlinear_int8(conv: Layer, ctx: Context, attrs: dict[str, Any]) -> dict[str, Any] | None:
    """What a fused QLinearConv (``qlinear``) needs to run on torch's int8 convolution: an 8-bit
    integer input (or a float one and the QuantizeLinear taken, per tensor) and output (or its
    DequantizeLinear taken, per tensor, then a constant added or an activation), an int8 weight
    with zero points 0 and a float32 scale per tensor or channel, symmetric padding; else None.
    int8 tensors are torch's quint8 ones shifted by 128 (``int8._as_uint8``)."""
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


TRACED_FASTER = "int8: in a trace, the int8 call (int8_traced) where the float route is ~10"
"""Why a small QLinearConv in a trace takes the int8 route (``fastest_qlinear``)."""
SHIFTS = {np.dtype(np.uint8): 0, np.dtype(np.int8): 128}
"""What an 8-bit type's values add to become quint8's."""


def qlinear_int8_route(layer: Layer, traced: bool = False) -> Any:
    """The layer's QLinearConv as torch's int8 convolution requantizing to y's step, its integer
    output, or (a residual QLinearAdd taken) y's values handed to the add (``qlinear``). Where
    ``traced`` (for a trace, ``int8_traced``): one FBGEMM weight, the call written into the trace,
    and the integer tensors copied into and out of quint8 ones (``int_repr``), which a trace
    holds, where the views (``quint8``, ``_raw``) are storage calls it does not."""
    import torch

    from backplane.backends.torch.fusion import int8_traced
    from backplane.backends.torch.fusion.qlinear_float import max_pooled

    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_")
    a, q = layer.attrs, layer.attrs["int8"]
    weight = torch._make_per_channel_quantized_tensor(
        torch.from_numpy(np.array(q["weight"], np.int8)),
        torch.from_numpy(np.array(q["scales"], np.float64)),
        torch.zeros(len(q["scales"]), dtype=torch.long), 0)
    bias = torch.from_numpy(np.array(q["bias"], F32))
    geometry = (a["strides"], a["begins"], a["dilations"], a["group"])
    if traced:
        one = int8_traced.prepack(weight, bias, *geometry)
        packed, to_quint8, raw = (lambda: one), _copied_quint8, _int_repr
    else:
        packed = per_thread_count(lambda: torch.ops.quantized.conv2d_prepack(
            weight, bias, *geometry))
        to_quint8, raw = quint8, _raw
    x_scale, x_zero, x_shift = q["x_scale"], q["x_zero"], q["x_shift"]
    y_scale, y_zero, y_shift = q["y_scale"], q["y_zero"], q["y_shift"]
    cl, conv = torch.channels_last, int8_traced.conv2d if traced else torch.ops.quantized.conv2d
    into = _quantizer(a["into"], x_shift, x_scale, x_zero, to_quint8)

    def quantized(x):
        if into is not None:
            return conv(into(x), packed(), y_scale, y_zero)
        u8 = x.view(torch.uint8).bitwise_xor(128) if x_shift else x
        return conv(to_quint8(u8.contiguous(memory_format=cl), x_scale, x_zero), packed(),
                    y_scale, y_zero)

    def integers(x):
        return raw(quantized(x))  # quint8's: y + y_shift

    pool = max_pooled(a.get("pool"))
    if pool is not None:
        convolved = quantized
        quantized = lambda x: pool(convolved(x))  # noqa: E731  # on quint8: integers, exact
    if a["back"] is not None:
        return _dequantized(a, quantized, y_shift, raw)
    if a.get("residual") is not None:
        return _residual(a, quantized, y_shift, to_quint8, raw)
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


def _copied_quint8(u8: Any, scale: float, zero: int) -> Any:
    """``quint8``'s tensor as a copy, which a trace holds."""
    import torch

    return torch._make_per_tensor_quantized_tensor(u8, scale, zero)


def _int_repr(q: Any) -> Any:
    """``_raw``'s integers as a copy, which a trace holds."""
    return q.int_repr()


def _residual(a: dict[str, Any], quantized: Callable[[Any], Any], y_shift: int,
              to_quint8: Callable[..., Any] = quint8, raw: Callable[[Any], Any] = _raw) -> Any:
    """The route of a QLinearConv that took its residual QLinearAdd: ``torch.ops.quantized.add``
    of the convolution's quint8 result and the other operand (its integers as quint8, shifted by
    128 where int8), requantizing to the sum's step: one pass where dequantizing both, adding and
    quantizing were seven (1 thread, this AMD EPYC: (1, 32, 112, 112) about 0.6 -> 0.1 ms). Its
    float arithmetic may round a value at a half step the other way (within one step, as the
    convolution's own requantization). Where the add reads the convolution's output on another
    step than the convolution's own, ONNX Runtime's arithmetic (``qlinear_float._residual_finisher``)."""
    import torch

    from backplane.backends.torch.fusion.qlinear_float import _residual_finisher

    r, q = a["residual"], a["int8"]
    if float(r["mine_scale"]) != q["y_scale"] or r["mine_zero"] + y_shift != q["y_zero"]:
        add, zero = _residual_finisher(a), q["y_zero"]  # quint8's: y's zero point + y_shift
        return lambda x, other: (add(raw(quantized(x)).float().sub_(zero), other),)
    other_scale, other_zero = float(r["other_scale"]), r["other_zero"] + y_shift
    sum_scale, sum_zero = float(r["sum_scale"]), r["sum_zero"] + y_shift

    def run(x, other):
        u8 = other.view(torch.uint8).bitwise_xor(128) if y_shift else other
        q_other = to_quint8(u8, other_scale, other_zero)
        total = torch.ops.quantized.add(quantized(x), q_other, sum_scale, sum_zero)
        if r.get("dequantized"):  # a QDQ sum's DequantizeLinear taken (qdq_chain)
            return (total.dequantize(),)
        total = raw(total)
        return (total.bitwise_xor_(128).view(torch.int8) if y_shift else total,)
    return run


def _quantizer(into: dict[str, Any] | None, shift: int, x_scale: float, x_zero: int,
               to_quint8: Callable[..., Any] = quint8) -> Callable[[Any], Any] | None:
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
        return to_quint8(u8.contiguous(memory_format=cl), x_scale, x_zero)
    return on_grid


def _dequantized(a: dict[str, Any], quantized: Callable[[Any], Any], y_shift: int,
                 raw: Callable[[Any], Any] = _raw) -> Any:
    """The route of a QLinearConv that took its DequantizeLinear (per tensor): the quantized
    result less the DequantizeLinear's zero point (in quint8's range), times its scale in float32
    (an integer times a float32 scale, rounded once: CpuRef's, torch's ``dequantize`` where the
    step is the convolution's own), then the constant added and the activation."""
    from backplane.backends.torch.backend import _numpy_to_torch
    from backplane.backends.torch.fusion.patterns import torch_post_op

    scale, zero = float(a["back"]["scale"]), float(a["back"]["zero"]) + y_shift
    own = scale == a["int8"]["y_scale"] and zero == a["int8"]["y_zero"]
    add = _numpy_to_torch(a["add"]) if a["add"] is not None else None
    post = torch_post_op(a["activation"])

    def run(x):
        y = quantized(x)
        out = y.dequantize() if own else raw(y).float().sub_(zero).mul_(scale)
        out = out.add_(add) if add is not None else out
        return (post(out) if post else out,)
    return run


def fastest_qlinear(layer: Layer, backend: Any, float_route: Any) -> Any:
    """The int8 route of a fused QLinearConv or ``float_route()`` (bit for bit CpuRef's), as
    ``CpuAcc.int8`` says: "auto" the int8 one where known faster, else the faster measured once
    per shape, "kernels" the int8 one, "exact" the float one. In a trace (``Traced``) "auto"
    takes the int8 route written into the trace (``int8_traced``) below ``int8.KNOWN_MACS``: the
    float route there is about ten calls a layer (the small tier's QOperator ResNet, 1 thread:
    see docs/torch-backends.md); from it the route with views, which no trace holds (the full
    tier's QOperator ResNet traced on the float route ran 20.3 ms, its int8 layers one by one
    4.0, 1 thread), so those layers run one by one."""
    import torch

    from backplane.backends.torch.fusion.patterns import because, fastest
    from backplane.backends.torch.fusion.quantized import _for_a_trace

    mode = _mode(backend)
    if mode == "exact" or "x86" not in torch.backends.quantized.supported_engines:
        return float_route()
    if mode == "auto" and _for_a_trace(backend) \
            and not known_faster(layer.attrs, int8.KNOWN_MACS, grouped=True):
        return because(_int8_or_float(lambda: qlinear_int8_route(layer, traced=True),
                                      float_route, layer.name), TRACED_FASTER)

    def made() -> Any:
        return _int8_or_float(lambda: qlinear_int8_route(layer), float_route, layer.name)
    a = layer.attrs
    if mode == "kernels" or known_faster(a, int8.QOPERATOR_MACS, grouped=True):
        return because(made(), int8.KNOWN_FASTER if mode == "auto" else "CpuAcc.int8=kernels")
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
