"""``CpuAcc.inductor`` (backends/torch/inductor_background.py): a default load's transformer-like
Traced subgraph compiled by TorchInductor on a low-priority background thread, checked against the
running route on a run's inputs, timed against it by the network's runs, swapped in where faster,
the verdict kept in the route cache; off in the suite unless a test asks (tests/conftest.py)."""

from __future__ import annotations

import gc
import logging
import os
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession, SessionOptions  # noqa: E402
from backplane.backends.api.backend import OptionError  # noqa: E402
from backplane.backends.torch import (  # noqa: E402
    background, inductor, inductor_background, route_cache, trials)
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_inductor import (  # noqa: E402
    SmallBlock, SmallCnn, _exported, needs_compiler)
from tests.backends.torch.test_traced import _inner_layers  # noqa: E402

Timed = inductor_background.Timed


@pytest.fixture
def cache(tmp_path_factory, monkeypatch: pytest.MonkeyPatch):
    """A route cache of the test's own; inductor's compiled code shared by the module's tests."""
    monkeypatch.setenv(route_cache.CACHE_VARIABLE, str(tmp_path_factory.mktemp("routes")))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR",
                       str(tmp_path_factory.getbasetemp() / "inductor-background"))
    yield
    assert background.wait(600)
    gc.collect()  # the test's Timed trials go: none left undecided for the next test's settle


def _session(model: bytes, severity: int = 2, **options: object) -> InferenceSession:
    options = {"CpuAcc.threads": 1, **{f"CpuAcc.{k}": v for k, v in options.items()}}
    return InferenceSession(model, SessionOptions(log_severity_level=severity),
                            backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _traced(session: InferenceSession) -> object:
    """The Traced partition's workload inside its wrappers: a Timed one once swapped in."""
    (work,) = [w for layer, w in _inner_layers(session) if layer.op_type == "Traced"]
    while not isinstance(work, Timed) and isinstance(work, background.Swapped):
        work = work.work
    return work


def _feeds(shape=(1, 8, 16)) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(2).standard_normal(shape).astype(np.float32)}


def _faster(winner: str):
    return lambda name, seconds: 1e-3 if name == winner else 1.0


@pytest.mark.slow  # inductor and g++: 20-60 s on a busy 2-core machine
@needs_compiler
def test_a_default_load_swaps_in_inductors_code_where_its_runs_time_it_faster(
        cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict forced by the injected measure (no test depends on a timing); then the next
    load takes it from the route cache and swaps the compiled code in untimed."""
    monkeypatch.setattr(inductor_background, "MEASURE", _faster("inductor"))
    model = _exported(SmallBlock(), (1, 8, 16))
    reference = InferenceSession(model, backends=["CpuRef"])
    feeds = _feeds()
    (want,) = reference.run(None, feeds)
    session = _session(model, inductor="auto")
    np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-4, atol=1e-6)
    assert background.settle(lambda: session.run(None, feeds), 600)
    timed = _traced(session)
    assert isinstance(timed, Timed) and timed.timed and timed.final
    assert timed.route == "inductor" and list(timed.candidates) == ["inductor"]
    (got,) = session.run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    feeds["x"][0, 3, 5] = np.nan  # NaN in, NaN out (the running route takes the run)
    (got,), (want,) = session.run(None, feeds), reference.run(None, feeds)
    assert np.isnan(want[0, 3]).all() and np.array_equal(np.isnan(got), np.isnan(want))
    again = _session(model, inductor="auto")
    again.run(None, _feeds())
    assert background.settle(lambda: again.run(None, _feeds()), 600)
    timed = _traced(again)
    assert isinstance(timed, Timed) and not timed.timed and timed.route == "inductor"


@pytest.mark.slow  # inductor and g++: 20-60 s on a busy 2-core machine
@needs_compiler
def test_where_inductors_code_times_slower_the_route_stays_and_is_not_compiled_again(
        cache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inductor_background, "MEASURE", _faster("own"))
    model = _exported(SmallBlock(), (1, 8, 16))
    monkeypatch.setattr(inductor_background, "DEFAULT", "auto")  # the option's own default
    session = _session(model)
    session.run(None, _feeds())
    assert background.settle(lambda: session.run(None, _feeds()), 600)
    timed = _traced(session)
    assert isinstance(timed, Timed) and timed.final and list(timed.candidates) == ["own"]
    again = _session(model)
    again.run(None, _feeds())
    assert background.pending() == 0 and not isinstance(_traced(again), (Timed, background.Swapped))


def _pair(own_value: float, inductor_value: float) -> Timed:
    own = lambda x: (x + own_value,)  # noqa: E731
    compiled = lambda x: (x + inductor_value,)  # noqa: E731
    return Timed({"own": own, "inductor": compiled}, {"traced": "test", "layers": []}, True)


def test_inductors_code_computing_otherwise_than_the_running_route_is_never_run(cache) -> None:
    """Checked on the first call's inputs: the running route's outputs are that call's, and it
    stays for good; the verdict goes to the route cache (the next load compiles nothing)."""
    timed = _pair(1.0, 2.0)
    (out,) = timed(torch.zeros(3))
    assert torch.equal(out, torch.ones(3)) and timed.final and list(timed.candidates) == ["own"]
    assert route_cache.lookup(route_cache.key("inductor", timed.description)) == "own"


def test_the_runs_take_the_faster_by_the_measure_and_keep_it(cache, monkeypatch) -> None:
    monkeypatch.setattr(inductor_background, "MEASURE", _faster("inductor"))
    timed = _pair(1.0, 1.0)
    x = torch.zeros(3)
    for _ in range(2 * trials.SAMPLES + 5):
        (out,) = timed(x)
        assert torch.equal(out, torch.ones(3))  # each call's outputs are its own candidate's
    assert timed.chosen is timed.candidates["inductor"] and "not kept" not in timed.why
    assert route_cache.lookup(route_cache.key("inductor", timed.description)) == "inductor"


def test_inductors_code_must_win_by_the_margin(cache, monkeypatch) -> None:
    """A tie on a busy machine is no reason to swap (``MARGIN``): 0.95 of the route's time keeps
    the route, and the verdict is kept."""
    monkeypatch.setattr(inductor_background, "MEASURE",
                        lambda name, seconds: 0.95 if name == "inductor" else 1.0)
    timed = _pair(1.0, 1.0)
    for _ in range(2 * trials.SAMPLES + 5):
        timed(torch.zeros(3))
    assert timed.chosen is timed.candidates["own"]
    assert route_cache.lookup(route_cache.key("inductor", timed.description)) == "own"


def test_calls_beside_a_background_compile_run_the_route_untimed(cache, monkeypatch) -> None:
    timed = _pair(1.0, 1.0)
    timed(torch.zeros(3))  # the check
    monkeypatch.setattr(background, "epoch", lambda: None)  # a job runs
    for _ in range(3 * trials.SAMPLES):
        timed(torch.zeros(3))
    assert timed.chosen is None and all(s == [] for s in timed.samples.values())
    assert timed.total == 0
    timed.abandon()


def test_the_suite_loads_with_no_compile_in_the_background(cache) -> None:
    """The conftest's default ("off"): a transformer's load queues nothing; an unknown value is an
    error that lists the values."""
    assert inductor_background.DEFAULT == "off"
    session = _session(_exported(SmallBlock(), (1, 8, 16)))
    session.run(None, _feeds())
    assert background.pending() == 0 and not isinstance(_traced(session), background.Swapped)
    with pytest.raises(OptionError, match="auto, off, swap"):
        _session(_exported(SmallBlock(), (1, 8, 16)), inductor="sometimes")


def test_no_compiler_compiles_nothing_and_says_so_once(cache, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CXX", "no-g++-here")
    monkeypatch.setattr(inductor_background, "_said_missing", False)
    model = _exported(SmallBlock(), (1, 8, 16))
    with caplog.at_level(logging.INFO, logger="backplane.torch"):
        for _ in range(2):
            session = _session(model, severity=1, inductor="auto")  # info: said
            session.run(None, _feeds())
    assert background.pending() == 0 and not isinstance(_traced(session), background.Swapped)
    assert [r.message for r in caplog.records if "no-g++-here" in r.message] == [
        "CpuAcc: no TorchInductor compile in the background: no C++ compiler (no-g++-here) on "
        "the PATH"]


def test_a_subgraph_with_convolutions_is_not_queued(cache, monkeypatch) -> None:
    queued: list[str] = []
    monkeypatch.setattr(background, "later", lambda *a, name: queued.append(name))
    session = _session(_exported(SmallCnn(), (1, 3, 8, 8)), inductor="auto")
    session.run(None, {"x": np.zeros((1, 3, 8, 8), np.float32)})
    assert queued == []
    session = _session(_exported(SmallBlock(), (1, 8, 16)), inductor="auto")
    session.run(None, _feeds())
    assert len(queued) == 1 and queued[0].endswith("(TorchInductor)")


def test_the_compile_thread_runs_at_the_lowest_priority() -> None:
    if not hasattr(os, "setpriority"):
        pytest.skip("no per-thread priority here")
    seen: list[int] = []
    background.later(lambda: seen.append(os.getpriority(os.PRIO_PROCESS,
                                                        threading.get_native_id())), name="test")
    assert background.wait(60)
    assert seen == [background.NICE]
