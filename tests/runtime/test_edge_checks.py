"""Backends checked at their edge (issue 32, item 7): a plugin's kernel that returns the wrong
arity, dtype, rank or size fails naming the backend and the layer, not the next layer; a support
answer of the wrong type, or a query that raises, is a refusal with the reason, and the layer
goes to the next backend."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import Backend, ExecutionError, InferenceSession, registry
from backplane.runtime import edge_checks

X = np.array([[-1.0, 0.5, 2.0]], np.float32)


def _model() -> bytes:
    """y = Relu(x); z = y + 1 (the next layer, which would be blamed)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]),
         helper.make_node("Add", ["y", "one"], ["z"])], "edge",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _plugin(kernel):
    class Plugin(Backend):
        id = "EdgePlugin"
        KERNELS = {"Relu": {6: kernel}}

    return Plugin


BAD_KERNELS = {
    "arity": (lambda x: (np.maximum(x, 0), np.maximum(x, 0)), "returned 2 outputs"),
    "not a tuple": (lambda x: np.maximum(x, 0), "returned ndarray outputs"),
    "dtype": (lambda x: (np.maximum(x, 0).astype(np.float64),), "of dtype float64"),
    "rank": (lambda x: (np.maximum(x, 0).reshape(-1),), "rank 1"),
    "size": (lambda x: (np.maximum(x, 0)[:, :2],), "of shape [1, 2]"),
}


@pytest.mark.parametrize("case", sorted(BAD_KERNELS))
def test_a_plugin_kernel_that_breaks_its_layer_is_named(case: str) -> None:
    kernel, message = BAD_KERNELS[case]
    plugin = _plugin(kernel)
    with registry.temporarily(plugin.id, plugin):
        session = InferenceSession(_model(), providers=[plugin.id, "CpuRef"])
        assert session.report.counts()[plugin.id] == 1
        with pytest.raises(ExecutionError) as caught:
            session.run(None, {"x": X})
    text = str(caught.value)
    assert "EdgePlugin" in text and "Relu" in text and message in text, text
    assert isinstance(caught.value.__cause__, edge_checks.KernelContractError)


def test_a_plugin_kernel_that_keeps_its_contract_runs() -> None:
    plugin = _plugin(lambda x: (np.maximum(x, 0),))
    with registry.temporarily(plugin.id, plugin):
        session = InferenceSession(_model(), providers=[plugin.id, "CpuRef"])
        (z,) = session.run(None, {"x": X})
    np.testing.assert_array_equal(z, np.maximum(X, 0) + 1)


def test_backplanes_own_backends_are_not_wrapped() -> None:
    session = InferenceSession(_model(), providers=["CpuRef"])
    loaded = session.runtime.network(session.network_id)
    assert not edge_checks.is_plugin(loaded.network.backends["CpuRef"])
    assert all(step.workload.__qualname__ != "_checker.<locals>.run" for step in loaded.steps)


class WrongAnswer(Backend):
    id = "WrongAnswer"
    KERNELS = {"Relu": {6: lambda x: (np.maximum(x, 0),)}}
    answer: object = True

    def is_layer_supported(self, layer, inputs, outputs):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer, reason", [
    (True, "returned True (bool); it must return a backplane.Support"),
    (None, "returned None (NoneType)"),
    (KeyError("shape"), "raised KeyError: 'shape'"),
])
def test_a_support_answer_of_the_wrong_type_is_a_named_refusal(answer, reason) -> None:
    WrongAnswer.answer = answer
    with registry.temporarily(WrongAnswer.id, WrongAnswer):
        session = InferenceSession(_model(), providers=[WrongAnswer.id, "CpuRef"])
    assert session.report.counts() == {"CpuRef": 2}
    refusals = [r for p in session.report.layers.values() for r in p.refusals]
    assert refusals and all(b == WrongAnswer.id and reason in r for b, r in refusals), refusals
    (z,) = session.run(None, {"x": X})
    np.testing.assert_array_equal(z, np.maximum(X, 0) + 1)
