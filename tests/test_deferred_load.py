"""A default session that returns before torch is imported (``backplane.deferred_load``).

A fresh process where the path needs torch not imported yet (the test process has imported it):
the session returns on CpuRef, the first run (or a read of its placement) waits for CpuAcc's load
in the background and takes it over, and its outputs are those of a session loaded on CpuAcc at
once and ONNX Runtime's. In this process: a failed background load leaves the CpuRef session running, a session closed before
its first run closes the load it was waiting for, and runs before the load is done bridge it on the
session's own network (CpuRef), stopped between two layers where it is done first.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession, deferred_load

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"

_FRESH = """
import json, sys
import numpy as np
import backplane
from backplane.backends.torch import threads
threads.CROWDED_CHECK = False  # the same routes whatever the machine's load, in both sessions
x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
session = backplane.InferenceSession(sys.argv[1])
before = {"placeholder": session._optimized.report.preferences, "waiting": session._later is not None}
if sys.argv[2] == "get_providers":  # what reads the placement waits for the background's
    providers = session.get_providers()
    before["then"] = session._later is not None
if sys.argv[2] == "optimized":  # the network read before the first run is the one runs will use
    before["read"] = session.optimized.report.preferences
    before["then"] = session._later is not None
got = session.run(None, {"input": x})[0]
after = {"providers": session.get_providers(), "counts": session.report.counts(),
         "waiting": session._later is not None}
again = session.run(None, {"input": x})[0]
at_once = backplane.InferenceSession(sys.argv[1], providers=["CpuAcc", "CpuRef"])
wanted = at_once.run(None, {"input": x})[0]
print(json.dumps({"before": before, "after": after, "first": got.tolist(),
                  "again": again.tolist(), "at_once": wanted.tolist()}))
"""


@pytest.mark.parametrize("first", ["run", "get_providers", "optimized"])
def test_a_default_session_defers_cpuacc_and_its_first_run_takes_it_over(first: str) -> None:
    pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    done = subprocess.run([sys.executable, "-c", _FRESH, str(DEMO), first], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if any(map(Path.exists, map(Path, deferred_load._GPU_DEVICES))):  # the GPU machine
        assert seen["before"]["waiting"] is False  # GpuAcc may come first: loaded at once
        return
    read = {"read": ["CpuAcc", "CpuRef"]} if first == "optimized" else {}
    assert seen["before"] == {"placeholder": ["CpuRef"], "waiting": True, **read,
                              **({"then": False} if first != "run" else {})}
    assert seen["after"]["providers"] == ["CpuAcc", "CpuRef"]
    assert not seen["after"]["waiting"] and set(seen["after"]["counts"]) == {"CpuAcc"}
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    reference = ort.InferenceSession(str(DEMO), providers=["CPUExecutionProvider"]).run(
        None, {"input": x})[0]
    for name in ("first", "again"):
        np.testing.assert_allclose(np.array(seen[name], np.float32), np.array(seen["at_once"]),
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(seen[name], np.float32), reference, rtol=1e-3,
                                   atol=1e-4)


def _inputs() -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)}


def test_a_failed_background_load_leaves_the_cpuref_session_running(
        caplog: pytest.LogCaptureFixture) -> None:
    session = InferenceSession(DEMO, providers=["CpuRef"])
    expected = session.run(None, _inputs())[0]

    def failing() -> InferenceSession:
        raise RuntimeError("no torch today")

    with caplog.at_level(logging.WARNING, logger="backplane.session"):
        session._later = deferred_load.Later(failing)
        session._update_fast_path()
        assert not session._fast
        assert session._later.wait(60)  # done: no run bridges it
        got = session.run(None, _inputs())[0]
    assert "no torch today" in caplog.text and "runs on CpuRef" in caplog.text
    assert session._later is None and session._fast
    assert session.get_providers() == ["CpuRef"]
    np.testing.assert_array_equal(got, expected)


def test_a_session_closed_before_its_first_run_closes_the_load_it_waited_for() -> None:
    session = InferenceSession(DEMO, providers=["CpuRef"])
    made: list[InferenceSession] = []

    def make() -> InferenceSession:
        made.append(InferenceSession(DEMO, providers=["CpuRef"]))
        return made[0]

    session._later = later = deferred_load.Later(make)
    session.close()
    assert later.wait(60) and deferred_load.pending() == 0
    assert made[0]._closed
    with pytest.raises(RuntimeError, match="closed"):
        session.run(None, _inputs())


def test_the_first_run_takes_over_the_built_network() -> None:
    session = InferenceSession(DEMO, providers=["CpuRef"])
    old_runtime = session.runtime
    built = InferenceSession(DEMO, providers=["CpuRef"], pins={"Conv": "CpuRef"})
    session._later = deferred_load.Later(lambda: built)
    session._update_fast_path()
    assert session._later.wait(60)  # done: no run bridges it
    session.run(None, _inputs())
    assert session.runtime is built.runtime and session.network_id == built.network_id
    assert session.optimized is built.optimized and session._later is None
    assert old_runtime._finalizer.alive is False  # the CpuRef session's own runtime closed


@pytest.mark.parametrize("given", [{}, {"provider_options": [{}]}, {"runtime": object()},
                                   {"cache_dir": "/tmp"}, {"pins": {"Conv": "CpuRef"}}])
def test_what_a_session_is_given_keeps_it_loading_at_once(
        given: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    if any(map(Path.exists, map(Path, deferred_load._GPU_DEVICES))):
        pytest.skip("a GPU device: GpuAcc may come first, a default session loads at once")
    monkeypatch.setattr(deferred_load, "DEFAULT", True)
    monkeypatch.delitem(sys.modules, "torch")  # as in a process that has not imported it
    monkeypatch.delenv("BACKPLANE_COMPILE_CACHE", raising=False)
    arguments = {"provider_options": None, "runtime": None, "cache_dir": None, "pins": None}
    chosen = deferred_load.deferrable(DEMO, {**arguments, **given}, False)
    assert chosen == (None if given else ("CpuAcc", "CpuRef"))
    assert deferred_load.deferrable(DEMO, arguments, True) is None  # profiling
    assert deferred_load.deferrable(DEMO.read_bytes(), arguments, False) is None
    monkeypatch.setattr(deferred_load, "_GPU_DEVICES", (os.devnull,))  # a GPU device node
    assert deferred_load.deferrable(DEMO, arguments, False) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_during_the_load_runs_on_cpuref() -> None:
    """The child has no background thread (its first run would wait forever for it, or for an
    import that thread held): it runs the CpuRef session; the parent's load goes on."""
    session = InferenceSession(DEMO, providers=["CpuRef"])
    expected = session.run(None, _inputs())[0]
    release = threading.Event()

    def slow() -> InferenceSession:
        release.wait(30)
        return InferenceSession(DEMO, providers=["CpuRef"], pins={"Conv": "CpuRef"})

    session._later = later = deferred_load.Later(slow)
    session._update_fast_path()
    own = session.runtime
    pid = os.fork()
    if pid == 0:  # the child: run, say whether it ran on the CpuRef session, never return
        signal.alarm(20)  # a child waiting for the load it cannot have ends, and the test fails
        try:
            same = np.array_equal(session.run(None, _inputs())[0], expected)
            os._exit(0 if same and session._later is None else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    release.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert later.wait(60)
    session.run(None, _inputs())  # the parent's took the built session over
    assert session._later is None and session.runtime is not own
    session.close()


_EXIT = """
import threading, time, weakref
from backplane import deferred_load
class Held:
    pass
held, finalized = Held(), threading.Event()
weakref.finalize(held, finalized.set)  # at exit, as a Runtime's finalizer runs (atexit=True)
def make():
    time.sleep(1.0)  # the process exits during the load
    if finalized.is_set():
        raise RuntimeError("finalized under the load")
    return None
later = deferred_load.Later(make)
"""


def test_a_process_that_exits_during_the_load_lets_it_finish_before_the_finalizers() -> None:
    """A script that loads a model and exits without a run: the load in the background ends
    before ``weakref.finalize``'s exit functions close Runtimes (it said the load failed, a
    Runtime closed under it, where its wait was an atexit function: they run last first)."""
    done = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr, done.stderr


def test_a_load_in_the_background_does_not_wait_for_itself() -> None:
    """What the build calls may wait for the background (against_cpu's timing of a control-flow
    model: ``background.settle``): its own load is not waited for (each such wait ran out its
    timeout, 60 s twice for cond_nested_dyn18's first output)."""
    waited: list[bool] = []

    def make() -> None:
        waited.append(deferred_load.wait(5.0))

    later = deferred_load.Later(make)
    assert later.wait(60)
    assert waited == [True]


class _Made:
    """A built session's stand-in: its runs' feeds recorded, the first failing where asked."""

    _against_cpu, _builds_at_run = None, False

    def __init__(self, fail: bool = False) -> None:
        self.fed: list[dict[str, np.ndarray]] = []
        self.fail = fail

    def run(self, names: object, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.fed.append(feeds)
        if self.fail:
            raise ValueError("not this feed")
        return [feeds["x"]]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_the_load_runs_the_first_feeds_it_was_given_once_on_a_copy(fail: bool) -> None:
    """Runs that bridge the load (``torch_free``) hand it their feeds: the build, once made, runs
    the first it was given once (its first run's costs, oneDNN Graph's compile, not left to the
    caller's run that takes it over), on a copy; a failing run leaves the build to be taken."""
    gate, made = threading.Event(), _Made(fail)

    def make() -> _Made:
        assert gate.wait(60)
        return made

    later = deferred_load.Later(make)
    x = np.ones(3, np.float32)
    later.warm({"x": [1.0, 2.0]})  # not an array: not kept
    later.warm({"x": x})
    later.warm({"x": x * 2})  # only the first
    x[:] = 5  # the caller's own again
    gate.set()
    assert later.wait(60)
    assert len(made.fed) == 1 and made.fed[0]["x"].tolist() == [1.0, 1.0, 1.0]
    assert later.made is made and later.error is None
    later.warm({"x": x})  # after the load: nothing kept
    assert later.feeds["x"].tolist() == [1.0, 1.0, 1.0]


def test_a_load_given_no_feeds_runs_nothing() -> None:
    made = _Made()
    later = deferred_load.Later(lambda: made)
    assert later.wait(60) and made.fed == [] and later.made is made


GPT = ROOT / "tests" / "data" / "corpus" / "gpt_causal_ts15.onnx"


def _gpt() -> tuple[InferenceSession, dict[str, np.ndarray]]:
    session = InferenceSession(GPT, providers=["CpuRef"])
    return session, dict(np.load(str(GPT)[:-5] + ".s0.npz"))


def _gated(session: InferenceSession, built: InferenceSession, monkeypatch: pytest.MonkeyPatch,
           ) -> tuple[deferred_load.Later, threading.Event, list]:
    """A load of ``built`` that waits for the gate; the load's first runs' feeds recorded."""
    gate, fed = threading.Event(), []
    first_run = deferred_load.Later._first_run

    def recorded(made, feeds):
        fed.append(feeds)
        first_run(made, feeds)

    monkeypatch.setattr(deferred_load.Later, "_first_run", staticmethod(recorded))

    def make() -> InferenceSession:
        assert gate.wait(60)
        return built

    session._later = deferred_load.Later(make)
    session._update_fast_path()
    return session._later, gate, fed


def test_runs_bridge_the_load_on_the_sessions_own_network_until_it_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    session, feeds = _gpt()
    expected = session.run(None, feeds)
    old_runtime = session.runtime
    built = InferenceSession(GPT, providers=["CpuRef"], pins={"Softmax": "CpuRef"})
    later, gate, fed = _gated(session, built, monkeypatch)
    for _ in range(2):
        got = session.run(None, feeds)
        assert session._later is later and session.runtime is old_runtime  # not taken over
        for mine, theirs in zip(got, expected, strict=True):
            np.testing.assert_array_equal(mine, theirs)
    assert later.feeds is not None and fed == []
    gate.set()
    assert later.wait(60) and len(fed) == 1  # the load's first run, on the feeds' copy
    got = session.run(None, feeds)
    assert session._later is None and session.runtime is built.runtime
    assert old_runtime._finalizer.alive is False
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_a_bridged_run_stops_between_two_layers_when_the_load_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    session, feeds = _gpt()
    built = InferenceSession(GPT, providers=["CpuRef"], pins={"Softmax": "CpuRef"})
    later, gate, fed = _gated(session, built, monkeypatch)
    checks = []
    stop = later._stop

    def done_meanwhile() -> None:  # the load ends during the bridged run's layers
        checks.append(later.done.is_set())
        if len(checks) == 3:
            gate.set()
            assert later.wait(60)
        stop()

    monkeypatch.setattr(later, "_stop", done_meanwhile)
    session.run(None, feeds)
    assert checks == [False, False, False]  # stopped at its third layer's check
    assert session._later is None and session.runtime is built.runtime
    assert len(fed) == 1  # the load's first run, on the bridged run's feeds


def test_a_slow_bridged_run_ends_the_bridge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferred_load, "BRIDGE_SECONDS", 0.0)
    session, feeds = _gpt()
    built = InferenceSession(GPT, providers=["CpuRef"], pins={"Softmax": "CpuRef"})
    later, gate, fed = _gated(session, built, monkeypatch)
    session.run(None, feeds)
    assert session._later is later and not later.bridge  # the next run waits for the load
    threading.Timer(0.2, gate.set).start()
    session.run(None, feeds)
    assert session._later is None and session.runtime is built.runtime


def test_the_runtime_a_bridged_run_holds_is_closed_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    session, feeds = _gpt()
    old_runtime = session.runtime
    built = InferenceSession(GPT, providers=["CpuRef"], pins={"Softmax": "CpuRef"})
    later, gate, _ = _gated(session, built, monkeypatch)
    later.bridging = 1  # a run on the old network in another thread
    gate.set()
    assert later.wait(60)
    session.run(None, feeds)
    assert session.runtime is built.runtime and old_runtime._finalizer.alive
    later._bridged(0.0)  # that run ends
    assert old_runtime._finalizer.alive is False
