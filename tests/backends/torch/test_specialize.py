"""A CpuAcc (or GpuAcc) subgraph with free input dimensions becomes one Specialized layer: per input
signature it is built as a static model would be at load (folded, fused, compiled or captured), the
least recently used signature out past the limit; each size matches CpuRef."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models.test_models import DATA  # noqa: E402

SIZES = [(1, 3, 64, 64), (2, 3, 48, 80), (1, 3, 33, 31)]


def free_mobilenet() -> bytes:
    """tiny_mobilenet_v3 with its batch, height and width made free, as exporters write them."""
    model = onnx.load(DATA / "tiny_mobilenet_v3.onnx")
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for index, name in ((0, "N"), (2, "H"), (3, "W")):
        dims[index].dim_param = name
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    del model.graph.value_info[:]
    return model.SerializeToString()


def _session(backends: list[str], **options) -> InferenceSession:
    return InferenceSession(free_mobilenet(), backends=backends,
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _specialized(session: InferenceSession):
    loaded = session.runtime.network(session.network_id)
    (workload,) = [s.workload for s, lay in zip(loaded.steps, loaded.layers)
                   if lay.op_type == "Specialized"]
    return workload


def _feeds(shape) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)}


def _check(session: InferenceSession, shape, tolerance: float = 1e-4) -> None:
    reference = InferenceSession(free_mobilenet(), backends=["CpuRef"])
    (want,) = reference.run(None, _feeds(shape))
    (got,) = session.run(None, _feeds(shape))
    assert got.shape == want.shape == (shape[0], 10)
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * float(np.abs(want).max()))


def test_each_signature_is_built_fused_and_matches_cpuref() -> None:
    session = _session(["CpuAcc", "CpuRef"])
    assert [lay.op_type for lay in session.optimized.graph.layers
            if lay.backend == "CpuAcc"] == ["Specialized"]
    workload = _specialized(session)
    for shape in SIZES + SIZES[:1]:
        _check(session, shape)
    assert len(workload.built) == len(SIZES)
    for runner in workload.built.values():  # what a static model gets at load
        assert {lay.op_type for lay in runner.graph.layers} & {"OneDnnGraph", "FusedConv"}


def test_the_least_recently_used_signature_goes_past_the_limit() -> None:
    session = _session(["CpuAcc", "CpuRef"], **{"CpuAcc.specialize": 2})
    workload = _specialized(session)
    first, second, third = SIZES
    for shape in (first, second, first, third):  # second is the least recently used at third
        session.run(None, _feeds(shape))
    assert [key[0][0] for key in workload.built] == [first, third]


def test_specialize_zero_keeps_the_layers_shape_generic() -> None:
    session = _session(["CpuAcc", "CpuRef"], **{"CpuAcc.specialize": 0})
    ops = {lay.op_type for lay in session.optimized.graph.layers if lay.backend == "CpuAcc"}
    assert "Specialized" not in ops and "Conv" in ops
    _check(session, SIZES[1])


def test_a_build_that_fails_runs_the_layers_one_by_one(monkeypatch, caplog) -> None:
    from backplane.optimizer import passes

    session = _session(["CpuAcc", "CpuRef"])
    feeds = _feeds(SIZES[1])
    (want,) = InferenceSession(free_mobilenet(), backends=["CpuRef"]).run(None, feeds)

    def broken(graph):
        raise RuntimeError("folding is broken")

    monkeypatch.setattr(passes, "fold_constants", broken)  # the builds fold first
    (got,) = session.run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    assert "no build for input shapes [(2, 3, 48, 80)]" in caplog.text
    (runner,) = _specialized(session).built.values()
    assert "Conv" in {lay.op_type for lay in runner.graph.layers}  # the layers as they came


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_signatures_are_captured_graphs() -> None:
    session = _session(["GpuAcc", "CpuRef"])
    assert session.runtime.network(session.network_id).exclusive  # captured graphs inside
    for shape in SIZES:
        _check(session, shape, tolerance=1e-3)
    runners = _specialized(session).built.values()
    assert all("CudaGraph" in {lay.op_type for lay in r.graph.layers} for r in runners)
