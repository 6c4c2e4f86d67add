"""A Traced layer's linears and ReLUs (issue 27, the corpus's transformers): its oneDNN products
read weights packed once (``prepacked.TraceInputs``: inputs of the frozen graph, which holds no
oneDNN tensor as a constant), and its ReLU is torch's, not the ELU traced for oneDNN Graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import prepacked, threads  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(11)


def _feed_forward(rows: int = 32, d: int = 256, hidden: int = 512) -> onnx.ModelProto:
    """x (1, rows, d) -> MatMul + bias -> Relu -> MatMul + bias -> Add x -> LayerNormalization: a
    transformer's feed forward as onnx.helper writes it (both weights 2^17 values: oneDNN's
    product first); three layers fused, a trace's least."""
    def weight(shape, name):
        return numpy_helper.from_array((RNG.standard_normal(shape) * 0.05).astype(np.float32), name)
    inits = [weight((d, hidden), "w1"), weight((hidden,), "b1"), weight((hidden, d), "w2"),
             weight((d,), "b2"), weight((d,), "scale"), weight((d,), "shift")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]),
             helper.make_node("Add", ["m1", "b1"], ["a1"]), helper.make_node("Relu", ["a1"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["a2"]),
             helper.make_node("Add", ["a2", "x"], ["z"]),
             helper.make_node("LayerNormalization", ["z", "scale", "shift"], ["y"], axis=-1)]
    return make_model(nodes, [float_input("x", [1, rows, d])], [float_input("y", [1, rows, d])],
                      inits, opset=17)


class _Block(torch.nn.Module):
    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


def _exported(tmp_path) -> onnx.ModelProto:
    """The same block exported by torch.onnx (TorchScript's exporter, opset 14)."""
    path = tmp_path / "block.onnx"
    torch.onnx.export(_Block().eval(), (torch.randn(1, 32, 256),), str(path), opset_version=14,
                      input_names=["x"], output_names=["y"], dynamo=False)
    return onnx.load(str(path))


def _traced(model: onnx.ModelProto, monkeypatch) -> tuple[InferenceSession, object]:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    session = InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, "CpuAcc.compile": "onednn_graph"})))
    loaded = session.runtime.network(session.network_id)
    (workload,) = [getattr(step.workload, "work", step.workload)
                   for step, layer in zip(loaded.steps, loaded.layers) if layer.op_type == "Traced"]
    return session, workload


def _against_cpuref(session: InferenceSession, model: onnx.ModelProto) -> None:
    x = RNG.standard_normal((1, 32, 256)).astype(np.float32)
    x[0, 2, 5] = np.nan  # that row NaN out, through both products
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[0, 2]).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("source", ["helper", "torch.onnx"])
def test_the_trace_takes_packed_weights_as_inputs(source, monkeypatch, tmp_path) -> None:
    model = _feed_forward() if source == "helper" else _exported(tmp_path)
    session, workload = _traced(model, monkeypatch)
    graph = workload.module.graph
    assert [w.is_mkldnn for w in workload.weights] == [True, True]
    assert len(list(graph.inputs())) == 1 + 1 + 2  # self, x, the two packed weights
    products = [n for n in graph.nodes() if n.kind() == "mkldnn::_linear_pointwise"]
    assert len(products) == 2 and "aten::linear" not in str(graph)
    assert all(p.inputsAt(1).node().kind() == "prim::Param" for p in products)  # not constants
    _against_cpuref(session, model)


def test_a_traced_relu_is_torch_s(monkeypatch) -> None:
    """A trace without oneDNN Graph's fuser holds aten::relu (NaN kept: torch's relu), not the
    ELU with alpha 0 spelled for the fuser, which computes an exp per value."""
    model = _feed_forward()
    session, workload = _traced(model, monkeypatch)
    kinds = [n.kind() for n in workload.module.graph.nodes()]
    assert "aten::relu" in kinds and "aten::elu" not in kinds
    _against_cpuref(session, model)


def test_trace_inputs_pack_each_weight_once() -> None:
    inputs = prepacked.TraceInputs()
    w, other = torch.randn(64, 32), torch.randn(64, 32)
    first = inputs.weight(w, 16)
    assert inputs.weight(w, 16) is first and first.is_mkldnn
    assert inputs.weight(other, 16) is not first
    assert inputs.packed == [first, inputs.weight(other, 16)]
    assert torch.allclose(torch.ops.mkldnn._linear_pointwise(torch.ones(16, 32), first, None,
                                                             "none", [], None),
                          torch.ones(16, 32) @ w.T, atol=1e-5)
