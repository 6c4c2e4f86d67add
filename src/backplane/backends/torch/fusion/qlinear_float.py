"""The float route of a fused ``QLinearConv`` / ``QLinearMatMul`` (``qlinear``'s layers): the
centred input by the product with the multiplier in its weight, requantized in float32 as ONNX
Runtime requantizes (MLAS), then dequantized, added and activated where the layer took those.

Why a module of its own: ``qlinear`` finds the layers in a graph (at load, on constants), this
runs them (at each call, on tensors); the int8 routes (``int8_qlinear``, ``int8_traced``) and the
hand-off between layers (``qlinear_handoff``) take pieces of this one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.fusion import qlinear_traced
from backplane.backends.torch.fusion.int8_cast import PASSES_FROM, integers
from backplane.backends.torch.fusion.patterns import F32, compute_type, torch_post_op
from backplane.backends.torch.fusion.quantized import RANGES, to_grid, torch_params
from backplane.backends.torch.fusion.quantized import float32_operand as f32  # in a trace: no cast
from backplane.ir.graph import Layer

SPLIT = 16
"""The base of a split weight (``_exact_split``): high and low parts of 8-bit weights below 16."""


def max_pooled(pool: dict[str, Any] | None) -> Any:
    """The fused MaxPool (``_max_pool_after``) as a torch call (None where none was fused); on
    integer tensors through float32, which holds 8- and 16-bit integers exactly."""
    import torch

    if pool is None:
        return None
    window = (pool["kernel"], pool["strides"], pool["pads"], pool["dilations"], pool["ceil_mode"])

    def run(y):
        if y.is_floating_point() or y.is_quantized:
            return torch.max_pool2d(y, *window)
        return torch.max_pool2d(y.float(), *window).to(y.dtype)
    return run


def qlinear_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The float route below, or for a QLinearConv between 8-bit integer tensors, torch's int8
    convolution where ``CpuAcc.int8`` lets it and it measures faster
    (``int8_qlinear.qlinear_int8``)."""
    if layer.attrs.get("int8") and not layer.attrs.get("compute"):
        from backplane.backends.torch.fusion import int8_qlinear

        return int8_qlinear.fastest_qlinear(layer, backend, lambda: _float_route(layer, backend))
    return _float_route(layer, backend)


def _float_route(layer: Layer, backend: Any) -> Workload:
    """Centre (or quantize) the input, the product by the measured route with the multiplier in
    its weight (``_scaled``), requantize, and dequantize, add and activate where the layer took
    those."""
    import torch

    from backplane.backends.torch.fusion.conv import conv_workload
    from backplane.backends.torch.fusion.linear import linear_workload

    a, scaled = layer.attrs, _scaled(layer)
    product = (conv_workload if layer.op_type == "QLinearConv" else linear_workload)(scaled, backend)
    centre, finish, dtype = _centring(a), _finisher(a), compute_type(a)

    def widened(x):  # float32 (a trace records even a no-op .float(): oneDNN Graph's fuser failed)
        return x.float() if x.is_floating_point() and x.dtype != torch.float32 else x

    if a.get("residual") is not None:
        grid, add = _centred_grid(a), _residual_finisher(a)

        def run_residual(x, other):
            (acc,) = product(centre(widened(x)))
            return (add(grid(acc), other),)
        run_residual.route = getattr(product, "route", None)  # type: ignore[attr-defined]
        return run_residual

    pool = max_pooled(a.get("pool"))

    def run(x):
        (acc,) = product(centre(widened(x)))
        out = finish(pool(acc) if pool is not None else acc)
        return (out.to(dtype) if out.is_floating_point() and out.dtype != dtype else out,)
    run.route = getattr(product, "route", None)  # type: ignore[attr-defined]
    return run


def _scaled(layer: Layer) -> Layer:
    """``layer`` with its centred integer weight and bias times the multiplier s_x * s_w / s_y
    (per output channel: rows of a convolution's weight, of a product's (N, K) one), in float32:
    the product then gives acc * multiplier, which ONNX Runtime computes as float32(acc) times the
    float32 multiplier (MLAS's requantization), within a few float32 roundings of it; a split
    weight (``_exact_split``) is joined again (the float32 sums need no exactness now), and a
    Reduced layer's bfloat16 mark is dropped (``_in_float32``)."""
    a = _in_float32(layer).attrs
    weight, bias, halves = a["weight"].astype(np.float64), a["bias"], a.get("split")
    if halves is not None:
        weight, bias = weight[:halves] * SPLIT + weight[halves:], bias[halves:]
    multiplier = np.asarray(a["multiplier"], np.float64).reshape(-1)
    weight = weight * multiplier.reshape([-1] + [1] * (weight.ndim - 1))
    if bias is not None:
        bias = (np.asarray(bias, np.float64) * multiplier).astype(F32)
    attrs = {**a, "weight": weight.astype(F32), "bias": bias, "split": None}
    return Layer(layer.name, layer.op_type, layer.inputs, layer.outputs, attrs, layer.domain,
                 layer.opset, layer.backend)


def _in_float32(layer: Layer) -> Layer:
    """``layer`` with its product in float32 where a Reduced layer marked it to compute in
    bfloat16 (``reduced``): the integer sums must stay exact; its float input is widened and
    its float output narrowed instead."""
    if not layer.attrs.get("compute"):
        return layer
    attrs = {k: v for k, v in layer.attrs.items() if k != "compute"}
    return Layer(layer.name, layer.op_type, layer.inputs, layer.outputs, attrs, layer.domain,
                 layer.opset, layer.backend)


def quantize_centred_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """A QuantizeLinear whose readers take its integers less its zero point as float32
    (``qlinear_handoff._quantized_handoffs``): the centring a reader's own QuantizeLinear gets."""
    centre = _centring(layer.attrs)
    return lambda x: (centre(x),)


def _centring(a: dict[str, Any]) -> Any:
    """``_centred_input``; in a OneDnnGraph's trace out of place (``qlinear_traced``)."""
    return qlinear_traced.when_traced(
        _centred_input(a), qlinear_traced.centring(a) if a.get("fusable") else None)


def _centred_input(a: dict[str, Any]) -> Any:
    """The input minus its zero point, in float32: quantized first where the layer took the
    QuantizeLinear (with its zero point the layer's, the clamp is moved by it: clamp(r + z, low,
    high) - z is clamp(r, low - z, high - z), and a NaN, quantized to 0, centres to -z)."""
    import torch

    x_zero = a["x_zero"]
    if a.get("takes_centred"):  # float32 integers less x_zero already (``qlinear_handoff``)
        return lambda x: x
    if a["into"] is None:  # integers less a float32 tensor of one axis: float32, in one call
        zero = torch.full((1,), x_zero)  # (a casting loop: from PASSES_FROM values two passes)
        return lambda x: x.to(torch.float32).sub_(x_zero) \
            if x.is_cuda or x.numel() >= PASSES_FROM else torch.sub(x, zero)
    into = torch_params(a["into"])
    scale, zero, low, high = f32(into[0]), *into[1:]
    if zero.__class__ is float and zero == x_zero:
        return lambda x: torch.div(x, scale).round_().clamp_(low - zero, high - zero) \
            .nan_to_num_(-zero)
    grid, centre = (scale, f32(zero), low, high), f32(float(x_zero))
    return lambda x: to_grid(x, grid).sub_(centre)


def _finisher(a: dict[str, Any]) -> Any:
    """The scaled sums (acc * multiplier, ``_scaled``: the product's own tensor, changed in place)
    to the layer's output, in float32 as ONNX Runtime requantizes: rounded half to even,
    saturated (the clamp moved by the zero point), plus the zero point; then its integer type, or dequantized (an integer times a float32 scale,
    rounded once: CpuRef's; with the DequantizeLinear's zero point the requantization's, the zero
    point is not added at all), plus the constant, then the activation. A Relu after a positive
    scale is the clamp's floor at 0 (relu(y * s) is max(y, 0) * s): one call fewer;
    resnet_qlinear_ort15 has five."""
    from backplane.backends.torch.backend import _numpy_to_torch

    y_zero, low, high = a["y_zero"], a["y_low"], a["y_high"]
    if a.get("hands_centred") and a["back"] is None:  # to readers that take them so
        return _centred_grid(a)
    if a["back"] is None:
        dtype = next(t for t, bounds in _TORCH_RANGES().items() if bounds == (low, high))
        return lambda acc: integers(acc, y_zero, low, high, dtype)
    scale, zero = f32(_single(a["back"]["scale"])), _single(a["back"]["zero"])
    add = _numpy_to_torch(a["add"]) if a["add"] is not None else None
    post = torch_post_op(a["activation"])
    same = zero.__class__ is float and zero == y_zero
    floor = low - y_zero
    if same and add is None and a["activation"] is not None and a["activation"][0] == "relu" \
            and bool((a["back"]["scale"] > 0).all()):
        floor, post = max(floor, 0.0), None
    fusable = bool(a.get("fusable"))  # in a OneDnnGraph's trace: out of place
    if a.get("hands_centred"):  # not dequantized: the reader would quantize them back
        return qlinear_traced.when_traced(lambda acc: acc.round_().clamp_(floor, high - y_zero),
                                          qlinear_traced.grid(floor, high - y_zero) if fusable
                                          else None)

    def finish(acc):
        y = acc.round_().clamp_(floor, high - y_zero)
        out = (y if same else y.add_(y_zero).sub_(zero)).mul_(scale)
        out = out.add_(add) if add is not None else out
        return post(out) if post else out
    return qlinear_traced.when_traced(finish, qlinear_traced.finisher(
        a, post, add, floor, same, scale, zero) if fusable else None)


def _single(value: np.ndarray) -> Any:
    """A float32 constant as a Python float where it is a scalar (exact: float32 arithmetic with
    it rounds as with the float32 value), else a float32 tensor."""
    import torch

    return float(value) if value.ndim == 0 else torch.from_numpy(np.array(value, F32))


def _centred_grid(a: dict[str, Any]) -> Any:
    """The scaled sums requantized to the layer's output less its zero point, rint(acc)
    saturated, as float32 integers (``_finisher``'s first steps)."""
    zero, low, high = a["y_zero"], a["y_low"], a["y_high"]
    return qlinear_traced.when_traced(
        lambda acc: acc.round_().clamp_(low - zero, high - zero),
        qlinear_traced.grid(low - zero, high - zero) if a.get("fusable") else None)


def _residual_finisher(a: dict[str, Any]) -> Any:
    """QLinearAdd of the layer's output (``y``: its integers less the layer's zero point, float32,
    ours to change) and the other operand as ONNX Runtime's kernel (MLAS) computes it: each
    centred on its zero point, times its scale over the sum's (float32 ratios), the two summed
    (``add``'s alpha: a fused multiply-add, as MLAS's), rounded half to even, saturated, plus
    the sum's zero point; then dequantized ((q - z) * s in float32, the zero point cancelled)
    where the layer took the sum's DequantizeLinear (``qdq_chain``). Within one step of CpuRef's
    kernel (``kernels/contrib_quant.q_linear_add``: both dequantized, added, divided by the
    sum's scale) in 7 calls after the requantization's two (8 where it reads the layer's output
    on another zero point), where that way took 12."""
    import torch

    r = a["residual"]
    mine, other_ratio = (float(np.float32(r[k]) / np.float32(r["sum_scale"]))
                         for k in ("mine_scale", "other_scale"))
    shift = float(a["y_zero"] - r["mine_zero"])  # the layer's zero point against the add's
    other_zero, zero_value = torch.full((1,), float(r["other_zero"])), float(r["other_zero"])
    zero, low, high = r["sum_zero"], a["y_low"], a["y_high"]
    dtype = next(t for t, bounds in _TORCH_RANGES().items() if bounds == (low, high))
    scale, mine = f32(float(np.float32(r["sum_scale"]))), f32(mine)
    handing = bool(a.get("hands_centred"))  # the sum's integers less its zero point, as they are
    taken = bool(a.get("takes_centred_other"))  # the other's so (``qlinear_handoff``)

    def add(y, other):
        y = y.add_(shift) if shift else y
        centred = other if taken else other.to(torch.float32).sub_(zero_value) \
            if other.is_cuda or other.numel() >= PASSES_FROM else torch.sub(other, other_zero)
        total = torch.add(y.mul_(mine), centred, alpha=other_ratio)
        if r.get("dequantized") or handing:
            grid = total.round_().clamp_(low - zero, high - zero)
            return grid if handing else grid.mul_(scale)
        return integers(total, zero, low, high, dtype)
    return add


def _TORCH_RANGES() -> dict[Any, tuple[int, int]]:  # noqa: N802
    import torch

    return {torch.uint8: RANGES[np.dtype(np.uint8)], torch.int8: RANGES[np.dtype(np.int8)],
            torch.int16: RANGES[np.dtype(np.int16)], torch.uint16: RANGES[np.dtype(np.uint16)]}
