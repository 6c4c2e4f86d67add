"""A load on a busy machine (``threads.crowded``: the load average above this process's CPUs)
takes CpuAcc's defaults: the first route of each layer unmeasured, subgraphs layer by layer, nothing
kept in the route cache; a route kept by an earlier load is still taken (issue 27, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import route_cache, threads  # noqa: E402
from backplane.backends.torch.fusion import onednn_graph, patterns  # noqa: E402
from tests.backends.torch.test_onednn_graph import MODEL, _graph_workload, _session  # noqa: E402
from tests.models.test_models import DATA, assert_close, ort_outputs  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(route_cache.CACHE_VARIABLE, str(tmp_path))
    return tmp_path / route_cache.FILE_NAME


@pytest.mark.parametrize("load, cpus, expected", [(3.7, 2, True), (2.0, 2, False), (0.4, 2, False),
                                                  (9.0, 16, False)])
def test_busy_is_more_runnable_tasks_than_cpus(load, cpus, expected, monkeypatch) -> None:
    monkeypatch.setattr(threads, "CROWDED_CHECK", True)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert threads.crowded() is expected


def test_a_busy_load_measures_nothing_and_compiles_by_rule_at_the_first_run(cache, monkeypatch) -> None:
    """A float32 subgraph is compiled by rule (``onednn_graph.by_rule``), untimed, at its first run
    on a busy machine too: run layer by layer there, the small tier's CNNs took 2-3x as long a run
    for the whole session (mobilenet_dw_ts13 0.727 against 0.270 ms, load 3.6)."""
    monkeypatch.setattr(threads, "crowded", lambda: True)
    monkeypatch.setattr(patterns, "seconds", lambda *a, **k: pytest.fail("a route was timed"))
    session = _session(MODEL)
    planned = _graph_workload(session)
    assert planned.route == "onednn_graph" and onednn_graph.AT_FIRST_RUN in planned.why
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    assert_close(session.run(None, feeds), ort_outputs(MODEL, feeds))
    assert _graph_workload(session).route == "onednn_graph"  # compiled, not its layers
    assert _graph_workload(session).why.endswith(onednn_graph.RULE)


def test_a_busy_load_runs_a_timed_subgraph_layer_by_layer_and_keeps_nothing(cache, monkeypatch) -> None:
    """What "auto" would time (a subgraph in reduced precision) is neither timed nor compiled on a
    busy machine, and nothing is kept in the route cache."""
    monkeypatch.setattr(threads, "crowded", lambda: True)
    monkeypatch.setattr(onednn_graph, "by_rule", lambda layer: False)
    monkeypatch.setattr(patterns, "seconds", lambda *a, **k: pytest.fail("a route was timed"))
    session = _session(MODEL)
    assert _graph_workload(session).route == "layers"
    assert not cache.exists()  # no route kept
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    assert_close(session.run(None, feeds), ort_outputs(MODEL, feeds))


def test_a_route_kept_by_a_quiet_load_is_taken_when_busy(cache, monkeypatch) -> None:
    session = _session(MODEL)
    session.run(None, dict(np.load(DATA / "tiny_mobilenet_v3.npz")))  # compiled, and kept
    quiet = _graph_workload(session).route  # taken by rule
    assert cache.exists()
    monkeypatch.setattr(threads, "crowded", lambda: True)
    monkeypatch.setattr(patterns, "seconds", lambda *a, **k: pytest.fail("a route was timed"))
    assert _graph_workload(_session(MODEL)).route == quiet


def test_the_cli_says_how_each_compiled_subgraph_runs_and_why(cache, monkeypatch) -> None:
    from backplane.cli import compiled_routes

    session = _session(MODEL)
    (planned,) = compiled_routes(session)
    assert onednn_graph.AT_FIRST_RUN in planned  # compiled at its first run
    session.run(None, dict(np.load(DATA / "tiny_mobilenet_v3.npz")))
    (measured,) = compiled_routes(session)
    assert measured.startswith("OneDnnGraph[") and measured.endswith(onednn_graph.RULE)  # untimed
    (kept,) = compiled_routes(_session(MODEL))
    assert "kept in the route cache" in kept
    monkeypatch.setattr(threads, "crowded", lambda: True)
    (forced,) = compiled_routes(_session(MODEL, "layers"))
    assert forced.endswith("layers, CpuAcc.compile=layers")


@pytest.mark.parametrize("static", [True, False])
def test_a_busy_load_traces_a_long_subgraph_at_its_first_run_untimed(cache, monkeypatch, static) -> None:
    """A subgraph "auto" would trace and time (a transformer block, no convolution) is traced
    untimed at its first run on a busy machine where it holds ``traced.UNTIMED_LAYERS`` layers or
    more (left layer by layer, encoder4_plain_dyn18 ran 1.73 ms a run against 0.35 traced, load 4),
    and nothing is kept in the route cache."""
    from backplane.backends.torch.fusion import traced
    from tests.backends.torch.test_traced import _inner_layers, _session as traced_session, \
        _x, attention_block

    monkeypatch.setattr(threads, "crowded", lambda: True)
    monkeypatch.setattr(patterns, "seconds", lambda *a, **k: pytest.fail("a route was timed"))
    model = attention_block(2, 5) if static else attention_block()
    x = _x((2, 5, 16))
    x[1, 2, 3] = np.nan
    session = traced_session(model)
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    found = [(lay, work) for lay, work in _inner_layers(session) if lay.op_type == "Traced"]
    assert len(found) == 1 and len(found[0][0].attrs["layers"]) >= traced.UNTIMED_LAYERS
    assert found[0][1].route == "traced" and "untimed" in found[0][1].why
    assert not cache.exists()
