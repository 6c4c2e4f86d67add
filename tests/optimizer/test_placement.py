"""Placement: layers split by support, reasons kept, pins, copies, errors, outputs equal CpuRef alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pytest

from backplane import InferenceSession, OptimizationError, import_onnx, optimize
from backplane.backends.api.backend import Backend
from backplane.backends.api.memory import MemorySource, TensorHandleFactory
from backplane.backends.registry import registry
from tests.conftest import PartialBackend, small_cnn_model

X = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)


def test_cpuref_alone_runs_every_layer() -> None:
    session = InferenceSession(small_cnn_model(), backends=["CpuRef"])
    assert set(session.report.counts()) == {"CpuRef"}
    (probs,) = session.run(None, {"x": X})
    assert probs.shape == (1, 5) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)


def test_partial_backend_takes_what_it_supports_and_cpuref_the_rest(partial_backends, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="backplane.optimizer"):
        session = InferenceSession(small_cnn_model(), backends=["TestPartial", "CpuRef"])
    report = session.report
    placed = {name: p.backend for name, p in report.layers.items()}
    assert placed == {"conv1": "TestPartial", "relu1": "TestPartial", "conv2": "TestPartial",
                      "skip": "TestPartial", "relu2": "TestPartial", "pool": "CpuRef",
                      "flatten": "CpuRef", "fc": "TestPartial", "softmax": "CpuRef"}
    assert report.layers["pool"].refusals == [
        ("TestPartial", "GlobalAveragePool is not one of Conv, Relu, Add, MatMul, Gemm, Mul")]
    assert report.layers["conv1"].refusals == []
    assert ("Layer of type Softmax is not supported on requested backend TestPartial (reason: "
            "Softmax is not one of Conv, Relu, Add, MatMul, Gemm, Mul), falling back to the next "
            "backend") in report.warnings  # each layer's in the report; the log has the summary
    assert ("1 layer of type Softmax not supported on TestPartial (reason: Softmax is not one of "
            "Conv, Relu, Add, MatMul, Gemm, Mul), fell back to the next backend") in caplog.messages
    assert report.copies == []  # both backends share host memory
    expected = InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], expected[0])


def test_subgraphs_are_per_backend_and_acyclic(partial_backends) -> None:
    session = InferenceSession(small_cnn_model(), backends=["TestPartial", "CpuRef"])
    records = [(s.backend, s.layers) for s in session.report.subgraphs]
    assert records == [("TestPartial", ["conv1", "relu1", "conv2", "skip", "relu2"]),
                       ("CpuRef", ["pool", "flatten"]), ("TestPartial", ["fc"]),
                       ("CpuRef", ["softmax"])]


def test_private_memory_gets_a_mem_copy_on_each_crossing(partial_backends) -> None:
    session = InferenceSession(small_cnn_model(), backends=["TestPrivate", "CpuRef"])
    copies = [(c.tensor, c.source, c.target, c.strategy, c.nbytes) for c in session.report.copies]
    assert copies == [("x", "user", "TestPrivate", "copy", 3 * 8 * 8 * 4),
                      ("r2", "TestPrivate", "CpuRef", "copy", 4 * 8 * 8 * 4),
                      ("f", "CpuRef", "TestPrivate", "copy", 4 * 4),
                      ("logits", "TestPrivate", "CpuRef", "copy", 5 * 4)]
    mem_copies = [lay for lay in session.optimized.graph.layers if lay.op_type == "MemCopy"]
    assert len(mem_copies) == 4 and all(lay.backend == "builtin" for lay in mem_copies)
    expected = InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], expected[0])


class MappedBackend(PartialBackend):
    """Tensors of a kind of its own, but in host memory that it imports and exports: crossings are
    zero-copy MemImports (its views record what they were handed)."""

    id = "TestMapped"
    handed: list[np.ndarray] = []

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        def import_(array: np.ndarray) -> np.ndarray:
            MappedBackend.handed.append(array)
            return array.view()

        return (TensorHandleFactory("test-mapped", MemorySource.MALLOC, MemorySource.MALLOC,
                                    MemorySource.MALLOC, import_=import_),)


def test_host_memory_of_another_kind_is_imported_not_copied() -> None:
    with registry.temporarily(MappedBackend.id, MappedBackend):
        session = InferenceSession(small_cnn_model(), backends=["TestMapped", "CpuRef"])
    crossings = [(c.tensor, c.source, c.target, c.strategy) for c in session.report.copies]
    assert crossings == [("x", "user", "TestMapped", "import"), ("r2", "TestMapped", "CpuRef", "import"),
                         ("f", "CpuRef", "TestMapped", "import"),
                         ("logits", "TestMapped", "CpuRef", "import")]
    glue = [lay.op_type for lay in session.optimized.graph.layers if lay.backend == "builtin"]
    assert glue == ["MemImport"] * 4
    MappedBackend.handed.clear()
    (probs,) = session.run(None, {"x": X})
    assert MappedBackend.handed[0] is X or np.shares_memory(MappedBackend.handed[0], X)
    expected = InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})
    np.testing.assert_array_equal(probs, expected[0])


def test_pins_by_layer_name_and_by_op_type(partial_backends) -> None:
    pins = {"conv2": "CpuRef", "Relu": "CpuRef"}
    session = InferenceSession(small_cnn_model(), backends=["TestPartial", "CpuRef"], pins=pins)
    placed = {name: p.backend for name, p in session.report.layers.items()}
    assert placed["conv2"] == "CpuRef" and placed["conv1"] == "TestPartial"
    assert placed["relu1"] == placed["relu2"] == "CpuRef"
    assert session.report.layers["conv2"].pinned == "CpuRef"


def test_pin_to_a_backend_that_refuses_falls_back_with_its_reason(partial_backends) -> None:
    session = InferenceSession(small_cnn_model(), backends=["CpuRef"], pins={"softmax": "TestPartial"})
    placement = session.report.layers["softmax"]
    assert placement.backend == "CpuRef"
    assert placement.refusals[0][0] == "TestPartial"


def test_no_backend_supports_a_layer_names_it_and_every_reason(partial_backends) -> None:
    with pytest.raises(OptimizationError) as info:
        InferenceSession(small_cnn_model(), backends=["TestPartial"])
    message = str(info.value)
    assert "layer 'pool' (GlobalAveragePool, opset 17)" in message
    assert "TestPartial: GlobalAveragePool is not one of" in message


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(OptimizationError, match=r"unknown backend 'NoSuch'. Known backends are: .*CpuRef"):
        optimize(import_onnx(small_cnn_model()), ["NoSuch", "CpuRef"])


class Unavailable(Backend):
    id = "TestGone"

    def availability(self):
        from backplane.backends.api.backend import unsupported
        return unsupported("no device here")


def test_none_of_the_preferred_backends_available() -> None:
    with registry.temporarily(Unavailable.id, Unavailable):
        with pytest.raises(OptimizationError, match="none of the preferred backends .*TestGone: no "
                                                    "device here.*Registered backends are"):
            optimize(import_onnx(small_cnn_model()), ["TestGone"])
        net = optimize(import_onnx(small_cnn_model()), ["TestGone", "CpuRef"])
        assert net.report.unavailable == {"TestGone": "no device here"}


def test_the_users_graph_is_not_modified(partial_backends) -> None:
    graph = import_onnx(small_cnn_model())
    before = repr(graph)
    optimize(graph, ["TestPrivate", "CpuRef"])
    assert repr(graph) == before


def test_report_prints_as_a_table(partial_backends) -> None:
    text = str(InferenceSession(small_cnn_model(), backends=["TestPrivate", "CpuRef"]).report)
    assert "GlobalAveragePool is not one of" in text and "Tensors crossing backends" in text
    assert "9 layers (TestPrivate: 6, CpuRef: 3); 4 subgraphs" in text
    # the crossings said once, as the page says them: between backends, then the caller's
    assert "3 tensors copied and 0 imported between backends (1,060 bytes copied)" in text
    assert " copies" not in text


def test_a_mem_copy_between_two_non_host_memories_goes_through_both_sides() -> None:
    """A device -> torch-CPU-like crossing: copy_out makes a host array, copy_in wraps it in the
    target's own handle type (a MemCopy must not hand the target a bare host array)."""
    from backplane.backends.builtin.backend import make_mem_copy

    class Handle:
        def __init__(self, array: np.ndarray) -> None:
            self.array = array

    device = TensorHandleFactory("test-device", MemorySource.BACKEND, copy_out=lambda h: h.array.copy())
    mapped = TensorHandleFactory("test-mapped-cpu", MemorySource.MALLOC, copy_in=Handle)
    (moved,) = make_mem_copy(device, mapped)(Handle(np.arange(3.0)))
    assert isinstance(moved, Handle)
    np.testing.assert_array_equal(moved.array, np.arange(3.0))
