"""Seed 002's user-given output buffers: an output bound to a host buffer (IOBinding's
``bind_output(name, buffer=...)``) is written by the layer that makes it, on CpuRef (NumPy's
``out=``) and CpuAcc (torch's ``out=``), not copied in after the run; runs stay apart."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession

BACKENDS = [["CpuRef"], ["CpuAcc", "CpuRef"]]
ONES = {"Add": 2, "Sub": 2, "Mul": 2, "Div": 2, "MatMul": 2}


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]],
           outputs: dict[str, list[int]], initializers: list[onnx.TensorProto] = ()) -> bytes:
    def infos(tensors: dict[str, list[int]]) -> list[onnx.ValueInfoProto]:
        return [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in tensors.items()]

    graph = helper.make_graph(nodes, "g", infos(inputs), infos(outputs), list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _one_op(op: str) -> tuple[bytes, dict[str, np.ndarray]]:
    """A model of one ``op`` layer (named "op") and its feeds, NaN and -0.0 among them."""
    rng = np.random.default_rng(7)
    shapes = {"a": [2, 3], "b": [3, 4] if op == "MatMul" else [2, 3]}
    names = list(shapes)[:ONES.get(op, 1)]
    out = [2, 4] if op == "MatMul" else [2, 3]
    feeds = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in names}
    if op != "MatMul":
        feeds["a"][0, :2] = [np.nan, -0.0]
    if op == "Sqrt":
        feeds["a"] = np.abs(feeds["a"])
    model = _model([helper.make_node(op, names, ["y"], name="op")],
                   {n: shapes[n] for n in names}, {"y": out})
    return model, feeds


def _producer(session: InferenceSession, layer: str) -> Any:
    """The workload of ``layer`` in the session's network (CpuAcc's: inside its thread governor)."""
    loaded = session.runtime.network(session.network_id)
    plan = loaded.host_plan
    step = next(s for s, lay in zip(plan.steps, plan.layers) if lay.name == layer)
    return getattr(step.workload, "work", step.workload)


def _spy(session: InferenceSession, layer: str) -> list[Any]:
    """The memory each call of ``layer``'s ``write_into`` is given, recorded from now on."""
    workload = _producer(session, layer)
    real, given = workload.write_into, []

    def write_into(memory: list[Any], *inputs: Any) -> Any:
        given.append(memory[0])
        return real(memory, *inputs)

    workload.write_into = write_into
    return given


def _address(memory: Any) -> int:
    return memory.data_ptr() if hasattr(memory, "data_ptr") else memory.ctypes.data


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The copies NumPy's copyto and torch's copy_ make while the test runs, counted."""
    torch = pytest.importorskip("torch")
    made: list[str] = []
    copyto, copy_ = np.copyto, torch.Tensor.copy_

    def counted_copyto(*args: Any, **kwargs: Any) -> Any:
        made.append("np.copyto")
        return copyto(*args, **kwargs)

    def counted_copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append("Tensor.copy_")
        return copy_(self, *args, **kwargs)

    monkeypatch.setattr(np, "copyto", counted_copyto)
    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    yield made


@pytest.mark.parametrize("backends", BACKENDS, ids=",".join)
def test_a_bound_output_is_written_by_the_layer_that_makes_it(backends: list[str],
                                                              copies: list[str]) -> None:
    """002: "The runtime core directly creates builtin’s tensor objects to accept user-given input
    and output buffers": the output's producer (a Relu) is handed the caller's buffer and writes
    it; no copy is made, and the values are the unbound run's, NaN and -0.0 included."""
    model, feeds = _one_op("Relu")
    session = InferenceSession(model, backends)
    expected = session.run(None, feeds)[0]
    given = _spy(session, "op")
    buffer = np.full((2, 3), 5.0, np.float32)
    binding = session.io_binding()
    binding.bind_cpu_input("a", feeds["a"])
    binding.bind_output("y", buffer=buffer)
    copies.clear()
    session.run_with_iobinding(binding)
    assert copies == [], "the buffer is the producer's out: nothing is copied into it"
    assert [_address(m) for m in given] == [buffer.ctypes.data]
    assert binding.get_outputs()[0] is buffer
    np.testing.assert_array_equal(buffer, expected)
    assert np.array_equal(np.signbit(buffer), np.signbit(expected))
    plan = next(iter(session.runtime.network(session.network_id)._plans.values()))
    assert not any(lay.op_type in ("MemCopy", "MemImport") and "y" in lay.inputs
                   for lay in plan.layers), "no copy or import of y to the host is left"


@pytest.mark.parametrize("backends", BACKENDS, ids=",".join)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Abs", "Neg", "Sqrt", "Exp", "Tanh",
                                "Sigmoid", "MatMul"])
def test_each_common_kernel_writes_in_place_as_it_computes(backends: list[str], op: str) -> None:
    if op == "MatMul" and "CpuAcc" in backends:
        pytest.skip("CpuAcc's MatMul is its kernel's, without out=")
    model, feeds = _one_op(op)
    session = InferenceSession(model, backends)
    expected = session.run(None, feeds)[0]
    given = _spy(session, "op")
    buffer = np.zeros_like(expected)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("y", buffer=buffer)
    session.run_with_iobinding(binding)
    assert [_address(m) for m in given] == [buffer.ctypes.data]
    np.testing.assert_array_equal(buffer, expected)


@pytest.mark.parametrize("backends", BACKENDS, ids=",".join)
def test_a_second_run_with_another_binding_leaves_the_first_buffer_alone(
        backends: list[str]) -> None:
    """No run holds a buffer past its end: another binding's run, and a plain run, write
    elsewhere; an output that views the buffer (a Reshape of it) is the caller's own copy."""
    model = _model([helper.make_node("Relu", ["a"], ["y"], name="op"),
                    helper.make_node("Reshape", ["y", "shape"], ["z"])],
                   {"a": [2, 3]}, {"y": [2, 3], "z": [3, 2]},
                   [helper.make_tensor("shape", TensorProto.INT64, [2], [3, 2])])
    session = InferenceSession(model, backends)
    first, second = (np.random.default_rng(i).standard_normal((2, 3)).astype(np.float32)
                     for i in (1, 2))
    buffers = []
    for x in (first, second):
        binding = session.io_binding()
        binding.bind_cpu_input("a", x)
        buffers.append(np.zeros((2, 3), np.float32))
        binding.bind_output("y", buffer=buffers[-1])
        binding.bind_output("z")
        session.run_with_iobinding(binding)
        y, z = binding.get_outputs()
        assert y is buffers[-1] and not np.shares_memory(z, y)
        np.testing.assert_array_equal(z, np.maximum(x, 0).reshape(3, 2))
    plain = session.run(None, {"a": -first})
    np.testing.assert_array_equal(buffers[0], np.maximum(first, 0))
    np.testing.assert_array_equal(buffers[1], np.maximum(second, 0))
    assert not any(np.shares_memory(out, b) for out in plain for b in buffers)


@pytest.mark.parametrize("backends", BACKENDS, ids=",".join)
def test_a_producer_that_cannot_write_into_memory_fills_the_buffer_by_one_copy(
        backends: list[str], copies: list[str]) -> None:
    """A Softmax has no ``write_into``: one copy at the end of the run fills the buffer."""
    model = _model([helper.make_node("Softmax", ["a"], ["y"], name="op")], {"a": [2, 3]},
                   {"y": [2, 3]})
    session = InferenceSession(model, backends)
    x = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
    expected = session.run(None, {"a": x})[0]
    buffer = np.zeros((2, 3), np.float32)
    binding = session.io_binding()
    binding.bind_cpu_input("a", x)
    binding.bind_output("y", buffer=buffer)
    copies.clear()
    session.run_with_iobinding(binding)
    assert copies == ["np.copyto"]
    np.testing.assert_array_equal(buffer, expected)


def test_a_buffer_that_is_also_a_bound_input_is_filled_after_the_run() -> None:
    """Writing y into x's memory would change x before the Add reads it: filled after the run."""
    model = _model([helper.make_node("Relu", ["a"], ["y"], name="op"),
                    helper.make_node("Add", ["a", "y"], ["z"])], {"a": [2, 3]},
                   {"y": [2, 3], "z": [2, 3]})
    session = InferenceSession(model, ["CpuRef"])
    x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    original = x.copy()
    binding = session.io_binding()
    binding.bind_cpu_input("a", x)
    binding.bind_output("y", buffer=x)
    binding.bind_output("z")
    session.run_with_iobinding(binding)
    y, z = binding.get_outputs()
    assert y is x
    np.testing.assert_array_equal(z, original + np.maximum(original, 0))
    np.testing.assert_array_equal(x, np.maximum(original, 0))


@pytest.mark.parametrize("buffer", [np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float64)],
                         ids=["shape", "dtype"])
def test_a_buffer_that_does_not_fit_names_the_output_and_both_shapes_and_types(
        buffer: np.ndarray) -> None:
    model, feeds = _one_op("Relu")
    session = InferenceSession(model, ["CpuRef"])
    binding = session.io_binding()
    binding.bind_cpu_input("a", feeds["a"])
    binding.bind_output("y", buffer=buffer)
    with pytest.raises(ValueError) as error:
        session.run_with_iobinding(binding)
    assert str(error.value) == (f"the buffer bound to output 'y' has shape {buffer.shape} and "
                                f"dtype {buffer.dtype}; the output has shape (2, 3) and dtype "
                                f"float32")
