"""Capabilities that act at an edge (issue 30, item 3): an AsyncExecution backend's outputs are
synced by the runtime before any other reader (a host backend, another backend's import, the user),
and a ProtectedContentAllocation backend's outputs are never handed to unprotected memory.

TestAsyncHost (tests/runtime/fallback_backends.py) queues its kernels and leaves its outputs at
UNWRITTEN until its queue is flushed, which only its sync does: a reader the runtime does not sync
for reads 777.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession
from backplane.backends.api.memory import HOST_FACTORY, MemorySource, TensorHandleFactory
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from backplane.ir.graph import Graph, Layer, TensorInfo
from backplane.optimizer.edges import insert_compatibility_layers
from backplane.optimizer.optimize import OptimizationError
from tests.runtime.fallback_backends import (  # noqa: F401 (async_backends: a fixture)
    UNWRITTEN,
    AsyncHostBackend,
    AsyncHostExporting,
    async_backends,
)


def _model() -> bytes:
    """x -> a (Relu) -> b (Sigmoid) -> y (Tanh); a and y are outputs too."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
             helper.make_node("Sigmoid", ["a"], ["b"], name="b"),
             helper.make_node("Tanh", ["b"], ["y"], name="y")]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "chain", [info("x", TensorProto.FLOAT, [2, 3])],
                              [info("y", TensorProto.FLOAT, [2, 3]),
                               info("a", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


X = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
A = np.maximum(X, 0)
Y = np.tanh(1 / (1 + np.exp(-A)))


@pytest.mark.parametrize("backend, crossing", [(AsyncHostBackend, "direct"),
                                               (AsyncHostExporting, "import")])
@pytest.mark.parametrize("pins", [{"a": "async", "y": "async"}, {"b": "async"}],
                         ids=["async-host-async", "host-async-host"])
def test_every_reader_of_an_async_backend_reads_its_writes(
        backend: type, crossing: str, pins: dict[str, str], async_backends: None) -> None:
    """The seed: "FallbackImportWorkload will be created to be sync after execution of the
    subgraph in case the source backend has asynchronous execution": here before every reader
    that is not the backend itself, whether it reads the memory as it is (host memory), imports it
    (a MemImport) or is the user (an output)."""
    pins = {layer: backend.id if where == "async" else "CpuRef" for layer, where in pins.items()}
    session = InferenceSession(_model(), [backend.id, "CpuRef"], pins=pins)
    for _ in range(2):
        y, a = session.run(None, {"x": X})
        np.testing.assert_allclose(y, Y, rtol=1e-6)
        np.testing.assert_allclose(a, A, rtol=1e-6)
    crossings = {c.strategy for c in session.report.copies if c.source == backend.id}
    assert crossings <= {"import"} and (crossing == "import") == bool(crossings)
    syncs = [lay for lay in session.optimized.graph.layers if lay.op_type == "Sync"]
    assert syncs and all(lay.attrs["source_backend"] == backend.id for lay in syncs)


def test_without_the_capability_readers_read_unwritten_memory(async_backends: None) -> None:
    """The test bed is not vacuous: the same backend without AsyncExecution gets no sync, and its
    reader reads what was there before its queue ran."""
    class Undeclared(AsyncHostBackend):
        id = "TestAsyncUndeclared"

        def capabilities(self) -> dict[str, Any]:
            return {**super().capabilities(), "AsyncExecution": False}

    with registry.temporarily(Undeclared.id, Undeclared):
        session = InferenceSession(_model(), [Undeclared.id, "CpuRef"],
                                   pins={"a": Undeclared.id, "b": "CpuRef", "y": "CpuRef"})
        assert not [lay for lay in session.optimized.graph.layers if lay.op_type == "Sync"]
        y, a = session.run(None, {"x": X})
    assert np.all(a == UNWRITTEN)
    np.testing.assert_allclose(y, np.tanh(1 / (1 + np.exp(-UNWRITTEN))), rtol=1e-6)


def _two_layer_graph(first: str, second: str) -> Graph:
    info = TensorInfo((2, 3), np.dtype(np.float32))
    layers = [Layer("a", "Relu", ["x"], ["a"], backend=first),
              Layer("y", "Tanh", ["a"], ["y"], backend=second)]
    return Graph("g", layers, ["x"], ["y"], {n: info for n in ("x", "a", "y")})


def test_a_sync_where_the_reader_is_not_the_source_and_not_for_cuda_memory() -> None:
    """A Sync per tensor read outside its asynchronous backend (once, however many readers);
    none for CUDA memory, whose copy-out waits on the producer's stream and whose imports DLPack
    orders (GpuAcc, AsyncExecution, keeps its graph as it was)."""
    host = {"Async": (HOST_FACTORY,), "CpuRef": (HOST_FACTORY,)}
    graph = _two_layer_graph("Async", "CpuRef")
    insert_compatibility_layers(graph, host, asynchronous={"Async"})
    assert [(lay.op_type, lay.inputs) for lay in graph.layers] == [
        ("Relu", ["x"]), ("Sync", ["a"]), ("Tanh", ["a@synced"])]
    assert graph.outputs == ["y"]  # CpuRef's output: no sync
    cuda = TensorHandleFactory("cuda", MemorySource.CUDA, MemorySource.CUDA, MemorySource.CUDA,
                               supports_mapping=False, device="cuda:0")
    graph = _two_layer_graph("Gpu", "CpuRef")
    insert_compatibility_layers(graph, {"Gpu": (cuda,), "CpuRef": (HOST_FACTORY,)},
                                asynchronous={"Gpu"})
    assert [lay.op_type for lay in graph.layers] == ["MemCopy", "Relu", "MemCopy", "Tanh"]


class ProtectedRef(CpuRef):
    """CpuRef's kernels in protected memory (ProtectedContentAllocation)."""

    id = "TestProtected"

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "ProtectedContentAllocation": True}


class ProtectedToo(ProtectedRef):
    id = "TestProtectedToo"


@pytest.mark.parametrize("pins, reader", [
    ({"a": "TestProtected", "b": "CpuRef", "y": "TestProtected"}, "CpuRef"),
    ({"a": "CpuRef", "b": "CpuRef", "y": "TestProtected"}, "the user")])
def test_protected_memory_is_never_handed_to_unprotected_memory(
        pins: dict[str, str], reader: str) -> None:
    """000: "CustomMemoryAllocator ... This particular feature is required if you want a backend to
    use ProtectedContentAllocation": protected memory goes to a backend that allocates it, and
    nowhere else (not to a host backend, not to the user)."""
    with registry.temporarily(ProtectedRef.id, ProtectedRef):
        with pytest.raises(OptimizationError, match=f"memory of TestProtected .*{reader}"):
            InferenceSession(_model(), ["TestProtected", "CpuRef"], pins=pins)


def test_protected_memory_crosses_between_protected_backends_and_in_from_the_host() -> None:
    """Unprotected memory may go into protected memory, and protected memory between two backends
    that both allocate it: of x (user -> TestProtected), a (TestProtected -> TestProtectedToo) and
    b (TestProtectedToo -> CpuRef), only b is refused."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
             helper.make_node("Sigmoid", ["a"], ["b"], name="b"),
             helper.make_node("Tanh", ["b"], ["y"], name="y")]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "chain", [info("x", TensorProto.FLOAT, [2, 3])],
                              [info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with registry.temporarily(ProtectedRef.id, ProtectedRef), \
            registry.temporarily(ProtectedToo.id, ProtectedToo):
        with pytest.raises(OptimizationError) as refused:
            InferenceSession(model.SerializeToString(),
                             [ProtectedRef.id, ProtectedToo.id, "CpuRef"],
                             pins={"a": ProtectedRef.id, "b": ProtectedToo.id, "y": "CpuRef"})
    assert str(refused.value).startswith("b is in protected memory of TestProtectedToo"), \
        refused.value
