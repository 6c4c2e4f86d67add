"""CpuAcc's loads leave their building to a background thread (``CpuAcc.background``,
``backends/torch/background.py``; issue 27, item 5): the load takes the unmeasured routes and the
layers one by one at once, the background builds every candidate and swaps them in, and the
network's runs time them in their own thread (``trials.py``); a time taken beside the background's
work does not count, and a busy machine's background compiles untimed and keeps nothing."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession, Runtime, RuntimeOptions  # noqa: E402
from backplane.backends.api.backend import OptionError  # noqa: E402
from backplane.backends.torch import background, route_cache, trials  # noqa: E402
from backplane.backends.torch.fusion import onednn_graph, patterns  # noqa: E402
from backplane.runtime.loaded_network import WorkloadError  # noqa: E402
from tests.backends.torch.test_onednn_graph import MODEL, _graph_workload  # noqa: E402
from tests.models.test_models import DATA, assert_close, ort_outputs  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(route_cache.CACHE_VARIABLE, str(tmp_path))
    return tmp_path / route_cache.FILE_NAME


@pytest.fixture(autouse=True)
def no_sessions_before():
    """Sessions of earlier tests gone: ``background.settled`` waits for every live Trial."""
    gc.collect()


@pytest.fixture
def held_back():
    """The background thread held at a job of its own until the test sets the event it yields
    (so the test sees the load's stand-ins before any swap); set and drained after the test."""
    release = threading.Event()
    gate = background.Swapped(lambda: ())
    background._worker().put(background._swap, (
        weakref.ref(gate), lambda: release.wait(30) and gate.work, "the test's gate",
        torch.get_num_threads()), "the test's gate")
    yield release
    release.set()
    assert background.wait(120)
    del gate
    gc.collect()  # a test's sessions and their Trials go (``background.settled`` waits for none)


def _session(**options) -> InferenceSession:
    return InferenceSession(MODEL, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.background": True, **options})))


def _feeds() -> dict[str, np.ndarray]:
    return dict(np.load(DATA / "tiny_mobilenet_v3.npz"))


def _trials_in(workload, chosen_only: bool = False) -> list:
    """Every Trial of a swapped-in workload, nested ones included (a OneDnnGraph's layers); with
    ``chosen_only``, the Trials a run calls now: of a chosen Trial, the nested ones of its chosen
    candidate only (a candidate not chosen keeps its own undecided while its Trial watches the
    thread count)."""
    found, todo = [], [workload]
    while todo:
        item = todo.pop()
        while not isinstance(item, trials.Trial) and hasattr(item, "work"):
            item = item.work  # Governed, Swapped
        if isinstance(item, trials.Trial):
            found.append(item)
            names = [n for n, run in item.candidates.items() if run is item.chosen]
            todo += [t for n in (names if chosen_only and names else item.children)
                     for t in item.children.get(n, [])]
    return found


def _run_until_settled(session, feeds, expected, most: int = 400) -> int:
    """Runs until the background is done and every route is chosen; each run's outputs checked."""
    assert background.wait(120)
    runs = 0
    while not background.settled():
        assert_close(session.run(None, feeds), expected)
        runs += 1
        assert runs < most
    return runs


def test_a_load_takes_the_layers_at_once_and_the_runs_time_the_candidates(
        cache, held_back, monkeypatch) -> None:
    measured = []
    monkeypatch.setattr(patterns, "seconds", lambda *a, **k: measured.append(1))
    counted = []
    real_record = trials.Trial._record
    monkeypatch.setattr(trials.Trial, "_record", lambda self, name, elapsed, count: counted.append(
        (threading.current_thread().name, elapsed is not None)) or real_record(self, name,
                                                                               elapsed, count))
    session = _session()
    workload = _graph_workload(session)
    assert workload.route == "layers" and workload.why.endswith(patterns.DEFERRED)
    convolutions = [w for lay, w in workload.inner if lay.op_type == "FusedConv"]
    assert convolutions and all(w.why.startswith("torch: ") for w in convolutions)  # no packing
    feeds = _feeds()
    expected = ort_outputs(MODEL, feeds)
    assert_close(session.run(None, feeds), expected)  # the stand-in's run
    held_back.set()
    assert background.wait(120)
    (trial,) = [t for t in _trials_in(_graph_workload(session)) if "onednn_graph" in t.candidates]
    assert trial.chosen is None and "being timed in the running thread" in trial.why
    assert _run_until_settled(session, feeds, expected) > 0
    assert measured == []  # nothing timed by `fastest`: neither at load nor in the background
    assert {name for name, timed in counted if timed} == {"MainThread"}  # only the runs' times
    assert "timed fastest in the running thread" in _graph_workload(session).why
    assert _graph_workload(session).route in ("onednn_graph", "layers")
    assert set(route_cache._entries(cache).values()) & {"onednn_graph", "layers"}  # kept
    assert_close(session.run(None, feeds), expected)


def test_settle_runs_the_network_until_its_routes_are_chosen(cache) -> None:
    """Its own network's: another session, loaded and never run, does not hold it back."""
    idle = _session()
    session = _session()
    feeds = _feeds()
    runs = []
    assert background.settle(lambda: runs.append(session.run(None, feeds)), timeout=120)
    assert runs and "timed fastest in the running thread" in _graph_workload(session).why
    assert not background.settled()  # the idle session's Trials have not chosen
    assert background.settle(lambda: idle.run(None, feeds), timeout=120)
    assert background.settled()


def test_a_run_beside_the_backgrounds_work_is_not_timed(cache, monkeypatch) -> None:
    """The runs made while the background thread builds count for nothing; after MOST_CALLS runs
    so, the Trial takes what it has and keeps nothing in the route cache."""
    monkeypatch.setattr(trials, "MOST_CALLS", 12)
    session = _session()
    feeds = _feeds()
    expected = ort_outputs(MODEL, feeds)
    assert background.wait(120)
    release = threading.Event()
    gate = background.Swapped(lambda: ())
    background._worker().put(background._swap, (
        weakref.ref(gate), lambda: release.wait(30) and gate.work, "a job beside the runs",
        torch.get_num_threads()), "a job beside the runs")
    try:
        while background.epoch() is not None:  # the job has begun
            threading.Event().wait(0.01)
        for _ in range(14):
            assert_close(session.run(None, feeds), expected)
    finally:
        release.set()
        assert background.wait(120)
    found = _trials_in(_graph_workload(session), chosen_only=True)
    assert found and all(t.chosen is not None for t in found)
    assert all(s == [] for t in found for s in t.samples.values())
    assert "no call could be timed; not kept" in _graph_workload(session).why
    assert not cache.exists()


def test_a_trial_takes_the_fastest_by_median_and_waits_for_its_nested_trials() -> None:
    # an earlier test's background job still running would make every timing not count (and
    # the Trials fall back to their first candidates): seen once on the GPU machine with -n 14
    assert background.wait(120)
    def pause(seconds):
        def run(*values):  # spins: a timed wait of 0.5 ms woke after 4 on the GPU machine at -n 14
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
            return values
        return run

    quick = pause(0.0005)
    inner = trials.Trial({"slow": pause(0.004), "quick": quick}, {}, None)
    outer = trials.Trial({"nested": inner, "plain": pause(0.003)}, {"nested": [inner]}, None)
    calls = 0
    while not outer.settled():
        assert outer(1, 2) == (1, 2)  # every call's output is one candidate's
        calls += 1
        assert calls < 100 + 2 * trials.WATCH  # each watches the thread count after its choice
    assert inner.chosen is quick and "quick: timed fastest" in quick.why
    assert "nested: timed fastest" in outer.why  # 0.5 ms once its inner Trial chose, against 3
    assert len(outer.samples["nested"]) == trials.SAMPLES  # none taken while inner chose


def test_a_trial_begins_its_samples_again_at_another_thread_count() -> None:
    trial = trials.Trial({"a": lambda: (), "b": lambda: ()}, {}, None)
    for _ in range(3):
        trial._record("a", 0.001, 2)
    trial._record("b", 0.001, 1)  # the thread policy went to one thread
    assert trial.at == 1 and trial.samples == {"a": [], "b": []} and trial.chosen is None


def test_a_choice_is_timed_again_at_the_thread_count_its_partition_then_runs_at() -> None:
    """Chosen at 2 threads, then run at one (``small.fewer_threads``' choice for its partition):
    the candidates are timed again there; a comparison of counts (4 calls in a row at one, then
    alternating) does not begin them again."""
    from backplane.backends.torch.small import at_threads

    def at(seconds: dict[int, float]):
        def run(*values):
            threading.Event().wait(seconds[torch.get_num_threads()])
            return values
        return run

    wide, narrow = at({2: 0.0005, 1: 0.004}), at({2: 0.004, 1: 0.0005})
    trial = trials.Trial({"wide": wide, "narrow": narrow}, {}, None)
    with at_threads(2):
        while trial.chosen is None:
            trial(1)
    assert trial.chosen is wide and trial.at == 2
    for count in [1, 1, 1, 1] + [2, 1] * 5:  # what fewer_threads' comparison calls
        with at_threads(count):
            trial(1)
    assert trial.chosen is wide and not trial.final
    calls = 0
    with at_threads(1):
        while not trial.settled():
            assert trial(1) == (1,)
            calls += 1
            assert calls < 100 + trials.WATCH
    assert trial.chosen is narrow and trial.at == 1 and list(trial.candidates) == ["narrow"]
    assert "narrow: timed fastest" in narrow.why


def test_on_a_busy_machine_the_background_compiles_untimed_and_keeps_nothing(
        cache, monkeypatch) -> None:
    from backplane.backends.torch import threads

    monkeypatch.setattr(threads, "CROWDED_CHECK", True)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    session = _session()
    assert background.wait(120)
    workload = _graph_workload(session)
    assert _trials_in(workload) == [] and background.settled()
    assert workload.route == "onednn_graph" and "busy machine, untimed" in workload.why
    feeds = _feeds()
    assert_close(session.run(None, feeds), ort_outputs(MODEL, feeds))
    assert not cache.exists()


def test_on_a_busy_machine_a_few_layers_are_not_traced_untimed(cache, monkeypatch) -> None:
    """cond_nested_dyn18's 4-layer Linear partition ran slower traced than layer by layer: fewer
    than traced.UNTIMED_LAYERS layers stay layers on a busy machine."""
    from backplane.backends.torch import threads

    monkeypatch.setattr(threads, "CROWDED_CHECK", True)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    path = DATA / "corpus" / "cond_nested_dyn18.onnx"
    feeds = dict(np.load(DATA / "corpus" / "cond_nested_dyn18.s0.npz"))
    session = InferenceSession(path, providers=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.background": True})))  # the If on builtin's (GpuAcc's where first)
    expected = ort_outputs(path, feeds)
    assert_close(session.run(None, feeds), expected)  # builds the signature
    assert background.settle(lambda: assert_close(session.run(None, feeds), expected), 120)
    loaded = session.runtime.network(session.network_id)
    (built,) = [s.workload.built for s in loaded.steps if hasattr(s.workload, "built")]
    (build,) = built.values()
    while hasattr(build, "work"):  # OneThread, AtThreads, Undecided; none where it keeps the
        build = build.work  # caller's one thread (the GPU machine's pytest workers)
    inner = build.close.__self__
    (traced,) = [s.workload for s, lay in zip(inner.steps, inner.layers) if lay.op_type == "Traced"]
    assert traced.route == "layers" and "busy machine: not traced" in traced.why


def test_routes_kept_by_the_runs_are_taken_by_the_next_load(cache) -> None:
    """(At a given thread count: the policy's count may change between the runs, and a route is
    kept under the count it was timed at.)"""
    session = _session(**{"CpuAcc.threads": 2})
    feeds = _feeds()
    _run_until_settled(session, feeds, ort_outputs(MODEL, feeds))
    assert route_cache._entries(cache)
    again = _session(**{"CpuAcc.threads": 2})
    assert background.wait(120)
    assert "kept in the route cache" in _graph_workload(again).why
    assert background.settled()
    del session, again


def test_a_network_unloaded_before_its_turn_is_not_compiled(cache, held_back) -> None:
    made = []
    session = _session()
    job = background._worker().jobs.queue[-1]
    target, make, *rest = job[1]
    background._worker().jobs.queue[-1] = (job[0], (target, lambda: made.append(1) or make(),
                                                    *rest), job[2])
    session.close()
    del session, job
    gc.collect()
    held_back.set()
    assert background.wait(120)
    assert made == []


def test_a_background_failure_leaves_the_stand_in_running(cache, held_back, caplog) -> None:
    session = _session()
    job = background._worker().jobs.queue[-1]
    background._worker().jobs.queue[-1] = (job[0], (job[1][0], lambda: 1 / 0, *job[1][2:]),
                                           job[2])
    held_back.set()
    assert background.wait(120)
    assert "ZeroDivisionError" in caplog.text and "its layers run as loaded" in caplog.text
    assert _graph_workload(session).route == "layers"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    assert_close(session.run(None, feeds), ort_outputs(MODEL, feeds))


def test_off_the_load_measures_and_compiles_itself(cache) -> None:
    session = _session(**{"CpuAcc.background": False})
    assert _graph_workload(session).why == (f"onednn_graph: {onednn_graph.RULE}; "
                                            f"{onednn_graph.AT_FIRST_RUN}")  # by rule
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
                                   "CpuAcc.background": True, "CpuAcc.threads": 2,
                                   # torch's routes, whose threads are chosen (a native plan runs
                                   # on one thread: nothing to choose)
                                   "CpuAcc.native": "off"})))
    expected = ort_outputs(path, feeds)
    assert_close(session.run(None, feeds), expected)  # builds the signature, behind the gate
    loaded = session.runtime.network(session.network_id)
    (built,) = [s.workload.built for s in loaded.steps if hasattr(s.workload, "built")]
    (undecided,) = built.values()
    assert isinstance(undecided, small.Undecided) and undecided.decided is None
    assert_close(session.run(None, feeds), expected)
    assert undecided.decided is None  # still behind the gate: the caller's threads
    held_back.set()
    assert background.settle(lambda: assert_close(session.run(None, feeds), expected), 120)
    # chosen once its routes were, on the swapped-in workloads, timed; its routes then watched
    # the thread count it chose (``trials.WATCH``) before settling
    assert undecided.decided is not None
    assert_close(session.run(None, feeds), expected)
    assert isinstance(undecided.decided, small.OneThread) or undecided.decided is undecided.work
