"""Models ONNX Runtime saves at its layout optimization levels (ORT_ENABLE_LAYOUT, and
ORT_ENABLE_ALL, its sessions' default): a quantized model's channels-last convolutions and max pools
(com.microsoft QLinearConv with ``channels_last``, NhwcMaxPool) load and match ONNX Runtime; a
float model's NCHWc layout (com.microsoft.nchwc, weights blocked for the saving CPU) is refused
with the fix named. Before, both were refused as unknown ops."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.frontends.onnx import ModelError
from tests.models.test_ort_tools import BACKEND_LISTS, DATA, RandomReader, ort_run, small_cnn

ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")


def saved(source, path, level: str = "ORT_ENABLE_ALL"):
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return path


def pooled_cnn(path):
    """Conv, MaxPool, Relu, Conv: ONNX Runtime's NHWC transformer makes the quantized pool an
    NhwcMaxPool."""
    rng = np.random.default_rng(7)
    weights = {"w1": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
               "b1": rng.standard_normal(8).astype(np.float32) * 0.1,
               "w2": rng.standard_normal((6, 8, 3, 3)).astype(np.float32) * 0.2}
    node = helper.make_node
    graph = helper.make_graph(
        [node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
         node("MaxPool", ["c1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         node("Relu", ["p1"], ["r1"]),
         node("Conv", ["r1", "w2"], ["y"], strides=[2, 2])],
        "pooled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              str(path))
    return path


MODELS = {  # name -> (float model maker, input name, input shape)
    "small_cnn": (small_cnn, "x", (1, 3, 16, 16)),
    "pooled_cnn": (pooled_cnn, "x", (1, 3, 20, 20)),
    "mobilenet_v3": (lambda path: DATA / "tiny_mobilenet_v3.onnx", "input", (1, 3, 64, 64)),
}


def quantized_and_saved(name: str, tmp_path):
    make, input_name, shape = MODELS[name]
    quantized = tmp_path / "q.onnx"
    quantization.quantize_static(make(tmp_path / "f.onnx"), quantized,
                                 RandomReader(input_name, shape), per_channel=name != "small_cnn",
                                 quant_format=quantization.QuantFormat.QOperator)
    feeds = {input_name: np.random.default_rng(2).standard_normal(shape).astype(np.float32)}
    return quantized, saved(quantized, tmp_path / "saved.onnx"), feeds


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("name", MODELS)
def test_channels_last_quantized_model_matches_onnx_runtime(name, backends, tmp_path) -> None:
    if backends != ["CpuRef"]:
        pytest.importorskip("torch")
    quantized, path, feeds = quantized_and_saved(name, tmp_path)
    ops = collections.Counter((n.domain, n.op_type) for n in onnx.load(str(path)).graph.node)
    assert ops[("com.microsoft", "QLinearConv")] >= 2
    if name == "pooled_cnn":
        assert ops[("com.microsoft", "NhwcMaxPool")] == 1
    session = InferenceSession(str(path), backends=backends)
    got, want = session.run(None, feeds), ort_run(quantized, feeds)  # the file before saving
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    if "CpuAcc" in backends:  # ONNX's QLinearConv: CpuAcc's int8 kernels take it
        placed = {p.backend for p in session.report.layers.values() if p.op_type == "QLinearConv"}
        assert placed == {"CpuAcc"}


def test_the_callers_model_is_left_as_it_was(tmp_path) -> None:
    _, path, feeds = quantized_and_saved("pooled_cnn", tmp_path)
    model = onnx.load(str(path))
    before = model.SerializeToString()
    InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    assert model.SerializeToString() == before


@pytest.mark.parametrize("level", ["ORT_ENABLE_LAYOUT", "ORT_ENABLE_ALL"])
def test_nchwc_layout_is_refused_with_the_fix_named(level, tmp_path) -> None:
    if not hasattr(ort.GraphOptimizationLevel, level):
        pytest.skip(f"this ONNX Runtime has no {level}")
    path = saved(small_cnn(tmp_path / "f.onnx"), tmp_path / "saved.onnx", level)
    if not any(n.domain == "com.microsoft.nchwc" for n in onnx.load(str(path)).graph.node):
        pytest.skip("ONNX Runtime wrote no NCHWc layout on this CPU (no AVX2)")
    with pytest.raises(ModelError, match="com.microsoft.nchwc.*ORT_ENABLE_EXTENDED"):
        InferenceSession(str(path), backends=["CpuRef"])
    # the extended level's file is portable and loads
    extended = saved(small_cnn(tmp_path / "f.onnx"), tmp_path / "ext.onnx", "ORT_ENABLE_EXTENDED")
    feeds = {"x": np.ones((1, 3, 16, 16), np.float32)}
    (got,) = InferenceSession(str(extended), backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_allclose(got, ort_run(extended, feeds)[0], rtol=1e-5, atol=1e-6)
