"""A small CpuAcc partition runs on the fewest threads that are as fast (issue 27, item 4): each
Specialized signature's build, and each static partition the background compiles, is timed at one
thread and at the caller's count halved down to 2 (``small.py``); a busy machine takes one thread
for a small build without comparing; a large one keeps the count."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import small, threads  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

from tests.backends.torch.test_specialize import _specialized  # noqa: E402


def small_cnn() -> bytes:
    """Conv 3->8, Relu, Conv 8->8, Relu, GlobalAveragePool, Flatten, Gemm; free batch, height and
    width: a few hundred thousand multiply-adds at 16x16."""
    rng = np.random.default_rng(0)

    def const(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [const("w1", (8, 3, 3, 3)), const("b1", (8,)), const("w2", (8, 8, 3, 3)),
         const("wf", (4, 8)), const("bf", (4,))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _recording() -> tuple[list[int], object]:
    seen: list[int] = []

    def run(*values):
        seen.append(torch.get_num_threads())
        return (values[0] + 1,)

    return seen, run


def test_a_busy_machine_runs_a_small_build_on_one_thread(two_threads, monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: True)
    seen, run = _recording()
    chosen = small.fewer_threads(run, [torch.zeros(3)])
    assert isinstance(chosen, small.OneThread) and chosen.work is run
    seen.clear()
    (out,) = chosen(torch.ones(2))
    assert seen == [1] and torch.equal(out, torch.full((2,), 2.0))
    assert torch.get_num_threads() == 2  # the caller's count back


def test_a_slow_build_keeps_the_threads_untimed_at_the_count(two_threads, monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: True)
    monkeypatch.setattr(small, "SMALL_SECONDS", 0.0)
    seen, run = _recording()
    assert small.fewer_threads(run, [torch.zeros(3)]) is run
    assert set(seen) == {1}  # timed at one thread only, never at the count
    assert torch.get_num_threads() == 2


def test_one_thread_is_kept_unless_the_count_is_faster_by_the_margin(two_threads,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    for alone, many, kept in ((1.0, 1.0, True), (1.0, 0.95, True), (1.0, 0.8, False)):
        seconds = {1: alone * 1e-4, 2: many * 1e-4}
        monkeypatch.setattr(small, "_seconds",
                            lambda run, values, s=seconds: s[torch.get_num_threads()])
        chosen = small.fewer_threads(lambda *v: v, [torch.zeros(1)])
        assert isinstance(chosen, small.OneThread) is kept, (alone, many)


def test_fewer_threads_are_taken_only_where_a_second_comparison_agrees(two_threads,
                                                                       monkeypatch) -> None:
    """A burst of load during one comparison (2 threads timed slow) keeps the caller's count."""
    monkeypatch.setattr(threads, "crowded", lambda: False)
    for comparisons, expected in (([{2: 3.0e-3, 1: 2.96e-3}, {2: 2.0e-3, 1: 2.6e-3}], "caller's"),
                                  ([{2: 3.0e-3, 1: 2.96e-3}, {2: 2.9e-3, 1: 2.8e-3}], "one"),
                                  ([{2: 2.0e-3, 1: 2.6e-3}], "caller's")):
        made = iter(comparisons)
        monkeypatch.setattr(small, "_timed", lambda run, values, candidates, alone: next(made))
        run = lambda *v: v  # noqa: E731
        chosen = small.fewer_threads(run, [torch.zeros(1)])
        assert (chosen is run) if expected == "caller's" else isinstance(chosen, small.OneThread)
        assert next(made, None) is None  # a second comparison only where the first took fewer


def test_a_count_far_slower_than_one_thread_is_timed_once_per_comparison(two_threads,
                                                                         monkeypatch) -> None:
    """On a busy machine each call at two threads took 135-145 CPU ms where the partition runs in
    0.26 at one (every parallel region waiting for its second thread to get a CPU): such a count
    is timed once per comparison, in a block after one untimed call, not five times alternating
    with one thread; one thread is chosen."""
    monkeypatch.setattr(threads, "crowded", lambda: False)
    timed: list[int] = []

    def fake(run, values) -> float:  # the time a call would take at this count
        timed.append(torch.get_num_threads())
        return 0.14 if timed[-1] == 2 else 2.6e-4

    monkeypatch.setattr(small, "_seconds", fake)
    calls: list[int] = []
    run = lambda *v: calls.append(torch.get_num_threads()) or v  # noqa: E731
    assert isinstance(small.fewer_threads(run, [torch.zeros(1)]), small.OneThread)
    assert timed.count(2) == 2 and calls.count(2) == 2  # two comparisons, each 1 untimed + 1 timed


def test_one_thread_profiles_at_one_thread_and_passes_attributes(two_threads) -> None:
    seen, run = _recording()
    run.route = "traced"
    run.profiled = lambda *values: (seen.append(torch.get_num_threads()), [])[1]
    wrapped = small.OneThread(run)
    assert wrapped.route == "traced"
    wrapped.profiled(torch.zeros(1))
    assert seen == [1] and torch.get_num_threads() == 2


def test_a_free_batch_cnn_on_a_busy_machine_runs_each_signature_on_one_thread(
        two_threads, monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: True)
    monkeypatch.setattr(small, "SMALL_SECONDS", 1.0)  # small whatever the neighbours of the test do
    session = InferenceSession(small_cnn(), backends=["CpuAcc", "CpuRef"],
                               runtime=Runtime(RuntimeOptions(backend_options={"CpuAcc.threads": 2})))
    reference = InferenceSession(small_cnn(), backends=["CpuRef"])
    for shape in ((1, 3, 16, 16), (2, 3, 12, 20)):
        feeds = {"x": np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)}
        (want,) = reference.run(None, feeds)
        (got,) = session.run(None, feeds)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
        assert torch.get_num_threads() == 2
    built = list(_specialized(session).built.values())
    assert len(built) == 2 and all(isinstance(runner, small.OneThread) for runner in built)


def test_the_fewest_threads_within_the_margin_of_the_fastest_are_kept(monkeypatch) -> None:
    """On 16 CPUs the counts are 16, 8, 4, 2 and 1: 2 threads within MARGIN of 4's best is kept."""
    assert small.counts(16) == [16, 8, 4, 2, 1] and small.counts(2) == [2, 1]
    assert small.counts(6) == [6, 3, 1] and small.counts(1) == [1]
    monkeypatch.setattr(threads, "crowded", lambda: False)
    seconds = {16: 1.0e-4, 8: 0.5e-4, 4: 0.42e-4, 2: 0.45e-4, 1: 0.9e-4}
    monkeypatch.setattr(small, "_seconds", lambda run, values: seconds[torch.get_num_threads()])
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        seen, run = _recording()
        chosen = small.fewer_threads(run, [torch.zeros(1)])
        assert {8, 4, 2, 1} <= set(seen)  # each new count warmed up in this thread
        assert type(chosen) is small.AtThreads and chosen.count == 2 and chosen.work is run
        seen.clear()
        chosen(torch.zeros(1))
        assert seen == [2] and torch.get_num_threads() == 16
        torch.set_num_threads(1)  # a caller at fewer threads than chosen keeps its own count
        chosen(torch.zeros(1))
        assert seen == [2, 1]
    finally:
        torch.set_num_threads(before)


def test_a_static_compiled_partition_given_two_threads_runs_on_one_where_that_is_not_slower(
        two_threads, monkeypatch) -> None:
    """A static partition that CpuAcc's background compiles (a OneDnnGraph layer) chooses its
    threads as a Specialized build does, at a call once its routes are chosen (``small.static``)."""
    from backplane.backends.torch import background

    from tests.backends.torch.test_onednn_graph import MODEL, _graph_workload
    from tests.models.test_models import DATA, assert_close, ort_outputs

    monkeypatch.setattr(threads, "crowded", lambda: False)
    # one thread as fast as two, from the start: a run inside ``settle`` may be the one that
    # decides (timed on the H100 machine's 16-CPU Xeon, two threads were faster and kept)
    monkeypatch.setattr(small, "_seconds", lambda run, values: 1e-4)
    session = InferenceSession(MODEL, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.background": True, "CpuAcc.threads": 2})))
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    expected = ort_outputs(MODEL, feeds)
    assert background.settle(lambda: assert_close(session.run(None, feeds), expected), 120)
    undecided = _graph_workload(session).work  # Swapped -> the background's build
    assert isinstance(undecided, small.Undecided)
    for _ in range(3):  # one thread kept, the caller's two back after each run
        assert_close(session.run(None, feeds), expected)
        assert torch.get_num_threads() == 2
    assert isinstance(undecided.decided, small.OneThread)


def test_a_build_decided_while_the_governor_holds_fewer_threads_compares_up_to_its_ceiling(
        monkeypatch) -> None:
    """A session's ceiling of 2 (``AtMost``) whose governor holds one thread at the build's first
    calls (other processes, or this process's compilers, held a CPU): the counts compared are the
    ceiling's, so the build keeps one thread once the governor gives two again. Up to the moment's
    count there was no choice, and the build ran at the governor's two on the quiet machine
    (``CpuAcc.inductor``'s first calls after its compile: gpt_causal_ts15 0.3 -> 0.5 ms)."""
    import threading

    monkeypatch.setattr(threads, "_APPLIED", threading.local())  # this test's governor alone
    monkeypatch.setattr(threads, "crowded", lambda: False)
    seconds = {2: 2.0e-4, 1: 1.0e-4}  # one thread the faster, as a small partition's
    monkeypatch.setattr(small, "_seconds", lambda run, values: seconds[torch.get_num_threads()])
    before = torch.get_num_threads()
    governor = threads.ThreadGovernor(2, frozenset({0, 1}), read=lambda cpus: None,
                                      apply=torch.set_num_threads)
    try:
        governor.threads = 1  # busy at the build's first calls
        governor.tick()
        assert torch.get_num_threads() == 1 and threads.quiet_count() == 2
        seen, run = _recording()
        chosen = small.fewer_threads(run, [torch.zeros(1)])
        assert isinstance(chosen, small.OneThread) and chosen.work is run
        governor.threads = 2  # quiet again
        governor.tick()
        seen.clear()
        chosen(torch.zeros(1))
        assert seen == [1] and torch.get_num_threads() == 2
        torch.set_num_threads(1)  # a count set past the governor: no ceiling of its
        assert threads.quiet_count() == 1
    finally:
        torch.set_num_threads(before)


def test_a_fixed_count_reads_no_ceiling_of_another_sessions_governor(monkeypatch) -> None:
    """A governor that last applied one thread, then a session of a fixed one thread (its
    TorchContext): the count is that session's, not the governor's, so ``quiet_count`` is 1 and
    a build of the fixed session is not compared up to the governor's two (it was wrapped in a
    ``OneThread`` for nothing: the VAD's run one Python frame more after another test's session)."""
    import threading

    from backplane.backends.torch.backend import TorchContext

    monkeypatch.setattr(threads, "_APPLIED", threading.local())
    before = torch.get_num_threads()
    governor = threads.ThreadGovernor(2, frozenset({0, 1}), read=lambda cpus: None,
                                      apply=torch.set_num_threads)
    try:
        governor.threads = 1
        governor.tick()
        assert threads.quiet_count() == 2  # the governor's count: its ceiling
        TorchContext(1)
        assert torch.get_num_threads() == 1 and threads.quiet_count() == 1
    finally:
        torch.set_num_threads(before)

