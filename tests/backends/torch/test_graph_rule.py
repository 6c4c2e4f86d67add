"""A float32 OneDnnGraph taken compiled by rule, untimed (onednn_graph.by_rule; issue 27,
item 5): no build of its layers, no route timed, its outputs CpuRef's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import onednn_graph, patterns  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_traced import _inner_layers  # noqa: E402

DEMO = Path(__file__).resolve().parents[3] / "models" / "mobilenet_v2_w020_c10.onnx"


def _cnn() -> bytes:
    """Conv+Relu, a depthwise Conv+Clip(0, 6), a residual Add, GlobalAveragePool, Flatten, Gemm:
    a static float32 CNN that one OneDnnGraph holds whole."""
    rng = np.random.default_rng(0)

    def const(name: str, shape: tuple[int, ...]) -> object:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    inits = [const("w1", (8, 3, 3, 3)), const("b1", (8,)), const("w2", (8, 1, 3, 3)),
             const("fc", (8, 5)), const("fcb", (5,)),
             numpy_helper.from_array(np.array(0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6, np.float32), "hi")]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=8),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"]),
        helper.make_node("Add", ["r1", "r2"], ["s"]),
        helper.make_node("GlobalAveragePool", ["s"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The routes of every timing made at load (``patterns.taking_turns``)."""
    calls: list[list[str]] = []
    real = patterns.taking_turns

    def spy(made: dict, sample: list) -> dict:
        calls.append(list(made))
        return real(made, sample)

    monkeypatch.setattr(patterns, "taking_turns", spy)
    return calls


def _graph_work(session: InferenceSession) -> object:
    (work,) = [w for layer, w in _inner_layers(session) if layer.op_type == "OneDnnGraph"]
    while hasattr(work, "work"):
        work = work.work
    return work


@pytest.mark.parametrize("model", ["cnn", "demo"])
def test_a_float32_graph_is_taken_compiled_untimed(model: str, timed: list[list[str]]) -> None:
    data = _cnn() if model == "cnn" else str(DEMO)
    # "auto", the default compile mode; the native route (CpuAcc.native) off: oneDNN Graph's rule
    session = InferenceSession(data, backends=[("CpuAcc", {"native": "off"}), "CpuRef"])
    work = _graph_work(session)
    assert work.route == "onednn_graph"  # planned: compiled at the first run (at_first_run)
    shape = [1, 3, 16, 16] if model == "cnn" else [1, 3, 224, 224]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    name = session.get_inputs()[0].name
    got = session.run(None, {name: x})
    assert work.route == "onednn_graph"
    assert work.why == f"onednn_graph: {onednn_graph.RULE}"
    assert timed == []  # neither the graph against its layers nor a convolution's routes
    want = InferenceSession(data, backends=["CpuRef"]).run(None, {name: x})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))


def test_reduced_precision_is_still_timed(timed: list[list[str]]) -> None:
    """A graph computing in bfloat16 (CpuAcc.precision) is not taken by rule: timed at load."""
    options = {"CpuAcc.precision": "bf16", "CpuAcc.route_cache": False}
    session = InferenceSession(_cnn(), backends=["CpuAcc", "CpuRef"],
                               runtime=Runtime(RuntimeOptions(backend_options=options)))
    layers = [layer for layer, _ in _inner_layers(session) if layer.op_type == "OneDnnGraph"]
    if not layers or layers[0].attrs.get("compute") != "bfloat16":
        pytest.skip("no bfloat16 OneDnnGraph on this CPU")
    assert not onednn_graph.by_rule(layers[0])
    assert ["onednn_graph", "layers"] in timed
