"""NaN and infinities through the OpenVINO backend, against CpuRef (ONNX Runtime where the two
differ): each op OpenVINO takes, fed NaN, +inf, -inf and ordinary values, and tiny_mobilenet_v3 fed
NaN. Finite inputs run the model OpenVINO compiled first; the NaN-keeping one is compiled only when
an input holds NaN or an infinity. Skipped where OpenVINO is not installed."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("openvino")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402

F = TensorProto.FLOAT
DATA = Path(__file__).resolve().parents[2] / "data"
X = np.array([np.nan, np.inf, -np.inf, -2.5, -0.5, 0.0, 0.5, 3.0, np.nan, -np.inf, 7.0, -7.0,
              np.nan, 1.0, -1.0, 2.0], np.float32).reshape(1, 1, 4, 4)
"""Rows: NaN with both infinities; finite only; NaN with -inf; NaN with finite values."""


def const(name: str, value: object) -> object:
    return numpy_helper.from_array(np.array(value, np.float32), name)


UNARY = ["Relu", "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "Abs", "Neg", "Exp", "Log", "Sqrt",
         "Softplus", "Softsign", "Elu", "Selu", "LeakyRelu", "Celu", "Erf", "Floor", "Ceil",
         "Round", "Sign", "Sin", "Cos", "Reciprocal", "Identity", "ThresholdedRelu", "Shrink",
         "Softmax", "LogSoftmax", "GlobalAveragePool"]
CASES: dict[str, tuple[list, list]] = {op: ([helper.make_node(op, ["x"], ["y"])], []) for op in UNARY}
CASES.update({
    "Clip": ([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], [const("lo", -1), const("hi", 1)]),
    "Clip6": ([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], [const("lo", 0), const("hi", 6)]),
    "Max": ([helper.make_node("Max", ["x", "z"], ["y"])], [const("z", 0)]),
    "Min": ([helper.make_node("Min", ["x", "z"], ["y"])], [const("z", 0)]),
    "PRelu": ([helper.make_node("PRelu", ["x", "z"], ["y"])], [const("z", [0.1])]),
    "AveragePool": ([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2])], []),
    "ReduceMax": ([helper.make_node("ReduceMax", ["x", "axes"], ["y"])],
                  [numpy_helper.from_array(np.array([3], np.int64), "axes")]),
    "ReduceMin": ([helper.make_node("ReduceMin", ["x", "axes"], ["y"])],
                  [numpy_helper.from_array(np.array([3], np.int64), "axes")]),
    "ReduceSum": ([helper.make_node("ReduceSum", ["x"], ["y"])], []),
    "ReduceMean": ([helper.make_node("ReduceMean", ["x", "axes"], ["y"])],
                   [numpy_helper.from_array(np.array([3], np.int64), "axes")]),
    "Greater": ([helper.make_node("Greater", ["x", "z"], ["b"]),
                 helper.make_node("Cast", ["b"], ["y"], to=F)], [const("z", 0)]),
    "GreaterOrEqual": ([helper.make_node("GreaterOrEqual", ["x", "z"], ["b"]),
                        helper.make_node("Cast", ["b"], ["y"], to=F)], [const("z", 0)]),
    "Less": ([helper.make_node("Less", ["x", "z"], ["b"]),
              helper.make_node("Cast", ["b"], ["y"], to=F)], [const("z", 0)]),
    "Where": ([helper.make_node("Greater", ["x", "z"], ["b"]),
               helper.make_node("Where", ["b", "x", "z"], ["y"])], [const("z", 0)]),
    "Conv": ([helper.make_node("Conv", ["x", "w"], ["y"])], [const("w", np.ones((1, 1, 2, 2)))]),
    "MatMul": ([helper.make_node("MatMul", ["x", "w"], ["y"])], [const("w", np.ones((4, 4)))]),
    "Conv+Relu": ([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
                  [const("w", np.ones((1, 1, 1, 1)))]),
    "LayerNorm": ([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
                  [const("s", np.ones(4)), const("b", np.zeros(4))]),
    "Div": ([helper.make_node("Div", ["x", "z"], ["y"])], [const("z", 0)]),
    "Pow": ([helper.make_node("Pow", ["x", "z"], ["y"])], [const("z", 2)]),
    "MaxPool": ([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2])], []),
    "GlobalMaxPool": ([helper.make_node("GlobalMaxPool", ["x"], ["y"])], []),
    "Resize": ([helper.make_node("Resize", ["x", "", "s"], ["y"], mode="linear")],
               [const("s", [1, 1, 2, 2])]),
})
LIKE_ONNX_RUNTIME = {"Resize"}
"""Compared with ONNX Runtime: OpenVINO's linear Resize reads NaN through its zero-weight taps as
ONNX Runtime's does (CpuRef only through the taps it weighs). MaxPool and GlobalMaxPool keep every
NaN a window reads, as CpuRef (nan_forms._pool; ONNX Runtime drops some)."""


def model_of(name: str) -> bytes:
    nodes, initializers = CASES[name]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 1, 4, 4])],
                              [helper.make_tensor_value_info("y", F, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]) \
        .SerializeToString()


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """NaN where ``want`` has NaN, the same infinities, the finite values within 1e-5."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{got} != {want}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_and_infinities_as_cpuref(name: str) -> None:
    model = model_of(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # CpuRef's NumPy on NaN and inf
        if name in LIKE_ONNX_RUNTIME:
            want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]) \
                .run(None, {"x": X})[0]
        else:
            want = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": X})[0]
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert_same(session.run(None, {"x": X})[0], want)


def test_tiny_mobilenet_v3_gives_nan_for_nan() -> None:
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    session = InferenceSession(path, backends=["OpenVINO", "CpuRef"])
    (workload,) = [step.workload for step in session.runtime.network(session.network_id).steps]
    finite = session.run(None, feeds)[0]
    assert np.isfinite(finite).all() and workload._nan is None  # not compiled for finite inputs
    for value in (np.nan, np.inf):
        spoiled = {k: np.full_like(v, value) for k, v in feeds.items()}
        assert np.isnan(session.run(None, spoiled)[0]).all()
    one = {k: v.copy() for k, v in feeds.items()}
    next(iter(one.values())).reshape(-1)[100] = np.nan  # one NaN pixel: the same NaN as CpuRef's
    want = InferenceSession(path, backends=["CpuRef"]).run(None, one)[0]
    assert_same(session.run(None, one)[0], want)
    np.testing.assert_array_equal(session.run(None, feeds)[0], finite)  # the first model again


CORPUS = DATA / "corpus"
NAN_CORPUS = ["mobilenet_dw_dyn18", "mobilenet_fp16_ts17", "resnet_basic_ts16", "unet_resize_ts13",
              "lstm_bi2_ts14", "audio_conv1d_dyn19"]


@pytest.mark.parametrize("name", NAN_CORPUS)
def test_corpus_models_keep_nan_where_cpuref_does(name: str) -> None:
    """Every 7th value of the float input NaN: the outputs NaN where CpuRef's are, and close
    elsewhere."""
    import json

    entry = json.loads((CORPUS / "manifest.json").read_text())[name]
    path = CORPUS / entry["file"]
    feeds = {k: v.copy() for k, v in np.load(CORPUS / entry["inputs_files"][0]).items()}
    floats = [v for v in feeds.values() if v.dtype.kind == "f"]
    floats[0].reshape(-1)[::7] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    session = InferenceSession(path, backends=["OpenVINO", "CpuRef"])
    assert "OpenVINO" in session.report.counts()
    for got, expected in zip(session.run(None, feeds), want):
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        scale = max(float(np.nanmax(np.abs(expected), initial=0.0)), 1.0)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3 * scale, equal_nan=True)
