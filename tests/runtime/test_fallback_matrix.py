"""The Ethos-N design's test matrix of backend-to-backend fallback: each row a sequence of backends
that the layers of a small network are pinned to in turn, each with three shapes of hand-over (one
tensor between partitions; several tensors in both directions; one tensor read by partitions on
several backends). Each case checks the outputs against CpuRef alone and, from the placement report
and a profiled run, that no byte was copied where the two sides could import each other's memory.

The host rows run everywhere. The fallback rows run everywhere too: TestNpu and TestGpu
(tests/runtime/fallback_backends.py) hold memory of their own that neither imports from the other,
but both import dma-buf memory, so each edge between them is a FallbackImport and copies nothing.
The device rows (GpuAcc, and TritonGpu: the out-of-tree second GPU backend of examples/triton_gpu)
skip without CUDA, or without Triton for TritonGpu.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession
from backplane.optimizer.edges import EdgeStrategy, choose
from backplane.backends.api.memory import MemorySource, TensorHandleFactory, fallback_kind
from backplane.backends.registry import registry
from tests.runtime.fallback_backends import fallback_backends  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
HOST = {"CpuRef", "CpuAcc"}

HOST_ROWS = [("CpuAcc", "CpuRef"), ("CpuRef", "CpuAcc"), ("CpuAcc", "CpuRef", "CpuAcc")]
FALLBACK_ROWS = [("TestNpu", "TestGpu"), ("TestGpu", "TestNpu"), ("TestNpu", "TestGpu", "TestNpu"),
                 ("TestGpu", "TestNpu", "TestGpu"), ("TestNpu", "CpuRef", "TestGpu")]
DEVICE_ROWS = [("GpuAcc", "TritonGpu"),  # GPU to GPU: two device backends, two streams
               ("CpuAcc", "GpuAcc"), ("GpuAcc", "CpuAcc"), ("CpuAcc", "GpuAcc", "CpuAcc"),
               ("GpuAcc", "CpuRef", "GpuAcc"), ("GpuAcc", "TritonGpu", "GpuAcc")]
SHAPE = [2, 8, 16, 16]


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _triton_gpu() -> None:
    """Register the example TritonGpu backend (out of tree) once, or skip."""
    if not _torch_cuda():
        pytest.skip("no CUDA device")
    sys.path.insert(0, str(ROOT / "examples" / "triton_gpu" / "src"))
    import triton_gpu_backend

    reason = triton_gpu_backend.missing()
    if reason:
        pytest.skip(f"TritonGpu: {reason}")
    if not registry.is_registered("TritonGpu"):
        registry.register("TritonGpu", triton_gpu_backend.backend_factory, origin="examples/")


# -- the three networks: layer name -> index of the row's backend that runs it -------------------
def _node(op: str, inputs: list[str], output: str) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output)


def _model(nodes: list[onnx.NodeProto], outputs: list[str]) -> bytes:
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "matrix", [info("x", TensorProto.FLOAT, SHAPE)],
                              [info(o, TensorProto.FLOAT, SHAPE) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def one_tensor(row: tuple[str, ...]) -> tuple[bytes, dict[str, str]]:
    """x -> L0 -> L1 [-> L2] -> y: one tensor crosses each edge."""
    ops = ["Sigmoid", "Tanh", "Relu"]
    names = [f"t{i}" for i in range(len(row))]
    nodes = [_node(ops[i % 3], [names[i - 1] if i else "x"], names[i]) for i in range(len(row))]
    return _model(nodes, [names[-1]]), {n: row[i] for i, n in enumerate(names)}


def both_directions(row: tuple[str, ...]) -> tuple[bytes, dict[str, str]]:
    """Layers alternate between the row's backends, each reading two earlier tensors: several
    tensors cross each edge, both ways."""
    nodes = [_node("Relu", ["x"], "t0"), _node("Sigmoid", ["t0"], "t1"),
             _node("Add", ["t0", "t1"], "t2"), _node("Mul", ["t2", "t0"], "t3"),
             _node("Sub", ["t3", "t1"], "t4"), _node("Add", ["t4", "t2"], "t5"),
             _node("Mul", ["t5", "t3"], "t6")]
    pins = {f"t{i}": row[(i // 2 + i) % len(row)] for i in range(7)}
    return _model(nodes, ["t6", "t2"]), pins


def shared_output(row: tuple[str, ...]) -> tuple[bytes, dict[str, str]]:
    """One tensor read by layers on every backend of the row, and also an output of the model."""
    nodes = [_node("Tanh", ["x"], "t"), _node("Relu", ["t"], "r"), _node("Sigmoid", ["t"], "s"),
             _node("Mul", ["t", "t"], "m"), _node("Add", ["r", "s"], "rs"),
             _node("Add", ["rs", "m"], "y")]
    pins = {"t": row[0], "r": row[1 % len(row)], "s": row[-1], "m": row[0], "rs": row[-1],
            "y": row[1 % len(row)]}
    return _model(nodes, ["y", "t"]), pins


NETWORKS = {"one_tensor": one_tensor, "both_directions": both_directions,
            "shared_output": shared_output}


def _check(row: tuple[str, ...], network: str) -> InferenceSession:
    model, pins = NETWORKS[network](row)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    expected = InferenceSession(model, ["CpuRef"]).run(None, {"x": x})
    preferences = [*dict.fromkeys(row), "CpuRef"]
    session = InferenceSession(model, preferences, pins=pins)
    placed = {name: p.backend for name, p in session.report.layers.items()}
    assert {name: placed[name] for name in pins} == pins, "a pin was not honoured"
    results, timings = session.run_profiled(None, {"x": x})
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    factories = {b: backend.tensor_handle_factories()
                 for b, backend in session.optimized.backends.items()}
    copied = 0
    for record in session.report.copies:
        if "user" in (record.source, record.target):
            continue
        source = factories[record.source][0]
        strategy, target = choose(source, factories[record.target])
        both_host = record.source in HOST and record.target in HOST
        both_device = source.device == target.device != "cpu"
        if both_host or both_device:  # memory both sides can map: an import, never a copy
            assert record.strategy == "import", record
        elif strategy is EdgeStrategy.FALLBACK_IMPORT:  # fallback memory: written in place
            assert record.strategy == "fallback_import" and record.copied_bytes == 0, record
        else:
            assert record.strategy == "copy", record
            copied += 1
    moved = [t for t in timings if t.op_type == "MemCopy" and "user" not in t.layer]
    assert len(moved) == copied, [t.layer for t in moved]
    assert all(t.nbytes for t in moved), "a copy's bytes are missing from the profile"
    return session


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("row", HOST_ROWS, ids="->".join)
def test_host_rows(row: tuple[str, ...], network: str) -> None:
    pytest.importorskip("torch")
    session = _check(row, network)
    assert not [c for c in session.report.copies if c.strategy == "copy"], \
        "host backends share memory: nothing is copied, not even for the user"


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("row", FALLBACK_ROWS, ids="->".join)
def test_fallback_rows(row: tuple[str, ...], network: str, fallback_backends: None) -> None:
    session = _check(row, network)
    fallback = [c for c in session.report.copies if c.strategy == "fallback_import"]
    layers = {lay.name: lay for lay in session.optimized.graph.layers}
    assert all(layers[c.layer].op_type == "FallbackImport" for c in fallback)
    copied = sum(c.nbytes or 0 for c in session.report.copies
                 if c.strategy == "copy" and "user" not in (c.source, c.target))
    assert session.report.bytes_copied() == copied  # nothing on the fallback edges
    if "CpuRef" not in row:  # every edge between TestNpu and TestGpu
        assert fallback and copied == 0


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("row", DEVICE_ROWS, ids="->".join)
def test_device_rows(row: tuple[str, ...], network: str) -> None:
    if not _torch_cuda():
        pytest.skip("no CUDA device")
    if "TritonGpu" in row:
        _triton_gpu()
    session = _check(row, network)
    if "CpuAcc" not in row and "CpuRef" not in row:  # device memory only: imports only
        inner = [c for c in session.report.copies if "user" not in (c.source, c.target)]
        assert inner and all(c.strategy == "import" for c in inner)


def test_a_convolution_whose_add_is_pinned_elsewhere_stays_on_the_gpu() -> None:
    """Regression: GpuAcc's Conv-Add-Relu fusion looked up the Add inside the captured subgraph
    after it was pinned out of it (a KeyError at load), and the load fallback then moved every layer
    behind it off the GPU (resnet50: 34 layers to CpuRef, 58 copies a run)."""
    if not _torch_cuda():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(0)
    weight = helper.make_tensor("W", TensorProto.FLOAT, [8, 8, 3, 3],
                                rng.standard_normal(8 * 8 * 9).astype(np.float32))
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["x"], ["r"], name="relu_x"),
             helper.make_node("Add", ["c", "r"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "residual", [info("x", TensorProto.FLOAT, SHAPE)],
                              [info("y", TensorProto.FLOAT, SHAPE)], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal(SHAPE).astype(np.float32)
    session = InferenceSession(model.SerializeToString(), ["GpuAcc", "CpuRef"],
                               pins={"add": "CpuRef"})
    assert not [w for w in session.report.warnings if "could not create" in w]
    assert session.report.backend_of("conv") == "GpuAcc"
    expected = InferenceSession(model.SerializeToString(), ["CpuRef"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-3, atol=1e-3)


M = MemorySource


# -- the design's matrix by its own rule, on factories made to its capability table -------------
def _design_factories(neon_fallback: bool, fallback: bool,
                      ) -> dict[str, tuple[TensorHandleFactory, ...]]:
    """The seed's backends as GetHandleFactoryPreferences lists them. Its table: "Map/Unmap" for
    EthosNImportTensorHandle, ClTensorHandle and NeonTensorHandle, not ClImportTensorHandle
    ("Gpu Tensor cannot have map/unmap and import at the same time"); "Import (DmaBuf)" for the
    NPU, "(Malloc, DmaBuf)" for ClImport, "(Malloc)" for Neon. Its Export row is empty ("no
    backend has support for memory export"), yet it calls CPU -> GPU a MemImport, which its rule
    (import & export != 0) gives only where Neon exports Malloc, as Arm NN's NeonTensorHandleFactory
    does; the NPU and ClImport export the kind of memory the fallback memory manager makes for them.
    ``fallback``: ClImport and the NPU say FallbackImportMemoryRequired ("add
    FallbackImportMemoryRequired instead, so that memory import is allowed in case of GPU
    fallback"); ``neon_fallback``: so does Neon (the design's test trick). ClImport comes first in
    the GPU's list: a backend's tensors are made by its first factory here, where Arm NN picks an
    output's factory by what its consumers import."""
    neon = TensorHandleFactory("neon", M.MALLOC, M.MALLOC, M.MALLOC, fallback_import=neon_fallback)
    cl = TensorHandleFactory("cl", M.BACKEND)
    cl_import = TensorHandleFactory("cl-import", M.BACKEND, M.MALLOC | M.DMA_BUF,
                                    M.MALLOC | M.DMA_BUF, supports_mapping=False,
                                    fallback_import=fallback)
    npu = TensorHandleFactory("ethosn-import", M.BACKEND, M.DMA_BUF, M.DMA_BUF,
                              fallback_import=fallback)
    return {"CPU": (neon,), "GPU": (cl_import, cl), "NPU": (npu,)}


F, I, C = EdgeStrategy.FALLBACK_IMPORT, EdgeStrategy.EXPORT_TO_TARGET, EdgeStrategy.COPY_TO_TARGET
DESIGN_MATRIX = {  # (source, target): (without the flags, with them, with them and on Neon too)
    ("CPU", "GPU"): (I, I, F), ("GPU", "CPU"): (I, F, F),
    ("CPU", "NPU"): (C, C, C), ("NPU", "CPU"): (C, C, C),
    ("GPU", "NPU"): (I, F, F), ("NPU", "GPU"): (I, F, F),
}


@pytest.mark.parametrize("edge", DESIGN_MATRIX, ids="->".join)
def test_the_designs_matrix_by_its_rule(edge: tuple[str, str]) -> None:
    """"As CPU and GPU can be direct compatible, which means in case of fallback from CPU to GPU,
    it can use MemImportLayer ... In order to test CPU GPU with FallbackMemoryManager, we have to
    add CapabilityClass::FallbackImportMemoryRequired to NeonTensorHandleFactory." CPU <-> NPU
    share no kind (Malloc against DmaBuf): a MemCopy, flags or not."""
    source, target = edge
    for variant, (neon_flag, flag) in enumerate([(False, False), (False, True), (True, True)]):
        factories = _design_factories(neon_flag, flag)
        strategy, factory = choose(factories[source][0], factories[target])
        assert strategy is DESIGN_MATRIX[edge][variant], (edge, variant, strategy)
        if strategy is C:  # "factory->SupportsMapUnmap()": the GPU's ClTensorHandle, not ClImport
            assert factory.supports_mapping
        if strategy is F:
            kind = fallback_kind(factories[source][0], factory)
            assert kind is (M.MALLOC if "CPU" in edge else M.DMA_BUF)
    same = _design_factories(False, True)["GPU"]
    assert choose(same[0], same)[0] is EdgeStrategy.DIRECT_COMPATIBILITY
