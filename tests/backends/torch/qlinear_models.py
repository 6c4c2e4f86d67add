"""QOperator test models (QLinearConv, QLinearMatMul) and the one-step check of their fused
layers, shared by test_qlinear_fusion, test_quantized_fusion and test_qlinear_calls."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tests.conftest import float_input, make_model

RNG = np.random.default_rng(29)


def _init(name: str, value: np.ndarray | float | int, dtype: type = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def qlinear_conv_model(quantized_io: bool, group: int, dtype: type) -> onnx.ModelProto:
    """[x -> Q ->] QLinearConv (uint8 weights with per-channel zero points, per-channel scales,
    an int32 bias, multiplier exactly 1/2 for channel 0) [-> DQ -> Relu]."""
    info = np.iinfo(dtype)
    channels, per_group = 6, 6 // group
    w = RNG.integers(0, 256, (channels, per_group, 3, 3)).astype(np.uint8)
    w_scale = RNG.uniform(0.3, 0.9, channels).astype(np.float32)
    w_scale[0] = 0.5  # x_scale 1, y_scale 1: acc * 1/2, a tie at every odd sum
    inits = [_init("xs", 1.0), _init("xz", info.min + 77, dtype), _init("w", w, np.uint8),
             _init("ws", w_scale), _init("wz", RNG.integers(100, 150, channels), np.uint8),
             _init("ys", 1.0), _init("yz", info.min + 90, dtype),
             _init("b", RNG.integers(-400, 400, channels), np.int32)]
    conv = helper.make_node("QLinearConv", ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                            ["yq"], pads=[1, 0, 1, 2], strides=[1, 2], group=group)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if not quantized_io:
        graph_in = helper.make_tensor_value_info("xq", elem, [1, channels, 7, 8])
        graph_out = helper.make_tensor_value_info("yq", elem, None)
        return make_model([conv], [graph_in], [graph_out], inits)
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), conv,
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["yd"]),
             helper.make_node("Relu", ["yd"], ["y"])]
    return make_model(nodes, [float_input("x", [1, channels, 7, 8])], [float_input("y", None)],
                      inits)


def qlinear_matmul_model(per_column: bool) -> onnx.ModelProto:
    """x -> Q -> QLinearMatMul(int8 weight) -> DQ -> Add(bias): ONNX Runtime's QOperator Gemm."""
    k, n = 24, 5
    b_scale = RNG.uniform(0.004, 0.01, n if per_column else ()).astype(np.float32)
    b_zero = RNG.integers(-5, 5, n if per_column else ()).astype(np.int8)
    inits = [_init("as", 0.03), _init("az", 128, np.uint8),
             _init("b", RNG.integers(-127, 128, (k, n)), np.int8), _init("bs", b_scale),
             _init("bz", b_zero, np.int8), _init("ys", 0.004), _init("yz", 110, np.uint8),
             _init("bias", RNG.standard_normal(n))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "as", "az"], ["xq"]),
             helper.make_node("QLinearMatMul", ["xq", "as", "az", "b", "bs", "bz", "ys", "yz"],
                              ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["yd"]),
             helper.make_node("Add", ["yd", "bias"], ["y"])]
    return make_model(nodes, [float_input("x", [2, 3, k])], [float_input("y", [2, 3, n])], inits)


def within_a_step(got: np.ndarray, want: np.ndarray, step: float) -> None:
    """At most one step apart, and on few values (float32 requantization: a value within a
    float32 rounding of a half step may round the other way), NaN where ``want`` has NaN."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    off = np.abs(got.astype(np.float64) - want)[~np.isnan(want)]
    assert off.max(initial=0) <= step * 1.001 and np.mean(off > 0) < 0.05
