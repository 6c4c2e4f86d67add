"""A QuantizeLinear -> DequantizeLinear pair after a MaxPool of a round trip's result with the same
scale, zero point and type computes nothing (fusion/quantized.py's ``_on_grid``): CpuAcc runs it as
no call at all, bit for bit CpuRef's and ONNX Runtime's, NaN and infinities in the input included;
a pair with other parameters, or after a pool in ceil mode, still rounds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_quantized_fusion import placed  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

SHAPE = (1, 4, 9, 9)


def pool_model(dtype: type, same: bool = True, ceil_mode: int = 0) -> onnx.ModelProto:
    """x -> Q -> DQ -> MaxPool(3x3, stride 2, pads 1) -> Q -> DQ -> Relu, as ONNX Runtime's QDQ
    quantizer writes a ResNet's stem pool."""
    zero = 0 if dtype == np.uint8 else -3
    after = (np.float32(0.031), zero + 1) if not same else (np.float32(0.031), zero)
    inits = [numpy_helper.from_array(np.float32(0.031), "s"),
             numpy_helper.from_array(np.array(zero, dtype), "z"),
             numpy_helper.from_array(after[0], "s2"),
             numpy_helper.from_array(np.array(after[1], dtype), "z2")]
    node = helper.make_node
    nodes = [node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             node("MaxPool", ["xd"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                  pads=[1, 1, 1, 1], ceil_mode=ceil_mode),
             node("QuantizeLinear", ["p", "s2", "z2"], ["pq"]),
             node("DequantizeLinear", ["pq", "s2", "z2"], ["pd"]),
             node("Relu", ["pd"], ["y"])]
    size = (SHAPE[2] + 2 - 3 + (1 if ceil_mode else 0)) // 2 + 1
    return make_model(nodes, [float_input("x", SHAPE)],
                      [float_input("y", [SHAPE[0], SHAPE[1], size, size])], inits)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32) * 3
    x.reshape(-1)[[3, 40, 77]] = [np.nan, np.inf, -np.inf]
    return {"x": x}


def _round_trips(session: InferenceSession) -> list[bool]:
    return [bool(layer.attrs.get("redundant")) for layer in placed(session)
            if layer.op_type == "QuantDequant"]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("compile_mode", ["auto", "onednn_graph", "layers"])
def test_the_pair_after_the_pool_is_no_call_and_exact(dtype: type, compile_mode: str) -> None:
    model = pool_model(dtype)
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": compile_mode})])
    reference = InferenceSession(model, backends=["CpuRef"])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    theirs = ort.InferenceSession(model.SerializeToString(), options,
                                  providers=["CPUExecutionProvider"])
    assert _round_trips(session) == [False, True]
    for seed in range(3):
        feeds = _feeds(seed)
        (got,) = session.run(None, feeds)
        np.testing.assert_array_equal(got, reference.run(None, feeds)[0])
        np.testing.assert_array_equal(got, theirs.run(None, feeds)[0])


@pytest.mark.parametrize(("same", "ceil_mode"), [(False, 0), (True, 1)])
def test_other_parameters_or_ceil_mode_still_round(same: bool, ceil_mode: int) -> None:
    model = pool_model(np.uint8, same, ceil_mode)
    session = InferenceSession(model, backends=["CpuAcc"])
    assert _round_trips(session) == [False, False]
    feeds = _feeds(4)
    (got,) = session.run(None, feeds)
    np.testing.assert_array_equal(got, InferenceSession(model, backends=["CpuRef"]).run(
        None, feeds)[0])


def head_model() -> onnx.ModelProto:
    """x -> Q -> DQ -> GlobalAveragePool -> Q -> DQ -> Flatten -> Q -> DQ -> Gemm, as ONNX
    Runtime's QDQ quantizer writes a classifier's head (the small tier's resnet_qdq_ort17): the
    Flatten's pair has the pool's scale and zero point."""
    inits = [numpy_helper.from_array(np.float32(0.031), "s"),
             numpy_helper.from_array(np.array(3, np.uint8), "z"),
             numpy_helper.from_array(np.float32(0.007), "s2"),
             numpy_helper.from_array(np.array(128, np.uint8), "z2"),
             numpy_helper.from_array(np.random.default_rng(0).standard_normal(
                 (5, SHAPE[1])).astype(np.float32), "w")]
    node = helper.make_node
    nodes = [node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             node("GlobalAveragePool", ["xd"], ["g"]),
             node("QuantizeLinear", ["g", "s2", "z2"], ["gq"]),
             node("DequantizeLinear", ["gq", "s2", "z2"], ["gd"]),
             node("Flatten", ["gd"], ["f"]),
             node("QuantizeLinear", ["f", "s2", "z2"], ["fq"]),
             node("DequantizeLinear", ["fq", "s2", "z2"], ["fd"]),
             node("Gemm", ["fd", "w"], ["y"], transB=1)]
    return make_model(nodes, [float_input("x", SHAPE)], [float_input("y", [SHAPE[0], 5])], inits)


@pytest.mark.parametrize("compile_mode", ["auto", "onednn_graph", "layers"])
def test_the_pair_after_a_flatten_of_a_round_trip_is_no_call_and_exact(compile_mode: str) -> None:
    model = head_model()
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": compile_mode})])
    reference = InferenceSession(model, backends=["CpuRef"])
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _round_trips(session) == [False, False, True]
    for seed in range(3):
        feeds = _feeds(seed)
        (got,) = session.run(None, feeds)
        for expected in (reference.run(None, feeds)[0], theirs.run(None, feeds)[0]):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
