"""A OneDnnGraph compiled at its first run, not at load (``onednn_graph.at_first_run``; issue 27,
item 5): a load traces and compiles nothing, the first run traces, compiles and checks once and
gives CpuRef's values, and a session through the compile cache compiles once in all."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import compiled, onednn_graph  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_graph_rule import _cnn, _graph_work  # noqa: E402

X = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per subgraph traced for oneDNN Graph (``onednn_graph._trace``): the torch thread
    count it was traced at."""
    made: list[int] = []
    real = onednn_graph._trace
    monkeypatch.setattr(onednn_graph, "_trace",
                        lambda *a, **k: made.append(torch.get_num_threads()) or real(*a, **k))
    return made


def _session(model: object, **options: object) -> InferenceSession:
    """A CpuAcc session of ``model`` without the route cache (a choice written there would be
    another test's load's), nor the native route (``CpuAcc.native``: no compile to count)."""
    options = {"CpuAcc.route_cache": False, "CpuAcc.native": "off", **options}
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _reference() -> list[np.ndarray]:
    return InferenceSession(_cnn(), backends=["CpuRef"]).run(None, {"x": X})


def _close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))


@pytest.mark.parametrize("mode", ["auto", "onednn_graph"])
def test_a_load_compiles_nothing_and_the_first_run_compiles_once(mode: str,
                                                                 traces: list[int]) -> None:
    session = _session(_cnn(), **{"CpuAcc.compile": mode})
    work = _graph_work(session)
    assert isinstance(work, compiled.AtFirstRun) and work.built is None
    assert traces == [] and work.route == "onednn_graph"
    assert onednn_graph.AT_FIRST_RUN in work.why
    with pytest.raises(AttributeError):
        work.modules  # noqa: B018  # no module yet
    want = _reference()
    _close(session.run(None, {"x": X}), want)
    assert traces == [1] and work.built is not None  # traced once, at one thread
    assert work.route == "onednn_graph" and onednn_graph.AT_FIRST_RUN not in work.why
    assert set(work.modules.modules) == {torch.get_num_threads()}  # compiled at the run's count
    _close(session.run(None, {"x": X}), want)
    assert traces == [1]


def test_a_first_run_whose_compile_fails_runs_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check moved with the compile: a compile that fails at the first run leaves the layers
    (traced without the fuser, or one by one), and the run still gives CpuRef's values."""
    monkeypatch.setattr(onednn_graph, "_compiled", lambda *args: None)
    session = _session(_cnn())
    work = _graph_work(session)
    assert work.route == "onednn_graph"  # planned
    _close(session.run(None, {"x": X}), _reference())
    assert work.route in ("traced", "layers")


def test_two_threads_at_the_first_run_compile_once(traces: list[int]) -> None:
    session = _session(_cnn())
    results: list[list[np.ndarray]] = []
    threads = [threading.Thread(target=lambda: results.append(session.run(None, {"x": X})))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert traces == [1] and len(results) == 2
    for got in results:
        _close(got, _reference())


def test_a_session_through_the_compile_cache_compiles_once(tmp_path: Path,
                                                           traces: list[int]) -> None:
    """With a compile cache (``$BACKPLANE_COMPILE_CACHE``, bench/wild.py's), a load compiles the
    model into an artifact and loads that: the compile's own load compiled the OneDnnGraph, then
    the artifact's first run traced and compiled it again. Now only the first run does."""
    path = tmp_path / "cnn.onnx"
    path.write_bytes(_cnn())
    session = InferenceSession(path, backends=[("CpuAcc", {"route_cache": False, "native": "off"}),
                                               "CpuRef"], cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.bpl"))) == 1
    assert traces == []
    want = _reference()
    for _ in range(2):
        _close(session.run(None, {"x": X}), want)
    assert traces == [1]
