"""ONNX Runtime's quantizer writes its own com.microsoft QuantizeLinear / DequantizeLinear where the
model's opset has not the type it quantizes to (int4 weights below opset 21) or where asked
(``UseQDQContribOps``): they load as ONNX's opset-21 Q/DQ and match ONNX Runtime on every backend.
Before, each such model was refused at import ("unknown op 'DequantizeLinear' in domain
'com.microsoft'")."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.frontends.onnx import ModelError, import_onnx
from tests.models.test_ort_tools import BACKEND_LISTS, RandomReader, ort_run, small_cnn

quantization = pytest.importorskip("onnxruntime.quantization")
QuantType = quantization.QuantType

QDQ = ("QuantizeLinear", "DequantizeLinear")
VARIANTS = {
    "contrib-qdq-per-tensor": (QuantType.QUInt8, QuantType.QInt8, True, False),
    "contrib-qdq-per-channel": (QuantType.QUInt8, QuantType.QInt8, True, True),
    "int4-weights": (QuantType.QUInt8, QuantType.QInt4, False, False),
    "int4-weights-per-channel": (QuantType.QUInt8, QuantType.QInt4, False, True),
}


def quantized(variant: str, tmp_path) -> onnx.ModelProto:
    activations, weights, contrib, per_channel = VARIANTS[variant]
    path = tmp_path / "q.onnx"
    quantization.quantize_static(small_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", (1, 3, 16, 16)),
                                 quant_format=quantization.QuantFormat.QDQ,
                                 activation_type=activations, weight_type=weights,
                                 per_channel=per_channel,
                                 extra_options={"UseQDQContribOps": contrib})
    return path


def _steps(model: onnx.ModelProto) -> float:
    """The output's quantization step: the scale of the last DequantizeLinear's input grid."""
    scales = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    last = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    return float(np.max(scales[last.input[1]]))


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_contrib_qdq_matches_onnx_runtime(variant: str, backends: list[str], tmp_path) -> None:
    if "CpuAcc" in backends or "GpuAcc" in backends:
        pytest.importorskip("torch")
    path = quantized(variant, tmp_path)
    model = onnx.load(str(path))
    written = {(n.domain, n.op_type) for n in model.graph.node if n.op_type in QDQ}
    assert written == {("com.microsoft", "QuantizeLinear"), ("com.microsoft", "DequantizeLinear")}
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    session = InferenceSession(path, backends=backends)
    (got,), (want,) = session.run(None, feeds), ort_run(path, feeds)
    assert got.shape == want.shape and got.dtype == want.dtype
    # Softmax over the dequantized logits: one step of the logits' grid at most, through it
    assert float(np.max(np.abs(got - want))) <= _steps(model)
    placed = {(p.op_type, p.backend) for p in session.report.layers.values()
              if p.op_type in QDQ}
    assert not placed or {backend for _, backend in placed} <= set(backends)


def test_contrib_qdq_are_onnx_ops_at_opset_21(tmp_path) -> None:
    graph = import_onnx(str(quantized("int4-weights", tmp_path)))
    qdq = [layer for layer in graph.layers if layer.op_type in QDQ]
    assert qdq and {(layer.domain, layer.opset) for layer in qdq} == {("", 21)}


def _one_dequantize(**attrs) -> onnx.ModelProto:
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("q", TensorProto.INT8, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                   helper.make_opsetid("com.microsoft", 1)])


def test_contrib_dequantize_runs_on_cpuref() -> None:
    session = InferenceSession(_one_dequantize().SerializeToString(), backends=["CpuRef"])
    (y,) = session.run(None, {"q": np.array([-128, -1, 0, 127], np.int8)})
    np.testing.assert_array_equal(y, np.array([-64, -0.5, 0, 63.5], np.float32))


def test_contrib_dequantize_with_an_unknown_attribute_is_refused() -> None:
    with pytest.raises(ModelError, match=r"block_sizes?|unknown attribute|colour"):
        InferenceSession(_one_dequantize(colour=3).SerializeToString(), backends=["CpuRef"])
