"""CpuAcc's loads leave their measuring and compiling to a background thread
(``CpuAcc.background``, ``backends/torch/background.py``; issue 27, item 5): the load takes the
unmeasured routes and the layers one by one at once, the background makes what a quiet load would
and swaps it in; routes measured while the network ran are used, not kept."""

from __future__ import annotations

import gc
import threading
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession, Runtime, RuntimeOptions  # noqa: E402
from backplane.backends.api.backend import OptionError  # noqa: E402
from backplane.backends.torch import background, route_cache  # noqa: E402
from backplane.backends.torch.fusion import patterns  # noqa: E402
from backplane.runtime.loaded_network import WorkloadError  # noqa: E402
from tests.backends.torch.test_onednn_graph import MODEL, _graph_workload  # noqa: E402
from tests.models.test_models import DATA, assert_close, ort_outputs  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(route_cache.CACHE_VARIABLE, str(tmp_path))
    return tmp_path / route_cache.FILE_NAME


@pytest.fixture
def held_back():
    """The background thread held at a job of its own until the test sets the event it yields
    (so the test sees the load's stand-ins before any swap); set and drained after the test."""
    release = threading.Event()
    gate = background.Swapped(lambda: ())
    background._worker().put(weakref.ref(gate), lambda: release.wait(30) and gate.work,
                             "the test's gate", torch.get_num_threads())
    yield release
    release.set()
    assert background.wait(120)
    del gate


def _session(**options) -> InferenceSession:
    return InferenceSession(MODEL, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.background": True, **options})))


def test_a_load_takes_the_layers_at_once_and_the_background_swaps_the_compiled_graph_in(
        cache, held_back, monkeypatch) -> None:
    timed = []
    real_seconds = patterns.seconds
    monkeypatch.setattr(patterns, "seconds",
                        lambda *a, **k: timed.append(threading.current_thread().name)
                        or real_seconds(*a, **k))
    session = _session()
    workload = _graph_workload(session)
    assert workload.route == "layers" and workload.why.endswith(patterns.DEFERRED)
    assert timed == []  # nothing measured by the load itself
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    expected = ort_outputs(MODEL, feeds)
    assert_close(session.run(None, feeds), expected)  # the stand-in's run
    held_back.set()
    assert background.wait(120)
    workload = _graph_workload(session)
    assert workload.route in ("onednn_graph", "layers")
    assert patterns.DEFERRED not in workload.why and "measured fastest" in workload.why
    assert set(timed) == {"backplane-background"}  # measured there, not in the loading thread
    assert_close(session.run(None, feeds), expected)  # the swapped-in workload's run


def test_routes_measured_while_the_network_ran_are_not_kept(cache, held_back) -> None:
    session = _session()
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    workload = _graph_workload(session)

    def run_meanwhile(make):
        def made():
            session.run(None, feeds)  # a run while the background measures
            return make()
        return made

    job = background._worker().jobs.queue[-1]  # the load's job, behind the gate
    background._worker().jobs.queue[-1] = (job[0], run_meanwhile(job[1]), *job[2:])
    held_back.set()
    assert background.wait(120)
    assert patterns.DEFERRED not in _graph_workload(session).why
    assert not cache.exists()  # measured under its own runs: used, not kept
    assert workload is _graph_workload(session)  # the same Swapped, its work replaced


def test_routes_measured_on_a_quiet_process_are_kept_and_the_next_load_takes_them(
        cache, held_back) -> None:
    session = _session()
    held_back.set()
    assert background.wait(120)
    assert cache.exists()
    assert "onednn_graph" in route_cache._entries(cache).values() or \
        "layers" in route_cache._entries(cache).values()  # the graph's route among them
    del session


def test_a_network_unloaded_before_its_turn_is_not_compiled(cache, held_back) -> None:
    made = []
    session = _session()
    job = background._worker().jobs.queue[-1]
    background._worker().jobs.queue[-1] = (job[0], lambda: made.append(1) or job[1](), *job[2:])
    session.close()
    del session, job
    gc.collect()
    held_back.set()
    assert background.wait(120)
    assert made == []


def test_a_background_failure_leaves_the_stand_in_running(cache, held_back, caplog) -> None:
    session = _session()
    job = background._worker().jobs.queue[-1]
    background._worker().jobs.queue[-1] = (job[0], lambda: 1 / 0, *job[2:])
    held_back.set()
    assert background.wait(120)
    assert "ZeroDivisionError" in caplog.text and "its layers run as loaded" in caplog.text
    assert _graph_workload(session).route == "layers"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    assert_close(session.run(None, feeds), ort_outputs(MODEL, feeds))


def test_off_the_load_measures_and_compiles_itself(cache) -> None:
    session = _session(**{"CpuAcc.background": False})
    assert "measured fastest at load" in _graph_workload(session).why
    assert not isinstance(_graph_workload(session), background.Swapped)


def test_an_artifacts_kept_routes_are_measured_at_load(cache) -> None:
    token = route_cache.KEPT.set({})
    try:
        session = _session()
    finally:
        route_cache.KEPT.reset(token)
    assert patterns.DEFERRED not in _graph_workload(session).why


def test_the_option_takes_a_boolean_only(cache) -> None:
    with pytest.raises(OptionError, match=r"CpuAcc.background 'yes' is not one of True, False"):
        background.wanted(SimpleNamespace(options={"CpuAcc.background": "yes"}))
    with pytest.raises(WorkloadError, match=r"CpuAcc.background 'yes' is not one of True, False"):
        _session(**{"CpuAcc.background": "yes"})


def test_a_small_builds_threads_are_chosen_after_the_background_swapped_its_workloads_in(
        cache, held_back) -> None:
    """small.fewer_threads times a build: on stand-ins (the layers one by one) it would choose by
    what will not run, so the choice waits for the background (``small.Undecided``)."""
    from backplane.backends.torch import small

    path = DATA / "corpus" / "resnet_basic_ts16.onnx"  # free H and W: a Specialized build per size
    feeds = dict(np.load(DATA / "corpus" / "resnet_basic_ts16.s0.npz"))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               runtime=Runtime(RuntimeOptions(backend_options={
                                   "CpuAcc.background": True, "CpuAcc.threads": 2})))
    expected = ort_outputs(path, feeds)
    assert_close(session.run(None, feeds), expected)  # builds the signature, behind the gate
    loaded = session.runtime.network(session.network_id)
    (built,) = [s.workload.built for s in loaded.steps if hasattr(s.workload, "built")]
    (undecided,) = built.values()
    assert isinstance(undecided, small.Undecided) and undecided.decided is None
    assert_close(session.run(None, feeds), expected)
    assert undecided.decided is None  # still behind the gate: the caller's threads
    held_back.set()
    assert background.wait(120)
    assert_close(session.run(None, feeds), expected)
    assert undecided.decided is not None  # chosen once, on the swapped-in workloads
    assert isinstance(undecided.decided, small.OneThread) or undecided.decided is undecided.work
