"""A small CpuAcc partition runs on one thread where that is as fast (issue 27, item 4): each
Specialized signature's build is timed at one thread and at the caller's count (``small.py``); a
busy machine takes one thread for a small build without comparing; a large one keeps the count."""

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
