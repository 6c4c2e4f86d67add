"""FallbackImport and the fallback memory manager (issue 13, item 1), on two host backends whose
memories cannot import each other but both import dma-buf memory (tests/runtime/fallback_backends.py):
the edge strategy, one aligned buffer per network reused run to run and written in place by the
producer, the source backend's sync, the copy left where a producer cannot write in place, and the
report that says so."""

from __future__ import annotations

import math
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import backplane
from backplane import InferenceSession
from backplane.backends.api.backend import WorkloadFactory
from backplane.backends.api.memory import HOST_FACTORY, MemorySource, TensorHandleFactory
from backplane.ir.graph import TensorInfo
from backplane.optimizer.edges import EdgeStrategy, edge_strategy
from backplane.optimizer.report import PlacementReport
from backplane.runtime.fallback import FallbackMemoryManager, allocate
from tests.runtime.fallback_backends import (  # noqa: F401 (fallback_backends: a fixture)
    GPU_ALIGNMENT,
    GPU_FACTORY,
    FallbackTestFactory,
    fallback_backends,
    is_dma_buf,
)

SHAPE = [2, 8, 16, 16]
NBYTES = 4 * int(np.prod(SHAPE))


def _chain(ops: list[str]) -> bytes:
    """x -> ops[0] -> ops[1] -> ...; layer i named t{i}."""
    names = ["x"] + [f"t{i}" for i in range(len(ops))]
    nodes = [helper.make_node(op, [names[i]], [names[i + 1]], name=names[i + 1])
             for i, op in enumerate(ops)]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "chain", [info("x", TensorProto.FLOAT, SHAPE)],
                              [info(names[-1], TensorProto.FLOAT, SHAPE)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


MODEL = _chain(["Sigmoid", "Tanh", "Relu"])


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _session(pins: dict[str, str], model: bytes = MODEL) -> InferenceSession:
    return InferenceSession(model, [*dict.fromkeys(pins.values()), "CpuRef"], pins=pins)


def _expected(x: np.ndarray, model: bytes = MODEL) -> list[np.ndarray]:
    return InferenceSession(model, ["CpuRef"]).run(None, {"x": x})


NPU_TO_GPU = {"t0": "TestNpu", "t1": "TestGpu", "t2": "TestGpu"}


def test_the_strategy_is_a_fallback_import_only_between_factories_that_ask_and_share_a_kind(
        fallback_backends: None) -> None:
    npu = InferenceSession(MODEL, ["TestNpu"]).optimized.backends["TestNpu"]
    npu_factory = npu.tensor_handle_factories()[0]
    assert edge_strategy(npu_factory, GPU_FACTORY) is EdgeStrategy.FALLBACK_IMPORT
    assert edge_strategy(GPU_FACTORY, npu_factory) is EdgeStrategy.FALLBACK_IMPORT
    assert edge_strategy(GPU_FACTORY, npu_factory, to_user=True) is EdgeStrategy.COPY_TO_TARGET
    assert edge_strategy(npu_factory, HOST_FACTORY) is EdgeStrategy.COPY_TO_TARGET  # no shared kind
    not_asking = TensorHandleFactory("plain", MemorySource.BACKEND, MemorySource.DMA_BUF)
    assert edge_strategy(not_asking, GPU_FACTORY) is EdgeStrategy.COPY_TO_TARGET
    assert edge_strategy(HOST_FACTORY, HOST_FACTORY) is EdgeStrategy.DIRECT_COMPATIBILITY


def test_the_producer_writes_into_one_buffer_the_consumer_reads_reused_run_to_run(
        fallback_backends: None) -> None:
    session = _session(NPU_TO_GPU)
    (record,) = [c for c in session.report.copies if c.strategy == "fallback_import"]
    assert (record.tensor, record.layer, record.copied_bytes) == \
        ("t0", "FallbackImport[t0](TestNpu->TestGpu)", 0)
    loaded = session.runtime.network(session.network_id)
    ((key, buffer),) = loaded.fallback_memory.buffers.items()
    assert key == ("t0", MemorySource.DMA_BUF) and buffer.nbytes == NBYTES
    address = buffer.ctypes.data
    assert is_dma_buf(buffer)
    assert address % math.lcm(mmap.PAGESIZE, GPU_ALIGNMENT) == 0  # aligned for both sides
    for seed in (0, 1, 2):
        x = _x(seed)
        (got,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got, _expected(x)[0], rtol=1e-5, atol=1e-6)
        # the buffer holds t0 (Sigmoid(x)): the producer wrote there, in place, this run
        written = buffer.view(np.float32).reshape(SHAPE)
        np.testing.assert_allclose(written, 1 / (1 + np.exp(-x)), rtol=1e-6)
    assert list(loaded.fallback_memory.buffers.values())[0].ctypes.data == address  # not remade
    assert session.report.fallback_bytes == NBYTES and session.report.bytes_copied() == 0


def test_the_fallback_import_is_the_source_backends_so_an_asynchronous_source_syncs(
        fallback_backends: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """003: "When creating workload, FallbackImportWorkload is a special case to create the
    workload from source backend." TestNpu runs its queue when flushed: the FallbackImport made by
    its workload factory flushes it before TestGpu reads the buffer. Made by any factory that does
    not (the consumer's, or the default), TestGpu reads what the buffer held before."""
    x = _x()
    expected = _expected(x)[0]
    (got,) = _session(NPU_TO_GPU).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(FallbackTestFactory, "create_fallback_import",
                        WorkloadFactory.create_fallback_import)
    (stale,) = _session(NPU_TO_GPU).run(None, {"x": x})
    assert not np.allclose(stale, expected, rtol=1e-3, atol=1e-3)


def test_a_producer_that_cannot_write_in_place_leaves_one_copy_and_the_report_counts_it(
        fallback_backends: None) -> None:
    session = _session({"t0": "TestNpuCopying", "t1": "TestGpu", "t2": "TestGpu"})
    (record,) = [c for c in session.report.copies if c.strategy == "fallback_import"]
    assert record.copied_bytes == NBYTES and session.report.bytes_copied() == NBYTES
    assert f"({NBYTES:,} bytes copied)" in str(session.report)
    for seed in (0, 1):
        x = _x(seed)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], _expected(x)[0],
                                   rtol=1e-5, atol=1e-6)


def test_gpu_to_npu_to_gpu_two_buffers_written_in_place(fallback_backends: None) -> None:
    session = _session({"t0": "TestGpu", "t1": "TestNpu", "t2": "TestGpu"})
    layers = [c.layer for c in session.report.copies if c.strategy == "fallback_import"]
    assert layers == ["FallbackImport[t0](TestGpu->TestNpu)", "FallbackImport[t1](TestNpu->TestGpu)"]
    assert session.report.bytes_copied() == 0 and session.report.fallback_bytes == 2 * NBYTES
    x = _x()
    results, timings = session.run_profiled(None, {"x": x})
    np.testing.assert_allclose(results[0], _expected(x)[0], rtol=1e-5, atol=1e-6)
    inner = [t.layer for t in timings if t.op_type in ("MemCopy", "MemImport", "FallbackImport")
             and "user" not in t.layer]
    assert inner == layers  # no copy between the backends, only the two fallback imports


def test_the_report_names_the_layer_and_keeps_the_bytes(fallback_backends: None) -> None:
    report = _session(NPU_TO_GPU).report
    text = " ".join(str(report).split())  # lines wrap at 160 columns
    assert "FallbackImport[t0](TestNpu->TestGpu)" in text
    assert "0 tensors copied and 0 imported and 1 through fallback memory between backends " \
           "(0 bytes copied)" in text
    assert "fallback memory 0.02 MiB" in text
    data = report.to_dict()
    assert data["bytes_copied"] == 0 and data["fallback_bytes"] == NBYTES
    assert data["crossings"] == {"fallback_import": 1}
    again = PlacementReport.from_dict(data)
    assert [c.copied_bytes for c in again.copies] == [c.copied_bytes for c in report.copies]
    assert again.fallback_bytes == NBYTES


def test_unload_frees_the_fallback_memory(fallback_backends: None) -> None:
    """003: "On network unload, we have to deallocate fallback memory by calling
    FallbackMemoryManager and pass the network ld." """
    session = _session(NPU_TO_GPU)
    loaded = session.runtime.network(session.network_id)
    assert loaded.fallback_memory.buffers
    session.runtime.unload(session.network_id)
    assert not loaded.fallback_memory.buffers


def test_runs_from_several_threads_take_turns_on_the_shared_memory(fallback_backends: None) -> None:
    session = _session(NPU_TO_GPU)
    assert session.runtime.network(session.network_id).exclusive
    inputs = [_x(seed) for seed in range(4)]
    expected = [_expected(x)[0] for x in inputs]
    failures: list[str] = []

    def run(index: int) -> None:
        for _ in range(5):
            (got,) = session.run(None, {"x": inputs[index]})
            if not np.allclose(got, expected[index], rtol=1e-5, atol=1e-6):
                failures.append(f"thread {index}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_an_artifact_keeps_the_fallback_import(fallback_backends: None, tmp_path: Path) -> None:
    artifact = tmp_path / "m.bpl"
    backplane.compile(MODEL, ["TestNpu", "TestGpu", "CpuRef"], artifact, pins=NPU_TO_GPU)
    session = InferenceSession(str(artifact))
    (layer,) = [lay for lay in session.optimized.graph.layers if lay.op_type == "FallbackImport"]
    assert layer.attrs["source_backend"] == "TestNpu" and layer.attrs["memory"] == "DMA_BUF"
    assert [c.copied_bytes for c in session.report.copies if c.layer == layer.name] == [0]
    x = _x()
    np.testing.assert_allclose(session.run(None, {"x": x})[0], _expected(x)[0], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("kind", [MemorySource.DMA_BUF, MemorySource.MALLOC])
@pytest.mark.parametrize("alignment", [64, 4096, 1 << 16])
def test_allocate_aligns_fallback_memory(kind: MemorySource, alignment: int) -> None:
    memory = allocate(kind, 1000, alignment)
    assert memory.nbytes == 1000 and memory.ctypes.data % alignment == 0
    assert is_dma_buf(memory) == (kind is MemorySource.DMA_BUF)


def test_a_runs_outputs_never_alias_fallback_memory() -> None:
    manager = FallbackMemoryManager()
    buffer, fresh = manager.buffer("t", MemorySource.MALLOC, TensorInfo((4,), np.dtype(np.float32)),
                                   64)
    assert fresh and not manager.buffer("t", MemorySource.MALLOC,
                                        TensorInfo((4,), np.dtype(np.float32)), 64)[1]
    detached = manager.detach(buffer[1:])
    assert not np.shares_memory(detached, buffer)
    other = np.ones(4, np.float32)
    assert manager.detach(other) is other


def test_measured_placement_prices_a_fallback_edge(fallback_backends: None) -> None:
    from backplane.optimizer.edge_cost import edge_ms

    npu = InferenceSession(MODEL, ["TestNpu"]).optimized.backends["TestNpu"]
    value = _x()
    ms = edge_ms(value, npu.tensor_handle_factories()[0], GPU_FACTORY)
    assert 0 < ms < 1000


def test_pinned_fallback_memory_is_page_locked() -> None:
    """Fallback memory CUDA imports: pinned by the CUDA driver (skipped without CUDA)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    memory = allocate(MemorySource.PINNED, 4096, 256)
    assert memory.ctypes.data % 256 == 0
    assert torch.from_numpy(memory).is_pinned()
