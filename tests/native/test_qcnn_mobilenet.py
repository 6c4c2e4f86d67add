"""A mobilenet-type int8 model on the native int8 route: the corpus's mobilenet_dw_ts13 quantized
by ONNX Runtime's own quantizer (QDQ, uint8 activations, int8 weights per channel), its
hard-swishes written out (DequantizeLinear -> HardSigmoid -> QuantizeLinear, then a QDQ Mul), a
grouped convolution and residual Adds. Planned whole (HardSigmoid and Mul as float glue, the
grouped convolution group by group); against the graph as written (ONNX Runtime unoptimized,
CpuRef) bit for bit on these inputs, and within one step of ONNX Runtime's fused QLinearMul /
QLinearAdd (which round otherwise: 41 of 2048 features a step apart on one input). The same
model and resnet_basic_dyn21 (a free batch dimension) in the QOperator format: QLinearAdd,
QLinearMul, QLinearGlobalAveragePool, QLinearAveragePool, MaxPool of bytes and QGemm too; against
CpuRef bit for bit, and ONNX Runtime with its QLinearConv weights moved to uint8 (its u8 x u8
products exact without VNNI; QGemm has no such twin: its logits within a step where its int8
products are exact, a VNNI CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from tests.ort_int8 import ort_int8_exact, with_uint8_steps, with_uint8_weights  # noqa: E402

CORPUS = "tests/data/corpus"


class _Feeds(quantization.CalibrationDataReader):
    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.left = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.left, None)


def _quantize(name: str, path: str, fmt: str) -> list[dict[str, np.ndarray]]:
    """``name`` quantized by ONNX Runtime into ``path``; four inputs to run it on."""
    feeds = [dict(np.load(f"{CORPUS}/{name}.s{i}.npz")) for i in (0, 1)]
    rng = np.random.default_rng(0)
    shape = feeds[0]["input"].shape
    feeds += [{"input": rng.standard_normal(shape).astype(np.float32)} for _ in range(3)]
    source = str(Path(path).with_name(f"{name}.float.onnx"))  # the quantizer writes a file
    shutil.copyfile(f"{CORPUS}/{name}.onnx", source)  # beside its input: not in the corpus
    quantization.quantize_static(source, path, _Feeds(feeds),
                                 quant_format=getattr(quantization.QuantFormat, fmt),
                                 per_channel=True,
                                 activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    return [feeds[0]] + [{"input": (rng.standard_normal(shape) * 1.5).astype(np.float32)}
                         for _ in range(3)]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> tuple[str, list[dict[str, np.ndarray]]]:
    path = str(tmp_path_factory.mktemp("int8") / "mobilenet_dw_qdq.onnx")
    return path, _quantize("mobilenet_dw_ts13", path, "QDQ")


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimized: bool):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = with_uint8_steps(model) if optimized else model
    return ort.InferenceSession(source.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_a_quantized_mobilenet_runs_whole_natively(quantized):
    path, inputs = quantized
    shapes = {"input": list(inputs[0]["input"].shape)}
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                               provider_options=[{"CpuAcc.native": "auto"}, {}])
    loaded = session.runtime.network(session.network_id)
    assert [lay.op_type for lay in loaded.layers if lay.backend == "CpuAcc"] == ["NativeInt8"]
    model = onnx.load(path)
    step = float(onnx.numpy_helper.to_array(next(
        t for t in model.graph.initializer if t.name == "features_scale")))
    reference = InferenceSession(path, backends=["CpuRef"])
    for feeds in inputs:
        got = session.run(None, feeds)
        for g, w, r in zip(got, _ort(model, feeds, optimized=False), reference.run(None, feeds)):
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(g, r)
        logits, features = _ort(model, feeds, optimized=True)
        assert np.abs(got[1] - features).max() <= step * 1.0001
        assert np.abs(got[0] - logits).max() <= 0.05 * np.abs(logits).max()


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("name", ["mobilenet_dw_ts13", "resnet_basic_dyn21"])
def test_a_qoperator_model_with_contrib_ops_runs_whole_natively(name, tmp_path):
    path = str(tmp_path / f"{name}_qop.onnx")
    inputs = _quantize(name, path, "QOperator")
    model = onnx.load(path)
    assert {"QLinearAdd", "QGemm"} <= {n.op_type for n in model.graph.node}
    shapes = {"input": list(inputs[0]["input"].shape)}
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                               provider_options=[{"CpuAcc.native": "auto"}, {}])
    loaded = session.runtime.network(session.network_id)
    assert [lay.op_type for lay in loaded.layers if lay.backend == "CpuAcc"] == ["NativeInt8"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    twin = with_uint8_weights(model, ops={"QLinearConv": [(3, 5)]})
    exact = ort.InferenceSession(twin.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
    steps = {t.name: float(np.max(onnx.numpy_helper.to_array(t))) for t in model.graph.initializer
             if t.name.endswith("_scale")}
    reference = InferenceSession(path, backends=["CpuRef"])
    for feeds in inputs:
        got = session.run(None, feeds)
        for g, r in zip(got, reference.run(None, feeds)):
            np.testing.assert_array_equal(g, r)
        logits, features = exact.run(None, feeds)
        np.testing.assert_array_equal(got[1], features)
        if ort_int8_exact():  # else its QGemm's u8 x s8 pairs saturate (3 steps off, seen here)
            assert np.abs(got[0] - logits).max() <= steps["logits_scale"] * 1.0001
