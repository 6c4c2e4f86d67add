"""ONNX Runtime's contrib int8 ops (domain com.microsoft) in the int8 plan: the QOperator format's
residual adds, hard-swishes, pools and heads (ONNX Runtime's quantizer writes them for a
mobilenet or a ResNet with a free batch dimension).

QLinearAdd, QLinearMul, QLinearGlobalAveragePool and QLinearAveragePool are planned as their
definition reads: the inputs dequantized, the float operation, QuantizeLinear of the output's
step (the same records as the QDQ format's float glue). ONNX Runtime's MLAS kernels compute them
in another float order (a scale ratio times the integer plus a fixed part): within a step of
them, where a value lies near a rounding tie. QGemm (int8 A and B, an int32 bias, a quantized
output) is a quantized product, exact integer sums and MLAS's requantization, as QLinearMatMul.
"""

from __future__ import annotations

import numpy as np

from backplane.ir.graph import Layer
from backplane.native.qcnn import Pending, Planner, Unplannable

F32 = np.float32


def _dequantized(p: Planner, layer: Layer, at: int) -> str:
    """The float value of the 8-bit input ``layer.inputs[at]`` (its scale and zero point after
    it), its DequantizeLinear pending (made where a float layer reads it)."""
    from backplane.native.qcnn_layers import _step

    scale, zero, kind = _step(p, layer, at + 1)
    name = layer.inputs[at]
    if p.quantized(name).kind != kind:
        raise Unplannable(f"{layer.name}: a {kind} step of a {p.quantized(name).kind} tensor")
    real = f"{name} (dequantized for {layer.name})"
    p.pending[real] = Pending(name, scale, zero)
    return real


def _requantized(p: Planner, layer: Layer, value: str, at: int) -> None:
    """QuantizeLinear of the float ``value`` to the output's step (inputs ``at``, ``at + 1``)."""
    from backplane.native.qcnn_layers import RANGES, _step

    scale, zero, kind = _step(p, layer, at)
    x = p.real(value)
    y = p.new(layer.outputs[0], x.shape, kind, (scale, zero))
    lo, hi = RANGES[kind]
    p.record("quant", in_=x.offset, out=y.offset, dims=x.dims, moff=p.param(np.array([scale], F32)),
             zy=zero, lo=lo, hi=hi, signed=int(kind == "s8"))


def _float(p: Planner, layer: Layer, op: str, inputs: list[str], **fields: int) -> str:
    """A float record ``op`` of the float ``inputs``; its output's name."""
    values = [p.real(n) for n in inputs]
    if len(values) == 2 and values[0].shape != values[1].shape:
        raise Unplannable(f"{layer.name}: {layer.op_type} of {values[0].shape} and "
                          f"{values[1].shape}")
    shape = fields.pop("shape", values[0].shape)
    name = f"{layer.outputs[0]} (float)"
    y = p.new(name, shape, "f")
    p.record(op, in_=values[0].offset, out=y.offset, dims=values[0].dims,
             **({"in2": values[1].offset} if len(values) == 2 else {}), **fields)
    return name


def binary(op: str):
    def plan(p: Planner, layer: Layer, index: int) -> None:
        a, b = _dequantized(p, layer, 0), _dequantized(p, layer, 3)
        _requantized(p, layer, _float(p, layer, op, [a, b]), 6)
    return plan


def global_average_pool(p: Planner, layer: Layer, index: int) -> None:
    if layer.attrs.get("channels_last", 0):
        raise Unplannable(f"{layer.name}: channels_last")
    real = _dequantized(p, layer, 0)
    x = p.real(real)
    if len(x.shape) != 4:
        raise Unplannable(f"{layer.name}: over {x.shape}")
    _requantized(p, layer, _float(p, layer, "gap_f", [real], shape=(*x.shape[:2], 1, 1)), 3)


def average_pool(p: Planner, layer: Layer, index: int) -> None:
    from backplane.native.qcnn_layers import _pool_geometry

    a = layer.attrs
    if a.get("channels_last", 0) or tuple(a.get("dilations") or (1, 1)) != (1, 1):
        raise Unplannable(f"{layer.name}: channels_last or dilations")
    real = _dequantized(p, layer, 0)
    x = p.real(real)
    if len(x.shape) != 4:
        raise Unplannable(f"{layer.name}: over {x.shape}")
    g = _pool_geometry(layer, x.dims)
    _requantized(p, layer, _float(p, layer, "avgpool_f", [real],
                                  shape=(*x.shape[:2], g["oh"], g["ow"]), **g), 3)


def qgemm(p: Planner, layer: Layer, index: int) -> None:
    """QGemm with a quantized output: A (the plan's 8-bit tensor) by a constant B, an int32 bias."""
    from backplane.native.qcnn_layers import KINDS, _per, _qconv, _step

    a = layer.attrs
    if len(layer.inputs) < 9 or not layer.inputs[7] or a.get("transA", 0) \
            or a.get("alpha", 1.0) != 1.0:
        raise Unplannable(f"{layer.name}: a QGemm with a float output, transA or alpha")
    x_scale, x_zero, _ = _step(p, layer, 1)
    weight, w_scale, w_zero = (p.const(n) for n in layer.inputs[3:6])
    bias = p.const(layer.inputs[6]) if layer.inputs[6] else None
    y_scale, y_zero, y_kind = _step(p, layer, 7)
    if weight is None or w_scale is None or w_zero is None or weight.ndim != 2 \
            or weight.dtype not in KINDS or layer.inputs[6] and bias is None:
        raise Unplannable(f"{layer.name}: a product by no 2-d 8-bit constant")
    kernel = weight if a.get("transB", 0) else weight.T
    oc = kernel.shape[0]
    _qconv(p, layer, layer.inputs[0], (x_scale, x_zero), kernel[:, :, None, None],
           _per(w_zero, oc), _per(w_scale, oc).astype(F32),
           np.zeros(oc) if bias is None else bias.reshape(-1), layer.outputs[0],
           (y_scale, y_zero, y_kind), None)


PLANNERS = {"QLinearAdd": binary("add_f"), "QLinearMul": binary("mul_f"),
            "QLinearGlobalAveragePool": global_average_pool,
            "QLinearAveragePool": average_pool, "QGemm": qgemm}
"""The com.microsoft ops the plan takes, by op type."""
