"""NumPy's BLAS on one thread for CpuRef's workloads in a network that also runs a backend with a
pool of host threads of its own (``runtime/host_threads.py``); NumPy's own threads everywhere else."""

from __future__ import annotations

import numpy as np
import pytest

from backplane import InferenceSession
from backplane.runtime import host_threads
from tests.models.test_models import DATA, assert_close, ort_outputs

libraries = host_threads.blas_libraries()
needs_blas = pytest.mark.skipif(not libraries, reason="threadpoolctl finds no BLAS library here")


@pytest.fixture
def two_blas_threads():
    counts = [lib.num_threads for lib in libraries]
    for lib in libraries:
        lib.set_num_threads(2)
    yield
    for lib, count in zip(libraries, counts):
        lib.set_num_threads(count)


def _steps(session: InferenceSession) -> list:
    loaded = session.runtime.network(session.network_id)
    return [(layer.backend, step.workload) for step, layer in zip(loaded.steps, loaded.layers)]


@needs_blas
def test_a_call_runs_on_one_blas_thread_and_puts_the_count_back(two_blas_threads) -> None:
    seen = []
    wrapped = host_threads.OneBlasThread(lambda x: seen.append([lib.num_threads for lib in libraries])
                                         or (x,), libraries)
    assert wrapped(1) == (1,)
    assert seen == [[1] * len(libraries)]
    assert [lib.num_threads for lib in libraries] == [2] * len(libraries)
    with pytest.raises(ZeroDivisionError):  # put back when the workload fails too
        host_threads.OneBlasThread(lambda: 1 / 0, libraries)()
    assert [lib.num_threads for lib in libraries] == [2] * len(libraries)


@needs_blas
def test_cpuref_beside_cpuacc_runs_on_one_blas_thread_and_matches(two_blas_threads) -> None:
    pytest.importorskip("torch")
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    convs = [lay.name for lay in InferenceSession(path, backends=["CpuRef"]).optimized.graph.layers
             if lay.op_type == "Conv"]
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], pins={convs[3]: "CpuRef"})
    steps = _steps(session)
    assert {b for b, _ in steps} >= {"CpuAcc", "CpuRef"}
    assert all(isinstance(w, host_threads.OneBlasThread) == (b == "CpuRef") for b, w in steps)
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
    assert [lib.num_threads for lib in libraries] == [2] * len(libraries)


def test_cpuref_alone_keeps_numpy_threads() -> None:
    session = InferenceSession(DATA / "tiny_bert.onnx", backends=["CpuRef"])
    assert not any(isinstance(w, host_threads.OneBlasThread) for _, w in _steps(session))


def test_the_backends_name_their_pools() -> None:
    from backplane.backends.reference.backend import CpuRef

    assert CpuRef().capabilities()["HostThreads"] == "blas"
    torch_backend = pytest.importorskip("backplane.backends.torch.backend")
    assert torch_backend.CpuAcc().capabilities()["HostThreads"] == "openmp"


@needs_blas
def test_measured_placement_times_cpuref_as_a_mixed_run_runs_it(two_blas_threads,
                                                               monkeypatch) -> None:
    """Beside CpuAcc, a CpuRef candidate is timed on one BLAS thread; alone, on NumPy's."""
    pytest.importorskip("torch")
    from backplane import OptimizerOptions
    from backplane.optimizer import measured

    made = []
    original = host_threads.OneBlasThread

    def spy(workload, libs):
        made.append(workload)
        return original(workload, libs)

    monkeypatch.setattr(host_threads, "OneBlasThread", spy)
    measured._TIMES.clear()
    path = DATA / "tiny_mobilenet_v3.onnx"
    InferenceSession(path, backends=["CpuRef"],
                     optimizer_options=OptimizerOptions(placement="measured"))
    assert made == []
    InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                     optimizer_options=OptimizerOptions(placement="measured"))
    assert any("_prepare" in getattr(w, "__qualname__", "") for w in made)  # a candidate's runner
