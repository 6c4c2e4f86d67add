"""Issue 30, item 2: a custom allocator allocates the tensors of the backend it is registered for.

Seed 000 (The UseCustomMemoryAllocator interface): "Backends can also have an associated
CustomMemoryAllocator registered with them that ArmNN will use to allocate intra/inter-layer
memory." Seed 003 (FallbackMemoryAllocator): "MallocFallbackMemoryAllocator and
DmabufFallbackMemoryAllocator implement armnn::ICustomAllocator to allocate fallback memory that
aligned between source and destination backends."
"""

from __future__ import annotations

import gc
import mmap
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession, Runtime, RuntimeOptions, import_onnx, optimize
from backplane.backends.api.memory import AllocatorError, CustomAllocator, MemorySource
from backplane.backends.registry import registry
from backplane.runtime.tensors import AllocatedTensors
from tests.conftest import small_cnn_model
from tests.runtime.fallback_backends import NpuBackend, fallback_backends  # noqa: F401

X = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)


class Counting(CustomAllocator):
    """Host memory, aligned as asked; counts its calls and bytes, and what was given back."""

    def __init__(self) -> None:
        self.calls, self.nbytes, self.freed = 0, 0, 0
        self.live: dict[int, Any] = {}

    def allocate(self, nbytes: int, alignment: int) -> Any:
        self.calls += 1
        self.nbytes += nbytes
        raw = np.empty(nbytes + alignment, np.uint8)
        start = -raw.ctypes.data % alignment
        buffer = raw[start:start + nbytes]
        self.live[id(buffer)] = buffer
        return buffer

    def free(self, buffer: Any) -> None:
        self.freed += 1
        del self.live[id(buffer)]


def _backends(name: str) -> list[str]:
    if name == "CpuAcc":
        pytest.importorskip("torch")
    return [name]


def _tensors(loaded: Any, backend: str) -> dict[str, int]:
    """The bytes of each tensor ``backend``'s layers read or write, constants included (a
    compiled partition's own intermediates are inside its layer: its business)."""
    graph = loaded.network.graph
    names = {n for layer in loaded.layers if layer.backend == backend
             for n in (*layer.inputs, *layer.outputs) if n}
    return {n: int(graph.constants[n].nbytes) if n in graph.constants else graph.info(n).nbytes
            for n in names}


@pytest.mark.parametrize("backend", ["CpuRef", "CpuAcc"])
def test_a_host_allocator_allocates_every_tensor_of_its_backend(backend: str) -> None:
    """'that ArmNN will use to allocate intra/inter-layer memory': its inputs, outputs,
    intermediates and constants, once at load; runs reuse them; unload gives each back."""
    allocator = Counting()
    runtime = Runtime(RuntimeOptions(custom_allocators={backend: allocator}))
    model = small_cnn_model()
    network_id = runtime.load(optimize(import_onnx(model), _backends(backend)))
    loaded = runtime.network(network_id)
    tensors = _tensors(loaded, backend)  # CpuAcc: one compiled partition, its input and output
    assert len(tensors) >= (2 if backend == "CpuAcc" else 8)
    assert allocator.calls == len(tensors) and allocator.nbytes == sum(tensors.values())
    calls = allocator.calls
    registry_ = loaded.tensors[backend]
    assert isinstance(registry_, AllocatedTensors)
    mine = [layer for layer in loaded.layers if layer.backend == backend]
    entry, exit_ = mine[0].inputs[0], mine[-1].outputs[0]  # x (x@CpuAcc: imported), probs
    reference = InferenceSession(model, ["CpuRef"])
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)
        (got,) = runtime.run(network_id, {"x": x})
        (want,) = reference.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # the input was copied into allocator memory, the output computed there, then handed out
        np.testing.assert_array_equal(registry_.hosts[entry], x)
        np.testing.assert_array_equal(registry_.hosts[exit_], got)
        assert not any(np.may_share_memory(got, b) for b in allocator.live.values())
    assert allocator.calls == calls  # static sizes: nothing allocated at run time
    runtime.unload(network_id)
    assert allocator.freed == calls and not allocator.live


def _free_batch_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "free", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_tensor_sized_at_run_time_is_allocated_at_its_first_run_and_again_when_larger() -> None:
    allocator = Counting()
    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": allocator}))
    session = InferenceSession(_free_batch_model(), ["CpuRef"], runtime=runtime)
    assert allocator.calls == 0  # no size known at load
    sizes = {}
    for n in (2, 2, 1, 5):
        x = np.arange(4 * n, dtype=np.float32).reshape(n, 4) - 3
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], -np.maximum(x, 0))
        sizes[n] = allocator.calls
    assert sizes == {2: 3, 1: 3, 5: 6}  # x, r, y at batch 2; reused for 1; again for 5
    assert allocator.freed == 3  # the batch-2 buffers went back when batch 5 replaced them
    session.close()
    assert allocator.freed == 6 and not allocator.live


class Returning(CustomAllocator):
    def __init__(self, make: Any) -> None:
        self.make = make

    def allocate(self, nbytes: int, alignment: int) -> Any:
        return self.make(nbytes)


@pytest.mark.parametrize("make, message", [
    (lambda n: bytearray(8), r"returned 8 bytes for tensor '\w+' \(float32\[[0-9,]+\]\), which "
                             r"takes \d+ bytes"),
    (lambda n: [0] * n, r"returned a list for tensor .*, not memory"),
    (lambda n: bytes(n), r"returned read-only memory \(bytes\)"),
    (lambda n: np.zeros(n + 1, np.uint8)[1:], r"returned memory at address 0x[0-9a-f]+ for "
                                               r".*, not aligned to 64 bytes"),
])
def test_an_allocator_that_returns_unfit_memory_is_an_error_naming_the_backend(make: Any,
                                                                              message: str) -> None:
    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": Returning(make)}))
    with pytest.raises(AllocatorError, match=f"the custom allocator of backend CpuRef "
                                             f"\\(Returning\\) {message}"):
        runtime.load(optimize(import_onnx(small_cnn_model()), ["CpuRef"]))


def test_an_object_without_allocate_is_refused_by_name() -> None:
    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": object()}))
    with pytest.raises(TypeError, match="given for backend CpuRef has no allocate"):
        runtime.load(optimize(import_onnx(small_cnn_model()), ["CpuRef"]))


def test_only_the_backend_it_is_registered_for_uses_it() -> None:
    pytest.importorskip("torch")
    allocator = Counting()
    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": allocator}))
    network = optimize(import_onnx(small_cnn_model()), ["CpuAcc", "CpuRef"],
                       pins={"Softmax": "CpuRef"})
    network_id = runtime.load(network)
    loaded = runtime.network(network_id)
    assert set(loaded.tensors) == {"CpuRef"}
    assert allocator.nbytes == sum(_tensors(loaded, "CpuRef").values()) > 0
    (got,) = runtime.run(network_id, {"x": X})
    np.testing.assert_allclose(got, InferenceSession(small_cnn_model(), ["CpuRef"]).run(
        None, {"x": X})[0], rtol=1e-5, atol=1e-6)


class DmaBuf(CustomAllocator):
    """dma-buf memory (an anonymous shared mapping, as fallback.allocate makes it), counted."""

    memory = MemorySource.DMA_BUF

    def __init__(self) -> None:
        self.calls, self.freed = 0, 0

    def allocate(self, nbytes: int, alignment: int) -> Any:
        self.calls += 1
        mapping = mmap.mmap(-1, nbytes + alignment)
        address = np.frombuffer(mapping, np.uint8, count=1).ctypes.data
        start = -address % alignment
        return memoryview(mapping)[start:start + nbytes]

    def free(self, buffer: Any) -> None:
        self.freed += 1


class AllocatingNpu(NpuBackend):
    """TestNpu, taking a dma-buf allocator for the fallback memory it owns."""

    id = "TestAllocatingNpu"

    def use_custom_allocator(self, allocator: Any) -> bool:
        return bool(getattr(allocator, "memory", MemorySource.UNDEFINED) & MemorySource.DMA_BUF)


def test_the_fallback_memory_a_backend_owns_comes_from_its_allocator(
        fallback_backends: None) -> None:  # noqa: F811
    """Seed 003: fallback memory allocated by an ICustomAllocator, for the source backend (whose
    factory asks for the fallback import) and aligned for both sides."""
    from tests.runtime.test_fallback_import import MODEL, NBYTES, _expected, _x

    allocator = DmaBuf()
    pins = {"t0": AllocatingNpu.id, "t1": "TestGpu", "t2": "TestGpu"}
    with registry.temporarily(AllocatingNpu.id, AllocatingNpu):
        runtime = Runtime(RuntimeOptions(custom_allocators={AllocatingNpu.id: allocator}))
        session = InferenceSession(MODEL, [AllocatingNpu.id, "TestGpu", "CpuRef"], pins=pins,
                                   runtime=runtime)
    loaded = runtime.network(session.network_id)
    assert allocator.calls == 1 and loaded.fallback_memory.nbytes == NBYTES
    assert not loaded.tensors  # its own tensors are not host memory: the runtime makes none
    for seed in range(2):
        np.testing.assert_allclose(session.run(None, {"x": _x(seed)})[0], _expected(_x(seed))[0],
                                   rtol=1e-6)
    assert allocator.calls == 1
    session.close()
    assert allocator.freed == 1



def test_control_flow_bodies_allocate_from_it_and_give_everything_back() -> None:
    """A Loop (carried values, scans, a stop on its condition) and an If nested in a Loop: the
    bodies' tensors on CpuRef come from its allocator too; closed, all is freed."""
    from tests.backends.test_control_flow_fast import loop_feeds, loop_model, nested_if_loop_model

    x = np.array([0.5, 2, -1, 3], np.float32)
    cases = [(loop_model(), [loop_feeds(3, True, 1.0, 1), loop_feeds(20, True, 2.0, 3),
                             loop_feeds(0, True, 1.0, 1), loop_feeds(7, False, 1.0, 1)]),
             (nested_if_loop_model(), [{"M": np.array(m, np.int64),
                                        "h0": np.arange(4, dtype=np.float32), "x": x * m}
                                       for m in (5, 4, 0)])]
    for model, feeds_list in cases:
        allocator = Counting()
        runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": allocator}))
        session = InferenceSession(model, ["CpuRef"], runtime=runtime)
        reference = InferenceSession(model, ["CpuRef"])
        for feeds in feeds_list:
            for got, want in zip(session.run(None, feeds), reference.run(None, feeds)):
                assert got.shape == want.shape and got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
        outer = session.runtime.network(session.network_id)
        if all(layer.op_type == "Loop" for layer in outer.layers):  # the If in a Loop: all inside
            assert not outer.tensors
        assert allocator.calls > 0
        session.close()  # the bodies' networks with the network
        assert allocator.freed == allocator.calls and not allocator.live


def test_subgraphs_built_at_run_time_give_their_memory_back_at_the_unload() -> None:
    """Seed 000: the LoadedNetwork "calls ... on the memory manager before it starts executing the
    network and it calls ... in its destructor": the subgraphs CpuAcc's Specialized layer builds
    per input signature allocate from the allocator and give it all back when the network is
    unloaded, not when the garbage collector reaches them (gc is off here)."""
    pytest.importorskip("torch")
    allocator = Counting()
    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuAcc": allocator}))
    session = InferenceSession(_free_batch_model(), ["CpuAcc"], runtime=runtime)
    assert "Specialized" in [layer.op_type for layer in runtime.network(session.network_id).layers]
    gc.disable()
    try:
        for n in (2, 3, 2, 5):
            x = np.arange(4 * n, dtype=np.float32).reshape(n, 4) - 3
            np.testing.assert_array_equal(session.run(None, {"x": x})[0], -np.maximum(x, 0))
        assert allocator.calls > 3  # the three signatures' subgraphs allocated too
        session.close()
        assert allocator.freed == allocator.calls and not allocator.live
    finally:
        gc.enable()
