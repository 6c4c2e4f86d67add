"""Measured placement: a backend made slow on purpose loses its partitions, copies at the edges are
timed, refused layers and pins stay, the report's table, the cache, and unknown placements; on a
fake clock, the candidates timed in turns, a near tie kept by the preferred backend, a clearly
faster one taking it, the least runs of a slow partition, a clearly slower candidate stopped, and
the greedy pass never worse than preference order by the margins it claims."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backplane import InferenceSession, OptimizerOptions
from backplane.backends.api.backend import OptionError
from backplane.backends.reference.backend import CpuRef
from backplane.backends.reference.kernels import KERNELS as REF_KERNELS
from backplane.backends.registry import registry
from backplane.optimizer import edge_cost, measured
from backplane.optimizer.report import PlacementReport
from tests.conftest import PartialBackend, small_cnn_model

X = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
MEASURED = OptimizerOptions(placement="measured")
SLEEP_S = 0.01
CALLS = {"relu": 0}  # the slow Relu's calls


def slow(kernel: Any) -> Any:
    def relu(x: np.ndarray) -> tuple[np.ndarray]:
        CALLS["relu"] += 1
        time.sleep(SLEEP_S)
        return kernel(x)

    return relu


SLOW_RELU = {version: slow(kernel) for version, kernel in REF_KERNELS["Relu"].items()}


class SlowRef(CpuRef):
    """CpuRef, but its Relu sleeps: slower than CpuRef on anything with a Relu, for certain."""

    id = "TestSlowRef"
    KERNELS = {**CpuRef.KERNELS, "Relu": SLOW_RELU}


class SlowPartial(PartialBackend):
    """TestPartial (Conv, Relu, Add, MatMul, Gemm, Mul) with the slow Relu."""

    id = "TestSlowPartial"
    KERNELS = {**PartialBackend.KERNELS, "Relu": SLOW_RELU}


@pytest.fixture(autouse=True)
def slow_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The slow backends registered, and measured placement's caches empty for each test."""
    for cache in ("_TIMES", "_OUTPUTS"):
        monkeypatch.setattr(measured, cache, {})
    monkeypatch.setattr(edge_cost, "_EDGES", {})
    with registry.temporarily(SlowRef.id, SlowRef), \
            registry.temporarily(SlowPartial.id, SlowPartial):
        yield


def reference() -> list[np.ndarray]:
    return InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})


def chosen(report: PlacementReport) -> dict[str, str]:
    return {m.partition: m.backend for m in report.measurements if m.chosen}


def test_a_slow_backend_keeps_its_layers_by_preference_and_loses_them_measured() -> None:
    preferred = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"])
    assert set(preferred.report.counts()) == {"TestSlowRef"}
    assert preferred.report.measurements == []
    session = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                               optimizer_options=MEASURED)
    assert set(session.report.counts()) == {"CpuRef"}
    rows = {m.backend: m for m in session.report.measurements}
    assert set(rows) == {"TestSlowRef", "CpuRef"}
    assert {m.partition for m in rows.values()} == {"conv1..softmax"}
    assert rows["TestSlowRef"].ms >= 2 * SLEEP_S * 1e3 > rows["CpuRef"].ms  # two Relus sleep
    assert rows["CpuRef"].chosen and not rows["TestSlowRef"].chosen
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], reference()[0])


def test_layers_a_backend_refuses_stay_and_the_choice_is_the_least_time_recorded() -> None:
    session = InferenceSession(small_cnn_model(), backends=["TestSlowPartial", "CpuRef"],
                               optimizer_options=MEASURED)
    report = session.report
    parts = {m.partition for m in report.measurements}
    assert parts == {"conv1..relu2", "pool..flatten", "fc..fc", "softmax..softmax"}
    for part in ("pool..flatten", "softmax..softmax"):  # TestSlowPartial refuses them
        assert [m.backend for m in report.measurements if m.partition == part] == ["CpuRef"]
    assert chosen(report)["conv1..relu2"] == "CpuRef"
    for part in parts:  # the preferred (first) row, unless another saves more than the noise
        rows = [m for m in report.measurements if m.partition == part]
        (taken,) = [m for m in rows if m.chosen]
        if taken is not rows[0]:
            assert taken.ms + taken.edge_ms < (1 - measured.MARGIN) * rows[0].ms + rows[0].edge_ms
            assert "beyond the noise" in taken.note
    for name in ("conv1", "relu1", "conv2", "skip", "relu2", "pool", "flatten", "softmax"):
        assert report.backend_of(name) == "CpuRef"
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], reference()[0])


def test_copies_at_the_edges_are_timed(partial_backends: None) -> None:
    """TestPrivate's tensors live in memory of its own: on it, the partition pays copies in and
    out; on CpuRef, whose neighbours (the user, pool) share host memory, it pays nothing."""
    report = InferenceSession(small_cnn_model(), backends=["TestPrivate", "CpuRef"],
                              optimizer_options=MEASURED).report
    rows = {m.backend: m for m in report.measurements if m.partition == "conv1..relu2"}
    assert rows["TestPrivate"].edge_ms > 0
    assert rows["CpuRef"].edge_ms == 0


def test_a_pinned_partition_stays_where_its_pin_puts_it() -> None:
    session = InferenceSession(small_cnn_model(), backends=["CpuRef"],
                               pins={"relu1": "TestSlowRef"}, optimizer_options=MEASURED)
    assert session.report.backend_of("relu1") == "TestSlowRef"
    (row,) = [m for m in session.report.measurements if m.partition == "relu1..relu1"]
    assert (row.backend, row.chosen) == ("TestSlowRef", True)
    assert row.note.startswith("pinned; ") and row.note.endswith("; alone")


def test_the_report_shows_the_table_and_keeps_it_as_data() -> None:
    report = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                              optimizer_options=MEASURED).report
    text = str(report)
    assert "Measured placement" in text and "edge ms" in text
    line = next(line for line in text.splitlines() if "TestSlowRef" in line and "conv1" in line)
    assert "conv1..softmax" in line
    again = PlacementReport.from_dict(report.to_dict())
    assert again.measurements == report.measurements
    assert "Measured placement" not in str(InferenceSession(small_cnn_model(),
                                                            backends=["CpuRef"]).report)


def test_measurements_are_kept_for_the_process() -> None:
    InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                     optimizer_options=MEASURED)
    assert CALLS["relu"] > 0
    before = CALLS["relu"]
    session = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                               optimizer_options=MEASURED)
    assert CALLS["relu"] == before  # nothing ran again
    assert set(session.report.counts()) == {"CpuRef"}
    InferenceSession(small_cnn_model(seed=1), backends=["TestSlowRef", "CpuRef"],
                     optimizer_options=MEASURED)
    assert CALLS["relu"] > before  # other weights: another partition


def test_an_unknown_placement_lists_the_choices() -> None:
    with pytest.raises(OptionError, match="'fastest' is not one of the choices: preference: .*; "
                                          "measured: "):
        OptimizerOptions(placement="fastest")
    assert issubclass(OptionError, ValueError)


def test_openvino_partitions_are_measured_against_cpuref() -> None:
    from backplane.backends.openvino.backend import openvino_missing

    if openvino_missing():
        pytest.skip(openvino_missing())
    session = InferenceSession(small_cnn_model(), backends=["OpenVINO", "CpuRef"],
                               optimizer_options=MEASURED)
    report = session.report
    assert {m.backend for m in report.measurements} == {"OpenVINO", "CpuRef"}
    assert all(m.ms is not None and m.ms > 0 for m in report.measurements)
    (part,) = {m.partition for m in report.measurements}  # OpenVINO takes every layer
    assert set(report.counts()) == {chosen(report)[part]}
    np.testing.assert_allclose(session.run(None, {"x": X})[0], reference()[0], rtol=1e-4,
                               atol=1e-6)


def test_the_compile_cache_keeps_the_measured_placement(tmp_path: Any) -> None:
    first = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                             optimizer_options=MEASURED, cache_dir=tmp_path)
    for cache in (measured._TIMES, measured._OUTPUTS, edge_cost._EDGES):
        cache.clear()  # a new process, as far as measurements go
    before = CALLS["relu"]
    again = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                             optimizer_options=MEASURED, cache_dir=tmp_path)
    assert CALLS["relu"] == before  # loaded from the artifact: nothing measured again
    assert set(again.report.counts()) == {"CpuRef"}
    assert again.report.measurements == first.report.measurements
    preferred = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                                 cache_dir=tmp_path)  # another key: the optimizer options differ
    assert set(preferred.report.counts()) == {"TestSlowRef"}


# -- on a fake clock: each Relu of a TestTick backend moves it on by the ms given ------------------
class Clock:
    """measured._clock in these tests: seconds that only the TestTick kernels move on."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = Clock()
LOG: list[str] = []  # the backend of each TestTick Relu call, in order
SLEPT: list[tuple[int, float]] = []  # (calls in LOG by then, seconds) of each sleep
TICKS: dict[str, Iterator[float]] = {}  # backend id -> ms of its Relu calls, one after another


def ticking(backend_id: str) -> dict[int, Any]:
    def make(kernel: Any) -> Any:
        def relu(x: np.ndarray) -> tuple[np.ndarray]:
            LOG.append(backend_id)
            CLOCK.now += next(TICKS[backend_id]) / 1e3
            return kernel(x)

        return relu

    return {version: make(kernel) for version, kernel in REF_KERNELS["Relu"].items()}


class TickA(CpuRef):
    id = "TestTickA"
    KERNELS = {**CpuRef.KERNELS, "Relu": ticking(id)}


class TickB(CpuRef):
    id = "TestTickB"
    KERNELS = {**CpuRef.KERNELS, "Relu": ticking(id)}


class TickC(CpuRef):
    id = "TestTickC"
    KERNELS = {**CpuRef.KERNELS, "Relu": ticking(id)}


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Registers TestTickA, B and C on the fake clock; call it with each one's ms per Relu (a
    list, repeated): small_cnn_model has two Relus, so a run takes two of them."""
    def sleep(seconds: float) -> None:
        SLEPT.append((len(LOG), seconds))
        CLOCK.now += seconds

    monkeypatch.setattr(measured, "_clock", CLOCK)
    monkeypatch.setattr(measured, "_sleep", sleep)
    LOG.clear()
    SLEPT.clear()

    def given(**ms: list[float]) -> None:
        TICKS.update({f"TestTick{b}": itertools.cycle(v) for b, v in ms.items()})

    with registry.temporarily(TickA.id, TickA), registry.temporarily(TickB.id, TickB), \
            registry.temporarily(TickC.id, TickC):
        yield given


def measured_session(*names: str) -> InferenceSession:
    return InferenceSession(small_cnn_model(), backends=[f"TestTick{n}" for n in names],
                            optimizer_options=MEASURED)


def runs_in_order() -> list[str]:
    """The backend of each run of the partition, in order (two Relu calls a run)."""
    assert len(LOG) % 2 == 0 and LOG[::2] == LOG[1::2]
    return LOG[::2]


def rows(session: InferenceSession) -> dict[str, Any]:
    return {m.backend.removeprefix("TestTick"): m for m in session.report.measurements}


def timed_notes(session: InferenceSession) -> dict[str, int]:
    """The number of timed runs each row's note gives."""
    return {b: int(re.match(r"(\d+) runs?, ", m.note)[1]) for b, m in rows(session).items()}


@pytest.mark.parametrize("ms, per_turn, timed", [
    ((30.0, 31.0, 32.0), 2, 6),  # runs of 60-64 ms: 2 fill TURN_S; BUDGET_S spent in 3 rounds
    ((5.0, 5.5, 6.0), 5, 15),  # runs of 10-12 ms: TURN_RUNS a turn; RUNS in 3 rounds
], ids=["60ms", "10ms"])
def test_the_candidates_are_timed_in_turns(ticks: Any, ms: tuple[float, ...], per_turn: int,
                                           timed: int) -> None:
    ticks(A=[ms[0]], B=[ms[1]], C=[ms[2]])
    session = measured_session("A", "B", "C")
    order = runs_in_order()
    warm = 3 * measured.WARMUP  # _prepare's call, then WARMUP - 1 rounds of one call each
    assert all(sorted(order[i:i + 3]) == ["TestTickA", "TestTickB", "TestTickC"]
               for i in range(0, warm, 3))
    turns = [(b, len(list(group))) for b, group in itertools.groupby(order[warm:])]
    assert [n for _, n in turns] == [1 + per_turn] * 9  # a lead-in, then the timed runs
    rounds = [[b for b, _ in turns[i:i + 3]] for i in range(0, 9, 3)]
    assert all(sorted(r) == ["TestTickA", "TestTickB", "TestTickC"] for r in rounds)
    assert len({tuple(r) for r in rounds}) == 3  # the order turns
    starts = [warm + i * (1 + per_turn) for i in range(9)]
    assert SLEPT == [(2 * start, measured.SETTLE_S) for start in starts]  # before each turn
    assert timed_notes(session) == {"A": timed, "B": timed, "C": timed}
    table = rows(session)
    assert {b: m.ms for b, m in table.items()} == pytest.approx(
        {"A": 2 * ms[0], "B": 2 * ms[1], "C": 2 * ms[2]})
    assert table["A"].chosen and table["A"].note.endswith("; reference")


@pytest.mark.parametrize("a, b", [
    ([5.0, 5.0, 5.4, 5.4, 5.2, 5.2], [4.85, 4.85, 5.25, 5.25, 5.05, 5.05]),  # 3%, in the spread
    ([5.0], [4.95]),  # steady, 1% faster in every round: less than MARGIN
], ids=["within-the-spread", "within-the-margin"])
def test_a_near_tie_keeps_the_preferred_backend(ticks: Any, a: list[float],
                                                b: list[float]) -> None:
    ticks(A=a, B=b)
    session = measured_session("A", "B")
    table = rows(session)
    assert table["B"].ms < table["A"].ms  # faster as a median, by less than the noise
    assert table["A"].chosen and not table["B"].chosen
    assert set(session.report.counts()) == {"TestTickA"}
    assert table["B"].note.endswith("(within the noise)")


def test_a_clearly_faster_backend_takes_the_partition(ticks: Any) -> None:
    ticks(A=[5.0, 5.0, 5.2, 5.2, 5.1, 5.1], B=[4.0, 4.0, 4.4, 4.4, 4.2, 4.2])  # ~10.2 against 8.4
    session = measured_session("A", "B")
    table = rows(session)
    assert table["B"].chosen and not table["A"].chosen
    assert set(session.report.counts()) == {"TestTickB"}
    found = re.search(r"saves ([\d.]+) ms on TestTickA, needs over ([\d.]+) \(beyond the noise\)",
                      table["B"].note)
    assert found and 1.2 <= float(found[1]) <= 2.4 and 0 < float(found[2]) < float(found[1])


def test_a_slow_partition_still_gets_the_least_runs(ticks: Any) -> None:
    ticks(A=[300.0], B=[310.0])  # 0.6 s a run: BUDGET_S is spent in the first round
    session = measured_session("A", "B")
    assert timed_notes(session) == {"A": measured.MIN_RUNS, "B": measured.MIN_RUNS}
    assert all(m.note.startswith(f"{measured.MIN_RUNS} runs") for m in rows(session).values())


def test_a_clearly_slower_candidate_stops_early(ticks: Any) -> None:
    ticks(A=[30.0], B=[30.0], C=[300.0])
    session = measured_session("A", "B", "C")
    assert runs_in_order().count("TestTickC") == measured.WARMUP + 2  # a lead-in, one timed run
    # C's 600 ms count in BUDGET_S: spent after ROUNDS rounds of 2 runs a turn for A and B
    assert timed_notes(session) == {"A": 6, "B": 6, "C": 1}
    table = rows(session)
    assert table["C"].note == ("1 run, middle half 600-600 ms; stopped: its fastest run 600 ms > "
                               "2x TestTickA's median 60 ms; 540 ms slower than TestTickA")
    assert table["A"].chosen


def part(runs: dict[str, list[float]]) -> Any:
    return measured._Part(None, next(iter(runs)), list(runs),  # type: ignore[arg-type]
                          {b: measured._Runs(tuple(ms)) for b, ms in runs.items()})


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_the_greedy_pass_gains_at_least_the_margins_of_what_it_moves(data: Any) -> None:
    """Parts in a chain (user -> 0 -> 1 -> ... -> user), random runs on up to three backends and
    random edge costs between two different backends: the measured total of the placement is
    preference order's less at least the margins of the parts moved."""
    backends = ["X", "Y", "Z"]
    ms = st.floats(0.1, 10.0)
    parts = [part({b: data.draw(st.lists(ms, min_size=1, max_size=6)) for b in
                   data.draw(st.lists(st.sampled_from(backends), min_size=1, max_size=3,
                                      unique=True))})
             for _ in range(data.draw(st.integers(1, 5)))]
    edges = [(f"t{i}", i - 1, i if i < len(parts) else -1) for i in range(len(parts) + 1)]
    prices = {(n, s, t): data.draw(ms) for n, *_ in edges for s in [*backends, "user"]
              for t in [*backends, "user"]}

    def edge_ms(name: str, source: str, target: str) -> float:
        return 0.0 if source == target else prices[name, source, target]

    def total() -> float:
        where = {-1: "user", **{i: p.backend for i, p in enumerate(parts)}}
        return (sum(p.ms[p.backend] for p in parts)
                + sum(edge_ms(n, where[s], where[t]) for n, s, t in edges))

    before = total()
    measured._choose(parts, edges, edge_ms)
    claimed = sum(p.margin(p.backend) for p in parts)
    assert total() <= before - claimed + 1e-9
