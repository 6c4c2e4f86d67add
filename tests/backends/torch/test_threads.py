"""CpuAcc's thread policy (``threads.py``): the decisions it takes from a simulated load signal,
the option's validation, and the workloads it governs. No timing is asserted: the readings are
made up."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backplane.backends.api.backend import OptionError
from backplane.backends.torch import threads
from backplane.backends.torch.threads import Governed, Sample, ThreadGovernor
from tests.conftest import small_cnn_model

CPUS = frozenset({0, 1})


@pytest.mark.parametrize("value", ["auto", None, 0])
def test_auto_none_and_zero_are_the_policy(value: object) -> None:
    assert threads.thread_setting(value) is None


@pytest.mark.parametrize("value, count", [(2, 2), ("3", 3), (1, 1)])
def test_a_count_is_a_fixed_count(value: object, count: int) -> None:
    assert threads.thread_setting(value) == count


@pytest.mark.parametrize("value", ["atuo", -1, 1.5, True, "two"])
def test_anything_else_is_an_error_naming_the_choices(value: object) -> None:
    with pytest.raises(OptionError, match=r"CpuAcc.threads .* neither 'auto' .* positive"):
        threads.thread_setting(value)


def test_a_misspelled_thread_setting_fails_the_session() -> None:
    pytest.importorskip("torch")
    from backplane import InferenceSession

    with pytest.raises(OptionError, match="'atuo' is neither 'auto'"):
        InferenceSession(small_cnn_model().SerializeToString(),
                         backends=[("CpuAcc", {"threads": "atuo"}), "CpuRef"])


@pytest.mark.parametrize("free, most, count", [
    (2.0, 2, 2), (1.8, 2, 2), (1.7, 2, 1), (1.0, 2, 1), (0.2, 2, 1), (3.9, 4, 4), (8.0, 4, 4),
    (2.6, 4, 2), (5.0, 8, 4), (4.0, 6, 3), (6.0, 6, 6)])
def test_threads_for_the_free_cpus_halving_from_the_most(free: float, most: int,
                                                         count: int) -> None:
    assert threads.choose(free, most) == count


def sample(wall: float, own: float, idle: int, total: int) -> Sample:
    return Sample(wall=wall, own=own, idle=idle, total=total)


def test_free_cpus_are_the_idle_ones_and_our_own() -> None:
    start = sample(0.0, 0.0, 0, 0)
    # 1 s of 2 CPUs at 100 ticks a second: a neighbour held one, we the other
    assert threads.free_cpus(start, sample(1.0, 1.0, 0, 200), 2) == pytest.approx(1.0)
    # nobody but us, and us half the time
    assert threads.free_cpus(start, sample(1.0, 0.5, 150, 200), 2) == pytest.approx(2.0)
    # quiet between our runs: all idle
    assert threads.free_cpus(start, sample(1.0, 0.0, 200, 200), 2) == pytest.approx(2.0)
    # no time passed: no evidence, all of them
    assert threads.free_cpus(start, start, 2) == 2.0


def test_a_reading_counts_only_the_cpus_of_the_affinity(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  30 0 0 300 0 0 0 0 0 0\n"
                    "cpu0 10 0 0 100 5 0 0 0 0 0\n"
                    "cpu1 20 0 0 200 0 0 0 3 0 0\n"
                    "intr 1 2 3\nctxt 5\n")
    reading = threads.read_sample(frozenset({1}), str(stat))
    assert reading is not None and (reading.idle, reading.total) == (200, 223)
    assert threads.read_sample(CPUS, str(tmp_path / "absent")) is None


class Simulated:
    """A load signal: each reading adds a second in which a neighbour holds ``busy`` CPUs of two and
    this process uses what is left."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.now = sample(0.0, 0.0, 0, 0)

    def __call__(self, cpus: frozenset[int]) -> Sample:
        ours = 2.0 - self.busy
        self.now = sample(self.now.wall + 1.0, self.now.own + ours, self.now.idle,
                          self.now.total + 200)
        return self.now


def governed(signal: Simulated) -> tuple[ThreadGovernor, list[int]]:
    applied: list[int] = []
    return ThreadGovernor(2, CPUS, read=signal, apply=applied.append, period=0.0), applied


def test_a_neighbour_holding_a_core_leaves_one_thread_and_its_end_gives_it_back() -> None:
    signal = Simulated()
    governor, applied = governed(signal)
    governor.tick()
    assert applied == [2]
    signal.busy = 1.0  # a CPU-burning neighbour
    governor.tick()
    governor.tick()
    assert applied == [2, 1] and governor.threads == 1  # set once, not at every call
    signal.busy = 0.0
    governor.tick()
    assert applied == [2, 1, 2]
    assert governor.decisions == {2: 2, 1: 2}


def test_two_neighbours_leave_one_thread_not_none() -> None:
    signal = Simulated()
    signal.busy = 2.0
    governor, applied = governed(signal)
    governor.tick()
    assert applied == [1]


def test_without_a_reading_the_count_stays_the_full_one() -> None:
    applied: list[int] = []
    governor = ThreadGovernor(2, CPUS, read=lambda cpus: None, apply=applied.append, period=0.0)
    governor.tick()
    governor.tick()
    assert applied == [2] and governor.decisions == {}


def test_between_readings_the_decision_holds() -> None:
    signal = Simulated()
    applied: list[int] = []
    governor = ThreadGovernor(2, CPUS, read=signal, apply=applied.append, period=3600.0)
    signal.busy = 1.0
    governor.tick()
    assert applied == [2]  # the next reading is an hour away


def test_each_thread_that_runs_gets_the_count_applied_in_it() -> None:
    signal = Simulated()
    governor, _ = governed(signal)
    signal.busy = 1.0
    seen: list[tuple[str, int]] = []
    governor.apply = lambda count: seen.append((threading.current_thread().name, count))
    governor.tick()
    other = threading.Thread(target=governor.tick, name="other")
    other.start()
    other.join()
    assert seen == [("MainThread", 1), ("other", 1)]


def test_a_load_holds_the_loading_thread_at_the_full_count() -> None:
    signal = Simulated()
    governor, applied = governed(signal)
    signal.busy = 1.0
    governor.tick()
    governor.hold_most()
    governor.tick()
    assert applied == [1, 2, 1]


def test_a_governed_workload_ticks_and_keeps_its_attributes() -> None:
    calls: list[str] = []

    class Work:
        exclusive = True

        def __call__(self, x):
            calls.append("run")
            return (x + 1,)

        def profiled(self, x):
            calls.append("profiled")
            return (x,), []

    class Counting(ThreadGovernor):
        def tick(self) -> None:
            calls.append("tick")

    work = Governed(Work(), Counting(2, CPUS, read=lambda cpus: None, apply=lambda n: None))
    assert work(1) == (2,) and work.exclusive is True
    work.profiled(1)
    assert calls == ["tick", "run", "tick", "profiled"]
    assert getattr(work, "missing", None) is None


def _steps(session):
    return [step.workload for step in session.runtime.network(session.network_id).steps]


def test_cpuacc_workloads_are_governed_by_default_and_not_with_a_count(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from backplane import InferenceSession

    signal = Simulated()
    # at most the simulated CPUs: with torch's own count (16 on a 16-core machine), a quiet reading
    # of two CPUs chooses 2, not the most
    governor = ThreadGovernor(len(CPUS), CPUS, read=signal, apply=torch.set_num_threads, period=0.0)
    monkeypatch.setattr(threads, "_GOVERNOR", governor)
    model = small_cnn_model().SerializeToString()
    image = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    before = torch.get_num_threads()
    try:
        session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
        assert any(isinstance(w, Governed) for w in _steps(session))
        signal.busy = 2.0
        (busy,) = session.run(None, {"x": image})
        assert torch.get_num_threads() == 1
        signal.busy = 0.0
        (quiet,) = session.run(None, {"x": image})
        assert torch.get_num_threads() == governor.most
        np.testing.assert_allclose(busy, quiet, rtol=1e-5, atol=1e-6)
        fixed = InferenceSession(model, backends=[("CpuAcc", {"threads": 1}), "CpuRef"])
        assert not any(isinstance(w, Governed) for w in _steps(fixed))
    finally:
        torch.set_num_threads(before)


def test_a_specialized_build_at_a_run_ticks_through_its_layer_alone(monkeypatch) -> None:
    """Under the policy, a Specialized layer (a free batch) ticks the governor before its call;
    the workloads its signature's build makes at the first run are not wrapped to tick again (the
    full-tier VAD's run ticked twice). Values: CpuRef's, NaN where CpuRef has it."""
    pytest.importorskip("torch")
    from onnx import helper, numpy_helper

    from backplane import InferenceSession
    from tests.conftest import float_input, make_model

    made: list[object] = []

    class Recorded(Governed):
        __slots__ = ()

        def __init__(self, work, governor) -> None:
            made.append(work)
            super().__init__(work, governor)

    monkeypatch.setattr(threads, "Governed", Recorded)
    weight = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                        helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("Tanh", ["r"], ["y"])],
                       [float_input("x", ["n", 4])], [float_input("y", ["n", 5])],
                       [numpy_helper.from_array(weight, "W")]).SerializeToString()
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    at_load = len(made)
    assert at_load >= 1
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    x[1, 2] = np.nan
    (got,) = session.run(None, {"x": x})
    assert len(made) == at_load
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.isnan(got[1]).all() and not np.isnan(got[[0, 2]]).any()


def test_a_network_run_by_its_specialized_layers_keyed_call_ticks_too(monkeypatch) -> None:
    """A network that is one Specialized layer (a free batch) is run by the direct run through
    ``keyed`` (the call by the feeds' NumPy shapes), not the workload's ``__call__``: the governor
    is ticked there too (it was not: yolo_v8's threads stayed at 2 beside a neighbour). Values:
    CpuRef's, NaN where CpuRef has it, at either count."""
    torch = pytest.importorskip("torch")
    from onnx import helper, numpy_helper

    from backplane import InferenceSession
    from tests.conftest import float_input, make_model

    signal = Simulated()
    governor = ThreadGovernor(len(CPUS), CPUS, read=signal, apply=torch.set_num_threads, period=0.0)
    monkeypatch.setattr(threads, "_GOVERNOR", governor)
    weight = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                        helper.make_node("Tanh", ["h"], ["y"])],
                       [float_input("x", ["n", 4])], [float_input("y", ["n", 5])],
                       [numpy_helper.from_array(weight, "W")]).SerializeToString()
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    x[1, 2] = np.nan
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    before = torch.get_num_threads()
    try:
        session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
        assert any(getattr(w, "keyed", None) is not None for w in _steps(session))
        session.run(None, {"x": x})
        signal.busy = 2.0
        (busy,) = session.run(None, {"x": x})
        assert torch.get_num_threads() == 1
        signal.busy = 0.0
        (quiet,) = session.run(None, {"x": x})
        assert torch.get_num_threads() == governor.most
        for got in (busy, quiet):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert np.isnan(got[1]).all() and not np.isnan(got[[0, 2]]).any()
    finally:
        torch.set_num_threads(before)
