"""Issue 30, item 5 (its tensor registry): a backend may make and own the tensors of its partition.

Seed 002: "BackendContext : Holds data for the current session and also responsible for creation
of tensor objects and kernels", "BackendContext::genTensors : Creates tensor objects" and
"ITensorRegistry : A set of tensor (ITensor) objects that are used by the current backend".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession
from backplane.backends.api.backend import Backend, Workload, WorkloadFactory
from backplane.backends.api.memory import TensorRegistry
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from backplane.ir.graph import Layer, TensorInfo

C = np.array([[1.0, -2.0, 3.0, -4.0]], np.float32)


def _model() -> bytes:
    """x -> Relu -> r -> Neg -> n -> Add(n, c) -> y; c a constant."""
    info = helper.make_tensor_value_info
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Neg", ["r"], ["n"], name="neg"),
             helper.make_node("Add", ["n", "c"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [2, 4])],
                              [info("y", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor("c", TensorProto.FLOAT, [1, 4], C.ravel())])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


class Owned(TensorRegistry):
    released = 0

    def release(self) -> None:
        Owned.released += 1
        super().release()


class Owning(Backend):
    """Makes a tensor of its own for each static tensor of its partition; Relu and Neg write into
    theirs (as onert's genKernels binds kernels to the registry's tensors), Add returns a fresh
    array (the runtime copies it into its tensor)."""

    id = "TestOwning"
    KERNELS = {"Relu": {6: lambda x: (np.maximum(x, 0),)}, "Neg": {6: lambda x: (-x,)},
               "Add": {7: lambda a, b: (a + b,)}}
    asked: list[dict[str, TensorInfo]] = []
    made: list[Owned] = []

    def gen_tensors(self, tensors: Mapping[str, TensorInfo]) -> TensorRegistry | None:
        Owning.asked.append(dict(tensors))
        made = Owned({name: np.zeros(info.shape, info.dtype)  # type: ignore[arg-type]
                      for name, info in tensors.items() if info.nbytes is not None})
        Owning.made.append(made)
        return made

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return OwningFactory(self, memory_manager)


class OwningFactory(WorkloadFactory):
    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        assert self.tensors is not None, "the runtime hands the registry over before any workload"
        out = self.tensors.get(layer.outputs[0])
        if layer.op_type == "Relu":
            return lambda x: (np.maximum(x, 0, out=out),)
        if layer.op_type == "Neg":
            return lambda x: (np.negative(x, out=out),)
        return super().create_workload(layer, inputs, outputs)


@pytest.fixture
def owning():
    Owning.asked.clear()
    Owning.made.clear()
    Owned.released = 0
    with registry.temporarily(Owning.id, Owning):
        yield


def test_the_backend_makes_the_tensors_of_its_partition_and_its_layers_use_them(
        owning: None) -> None:
    """Seed 002: "BackendContext::genTensors : Creates tensor objects" and "ITensorRegistry : A
    set of tensor (ITensor) objects that are used by the current backend": the backend is asked
    once for the tensors its layers read and write, and its kernels write into them."""
    session = InferenceSession(_model(), [Owning.id])
    (asked,), (made,) = Owning.asked, Owning.made
    assert sorted(asked) == ["n", "r", "x", "y"]  # what its layers read and write; no constant
    reference = InferenceSession(_model(), ["CpuRef"])
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal((2, 4)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_array_equal(y, reference.run(None, {"x": x})[0])
        np.testing.assert_array_equal(made.get("x"), x)  # the user's input, copied in
        np.testing.assert_array_equal(made.get("r"), np.maximum(x, 0))  # written in place
        np.testing.assert_array_equal(made.get("n"), -np.maximum(x, 0))
        np.testing.assert_array_equal(made.get("y"), y)  # Add's fresh result, copied there
        assert not np.shares_memory(y, made.get("y"))  # the caller's alone
    assert Owned.released == 0
    session.close()
    assert Owned.released == 1 and not made.tensors


def test_the_registry_is_asked_for_the_partition_alone(owning: None) -> None:
    session = InferenceSession(_model(), [Owning.id, "CpuRef"], pins={"add": "CpuRef"})
    (asked,) = Owning.asked
    assert sorted(asked) == ["n", "r", "x"]
    loaded = session.runtime.network(session.network_id)
    assert set(loaded.tensors) == {Owning.id}
    x = np.random.default_rng(5).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], -np.maximum(x, 0) + C)


def test_cpuref_keeps_the_default_its_kernels_allocate() -> None:
    assert CpuRef().gen_tensors({"x": TensorInfo((2, 4), np.dtype(np.float32))}) is None
    session = InferenceSession(_model(), ["CpuRef"])
    assert session.runtime.network(session.network_id).tensors == {}
