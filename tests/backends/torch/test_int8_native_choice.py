"""The native int8 plan against torch's traced int8: taken whatever its size, where torch's int8
kernels are exact (a VNNI CPU: the plan measured faster there at every size since its byte glue
and threads, fusion/int8_native.py) and where they saturate; CpuRef's values within the steps the
requantizations allow."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import int8_exact  # noqa: E402
from backplane.native import build  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def _depthwise_model(size: int):
    """QuantizeLinear -> a depthwise 3x3 QLinearConv of 64 channels -> a 1x1 one to 64 ->
    DequantizeLinear at size x size: 64 * 73 multiply-adds a pixel."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.float32(0.03), "s"),
             numpy_helper.from_array(np.uint8(128), "z"),
             numpy_helper.from_array(rng.integers(-50, 50, (64, 1, 3, 3)).astype(np.int8), "dw"),
             numpy_helper.from_array(rng.integers(-50, 50, (64, 64, 1, 1)).astype(np.int8), "pw"),
             numpy_helper.from_array(np.float32(0.01), "ws"),
             numpy_helper.from_array(np.int8(0), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "s", "z", "dw", "ws", "wz", "s", "z"], ["d"],
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=64),
             helper.make_node("QLinearConv", ["d", "s", "z", "pw", "ws", "wz", "s", "z"], ["p"],
                              kernel_shape=[1, 1]),
             helper.make_node("DequantizeLinear", ["p", "s", "z"], ["y"])]
    shape = [1, 64, size, size]
    return make_model(nodes, [float_input("x", shape)], [float_input("y", shape)], inits,
                      opset=13)


@needs_compiler
@pytest.mark.parametrize("size, exact", [(128, True), (128, False), (16, True)])
def test_a_depthwise_plan_of_any_size_is_taken_natively(size, exact, monkeypatch):
    monkeypatch.setattr(int8_exact, "exact_kernels", lambda: exact)
    session = InferenceSession(_depthwise_model(size), backends=["CpuAcc", "CpuRef"],
                               input_shapes={"x": [1, 64, size, size]})
    loaded = session.runtime.network(session.network_id)
    ops = [layer.op_type for layer in loaded.layers if layer.backend == "CpuAcc"]
    assert "NativeInt8" in ops
    x = np.random.default_rng(4).standard_normal((1, 64, size, size)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(_depthwise_model(size), backends=["CpuRef"]).run(None, {"x": x})
    # CpuRef requantizes in float64: a step's difference in the depthwise output, carried
    # through the 1x1, is within two at the end
    assert np.abs(got - want).max() <= 2 * 0.03 * 1.0001
