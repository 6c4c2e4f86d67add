"""An output a run returns is the caller's alone (issue 32, item 2): it shares no memory with a
constant of the session, the caller's inputs, another output or a buffer a backend writes again.

Every op whose kernels may return a view is run on an input and on a constant, on every installed
backend; the caller then writes into the outputs and into its input, and the next run and the
outputs already returned must be unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import Backend, InferenceSession, registry
from backplane.runtime import ownership



def installed_backend_lists() -> list[list[str]]:
    lists = [["CpuRef"]]
    for backend in ("CpuAcc", "OpenVINO", "GpuAcc"):
        try:
            available = bool(registry.create(backend).availability())
        except Exception:  # noqa: BLE001  # not installed here
            available = False
        if available:
            lists.append([backend, "CpuRef"])
    return lists


X = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
B = np.arange(100, 112, dtype=np.float32).reshape(3, 4)

# op -> (extra constant inputs, attributes, output shape): y = op(x, ...) for x of shape (3, 4)
ALIASING = {
    "Identity": ([], {}, [3, 4]),
    "Reshape": ([np.array([4, 3], np.int64)], {}, [4, 3]),
    "Flatten": ([], {"axis": 1}, [3, 4]),
    "Transpose": ([], {"perm": [1, 0]}, [4, 3]),
    "Slice": ([np.array([1], np.int64), np.array([3], np.int64)], {}, [2, 4]),
    "Unsqueeze": ([np.array([0], np.int64)], {}, [1, 3, 4]),
    "Squeeze": (None, {}, [3, 4]),  # of an Unsqueeze: built below
    "Split": ([np.array([1, 3], np.int64)], {}, [3, 1]),
    "Dropout": ([], {}, [3, 4]),
    "Expand": ([np.array([3, 4], np.int64)], {}, [3, 4]),
    "Cast": ([], {"to": TensorProto.FLOAT}, [3, 4]),
    "Concat": ([], {"axis": 0}, [3, 4]),
    "Tile": ([np.array([1, 1], np.int64)], {}, [3, 4]),
    "Max": ([], {}, [3, 4]),
    "Sum": ([], {}, [3, 4]),
}


def _model(op: str, source: str) -> onnx.ModelProto:
    """y = op(v) where v is the input x (source "input") or the constant b ("constant"), plus
    z = x + b, an output computed from both, which later runs must keep giving."""
    extras, attrs, shape = ALIASING[op]
    initializers = [numpy_helper.from_array(B, "b")]
    nodes = [helper.make_node("Add", ["x", "b"], ["z"])]
    value = "x" if source == "input" else "b"
    if op == "Squeeze":
        initializers.append(numpy_helper.from_array(np.array([0], np.int64), "axes"))
        nodes.append(helper.make_node("Unsqueeze", [value, "axes"], ["u"]))
        nodes.append(helper.make_node("Squeeze", ["u", "axes"], ["y"]))
    else:
        names = []
        for i, extra in enumerate(extras):
            initializers.append(numpy_helper.from_array(extra, f"c{i}"))
            names.append(f"c{i}")
        outputs = ["y", "y2"] if op == "Split" else ["y"]
        if op == "Split":
            attrs = {"axis": 1}
        nodes.append(helper.make_node(op, [value, *names], outputs, **attrs))
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 4]),
               helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    graph = helper.make_graph(nodes, "aliasing", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [3, 4])], outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _session(model: onnx.ModelProto, backends: list[str]) -> InferenceSession:
    return InferenceSession(model.SerializeToString(), providers=backends)


@pytest.mark.parametrize("backends", installed_backend_lists(), ids=",".join)
@pytest.mark.parametrize("source", ["input", "constant"])
@pytest.mark.parametrize("op", sorted(ALIASING))
def test_outputs_share_no_memory_with_inputs_or_constants(op: str, source: str,
                                                          backends: list[str]) -> None:
    session = _session(_model(op, source), backends)
    x = X.copy()
    z, y = session.run(None, {"x": x})
    expected_z, expected_y = z.copy(), y.copy()
    assert not np.shares_memory(y, x) and not np.shares_memory(z, x)
    assert not np.shares_memory(y, z)
    y[...] = -1.0  # the caller's to write
    z[...] = -1.0
    x[...] = 7.0  # a serving loop refills its input buffer
    z2, y2 = session.run(None, {"x": X.copy()})
    np.testing.assert_array_equal(z2, expected_z)
    np.testing.assert_array_equal(y2, expected_y)
    again = X.copy()
    z3, y3 = session.run(None, {"x": again})
    again[...] = 0.0
    np.testing.assert_array_equal(y3, expected_y)  # returned before the input was refilled
    assert not np.shares_memory(y2, y3) and not np.shares_memory(z2, z3)


@pytest.mark.parametrize("backends", installed_backend_lists(), ids=",".join)
def test_an_output_that_is_an_initializer_is_a_copy(backends: list[str]) -> None:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["z"])], "constant_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 4])],
        [numpy_helper.from_array(B, "b")])
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                       backends)
    _, b = session.run(None, {"x": X})
    b[...] = 12345.0
    z, b2 = session.run(None, {"x": X})
    np.testing.assert_array_equal(z, X + B)
    np.testing.assert_array_equal(b2, B)


class ReusingBackend(Backend):
    """A plugin whose Relu writes into one buffer of its own and returns it at every run (as a
    library with preallocated output tensors does)."""

    id = "ReusingRelu"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = np.empty((3, 4), np.float32)
        self.KERNELS = {"Relu": {6: self._relu}}

    def _relu(self, x: np.ndarray) -> tuple[np.ndarray]:
        np.maximum(x, 0, out=self.buffer)
        return (self.buffer,)


def test_a_buffer_a_backend_writes_again_is_not_returned() -> None:
    with registry.temporarily(ReusingBackend.id, ReusingBackend):
        graph = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])], "reuse",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
        session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                           [ReusingBackend.id, "CpuRef"])
        assert session.report.counts() == {ReusingBackend.id: 1}
        (first,) = session.run(None, {"x": X})
        (second,) = session.run(None, {"x": -X})
    np.testing.assert_array_equal(first, X)  # not overwritten by the second run
    np.testing.assert_array_equal(second, np.zeros_like(X))


def test_fresh_outputs_are_not_copied() -> None:
    """The check copies only what is held elsewhere: a run's own arrays pass through."""
    made = [np.ones(3), np.ones(4)[1:]]
    kept = ownership.owned(made)
    assert kept[0] is made[0] and kept[1] is made[1]
    torch = pytest.importorskip("torch")
    made = [torch.ones(3).numpy(), torch.ones(4)[1:].numpy()]
    kept = ownership.owned(made)
    assert kept[0] is made[0]


def test_held_memory_is_copied() -> None:
    constant = np.ones(4)
    inputs = [np.ones(4)]
    results = ownership.owned([constant[1:], inputs[0], [constant]], inputs)
    assert not np.shares_memory(results[0], constant)
    assert not np.shares_memory(results[1], inputs[0])
    assert not np.shares_memory(results[2][0], constant)
    torch = pytest.importorskip("torch")
    weight = np.ones(6, np.float32)
    held = ownership.Held([(weight.__array_interface__["data"][0], weight.nbytes)])
    over_weight = torch.from_numpy(weight)[2:4].numpy()  # a storage of its own over the constant
    over_input = torch.from_numpy(inputs[0]).numpy()
    results = ownership.owned([over_weight, over_input], inputs, held)
    assert not np.shares_memory(results[0], weight)
    assert not np.shares_memory(results[1], inputs[0])
