"""A network that is one native plan runs it on the caller's NumPy arrays (runtime/host_route.py):
``ArenaExecutor.host`` gives what the torch route gives, fresh outputs the caller's alone; an offer
is read only from the workload that made it; and the session's direct run calls the plan itself,
its outputs still the caller's, NaN through, other shapes and wrong feeds as before."""

from __future__ import annotations

import numpy as np
import pytest

from backplane import InferenceSession
from backplane.native import build
from backplane.runtime import host_route

torch = pytest.importorskip("torch")
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
MODEL = "tests/data/corpus/resnet_basic_ts16.onnx"  # input N x 3 x H x W: a Specialized layer
FEEDS = dict(np.load("tests/data/corpus/resnet_basic_ts16.s0.npz"))


def _reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return InferenceSession(MODEL, backends=["CpuRef"]).run(None, feeds)


def _close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, float(abs(w).max())))


def _executor() -> object:
    """The native plan of the model at FEEDS' shapes (CpuAcc, static shapes: one OneDnnGraph)."""
    shapes = {k: list(v.shape) for k, v in FEEDS.items()}
    session = InferenceSession(MODEL, backends=["CpuAcc", "CpuRef"], input_shapes=shapes)
    loaded = session.runtime.network(session.network_id)
    found = [getattr(s.workload, "executor", None) for s in loaded.steps]
    (executor,) = [e for e in found if e is not None]
    return executor


@needs_compiler
def test_a_native_plan_runs_on_numpy_arrays_as_through_torch() -> None:
    executor = _executor()
    (x,) = FEEDS.values()
    first = executor.host(x)  # type: ignore[attr-defined]
    for g, w in zip(first, executor.numpy(x)):  # type: ignore[attr-defined]  # its plain run
        np.testing.assert_array_equal(g, w)
    _close(sorted(first, key=np.ndim), sorted(_reference(FEEDS), key=np.ndim))  # plan's order
    kept = [o.copy() for o in first]
    second = executor.host(x * 2)  # type: ignore[attr-defined]
    for a, b in zip(first, kept):
        np.testing.assert_array_equal(a, b)  # the next call wrote nothing of the first's
    assert not any(np.shares_memory(a, b) for a in first for b in (*second, x))
    # another dtype, or strided: copied to the plan's float32 first, the same results
    strided = np.repeat(x, 2, axis=3)[..., ::2]
    assert not strided.flags.c_contiguous
    for given in (x.astype(np.float64), strided):
        for g, w in zip(executor.host(given), first):  # type: ignore[attr-defined]
            np.testing.assert_array_equal(g, w)
    nan = x.copy()
    nan.reshape(-1)[5] = np.nan
    got = sorted(executor.host(nan), key=np.ndim)  # type: ignore[attr-defined]
    assert np.isnan(got[0]).any()
    for g, w in zip(got, sorted(_reference({"input": nan}), key=np.ndim)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    with pytest.raises(ValueError, match=r"shape \(1, 3, 16, 16\), planned for \(1, 3, 32, 32\)"):
        executor.host(np.zeros((1, 3, 16, 16), np.float32))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="2 inputs given, 1 planned"):
        executor.host(x, x)  # type: ignore[attr-defined]


def test_an_offer_is_read_only_from_the_workload_that_made_it() -> None:
    from backplane.backends.torch import small

    def work(*values: object) -> tuple[object, ...]:
        return values

    def host(*values: np.ndarray) -> list[np.ndarray]:
        return [v.copy() for v in values]

    assert host_route.of(work) is None
    host_route.offer(work, host)
    assert host_route.of(work) is host

    def copied(*values: object) -> tuple[object, ...]:  # as reduced.at_edges wraps a run
        return work(*values)

    copied.__dict__.update(work.__dict__)
    assert host_route.of(copied) is None  # its run converts: not the offer of what it wraps
    assert host_route.of(small.OneThread(work)) is None  # a Wrapper forwards the attribute
    assert host_route.of(small.unwrapped(small.OneThread(work))) is host

    def outer(*values: object) -> tuple[object, ...]:
        return inner(*values)

    def inner(*values: object) -> tuple[object, ...]:
        return values

    host_route.forward(outer, inner)
    assert host_route.hosted(outer) is None  # nothing to lend
    inner.hosted = host_route.Hosted({((2,),): host})  # type: ignore[attr-defined]
    host_route.forward(outer, inner)
    assert host_route.hosted(outer) is inner.hosted  # type: ignore[attr-defined]
    inner.hosted = {((2,),): host}  # type: ignore[attr-defined]  # a plain dict: not Hosted
    assert host_route.hosted(inner) is None


def _offering(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """native_cnn's workloads offering their executor's ``host`` (the line native_cnn._workload
    is to hold: until then the test sets it), and a count of its calls."""
    from backplane.backends.torch.fusion import native_cnn
    from backplane.native.arena import ArenaExecutor

    calls: list[int] = []
    real_host, real_workload = ArenaExecutor.host, native_cnn._workload

    def counted(self: ArenaExecutor, *values: np.ndarray) -> list[np.ndarray]:
        calls.append(1)
        return real_host(self, *values)

    def offered(executor: ArenaExecutor, *args: object, **kwargs: object) -> object:
        run = real_workload(executor, *args, **kwargs)
        if host_route.of(run) is None:
            host_route.offer(run, executor.host)
        return run

    monkeypatch.setattr(ArenaExecutor, "host", counted)
    monkeypatch.setattr(native_cnn, "_workload", offered)
    return calls


@needs_compiler
def test_the_direct_run_calls_a_lone_native_plan_on_the_callers_arrays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _offering(monkeypatch)
    session = InferenceSession(MODEL, backends=[("CpuAcc", {"background": False}), "CpuRef"])
    want = _reference(FEEDS)
    _close(session.run(None, FEEDS), want)  # the first run builds the signature (torch's route)
    calls.clear()
    got = session.run(None, FEEDS)
    assert calls == [1]  # fails before: the run went through torch's tensors
    _close(got, want)
    for value in got:
        value[...] = np.nan  # the caller's to write
    again = session.run(None, FEEDS)
    _close(again, want)
    assert not any(np.shares_memory(a, b) for a in again for b in (*got, *FEEDS.values()))
    assert session.run(["features"], FEEDS)[0].shape == want[1].shape
    nan = {"input": FEEDS["input"].copy()}
    nan["input"].reshape(-1)[11] = np.nan
    for g, w in zip(session.run(None, nan), _reference(nan)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    # another batch: a second signature, built through torch's route; its runs match too
    two = {"input": np.concatenate([FEEDS["input"], FEEDS["input"] * 0.5])}
    for _ in range(2):
        _close(session.run(None, two), _reference(two))
    _close(session.run(None, FEEDS), want)
    with pytest.raises(Exception, match="input"):  # a wrong rank: the full check names it
        session.run(None, {"input": FEEDS["input"][0]})


def test_two_native_runs_chain_as_native_cnn_then_calls_them() -> None:
    def head(*values: np.ndarray) -> tuple[np.ndarray, ...]:
        return values

    def after(*values: np.ndarray) -> tuple[np.ndarray, ...]:
        return values

    host_route.offer(head, lambda a, b: [a + b, a * b])
    assert host_route.chained(head, after, [0, 1], [("made", 1)], [("rest", 0)]) is None
    host_route.offer(after, lambda m, x=None: [m - 1])
    a, b = np.float32([1, 2]), np.float32([3, 4])
    both = host_route.chained(head, after, [1, 0], [("made", 1)], [("made", 0), ("rest", 0)])
    assert both is not None
    made, rest = both(a, b)
    np.testing.assert_array_equal(made, b + a)
    np.testing.assert_array_equal(rest, a * b - 1)
    alone = host_route.chained(head, None, [0, 1], [], [("made", 1)])
    assert alone is not None
    np.testing.assert_array_equal(alone(a, b)[0], a * b)
    # an output given twice is not the caller's alone: no NumPy run
    assert host_route.chained(head, after, [0, 1], [("made", 1)],
                              [("made", 0), ("made", 0)]) is None


def test_a_version_of_a_decided_if_runs_its_kept_native_plan() -> None:
    from backplane.runtime import steps

    calls: list[str] = []

    def workload(x: object) -> tuple[object, ...]:
        calls.append("steps")
        value = np.asarray(x)
        return value * 2, value + 0

    def host(x: np.ndarray) -> list[np.ndarray]:
        calls.append("host")
        return [x * 2, x + 0, x - 1]

    def view(value: object) -> object:  # a handover between host memories
        return value

    step = steps.Step(workload, (0,), (1, 2), ())
    reads = [(1, view, step, None)]  # the step reads the network's second input
    outs = [(0, view, step), (1, view, step)]

    def handed_of(work: object, outputs: list[tuple[int, object, object]]) -> object:
        def call(values: list[object]) -> list[object]:  # the steps' loop, which asks the stop
            calls.append("loop")
            return []

        return steps.owning_call(call, reads, work, step, outputs,  # type: ignore[arg-type]
                                 lambda o, v: o, lambda at, exc: exc)

    run = handed_of(workload, outs)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    run([np.float32(0), x])  # type: ignore[operator]
    assert calls == ["steps"]  # nothing kept: the step
    workload.hosted = host_route.Hosted()  # type: ignore[attr-defined]
    run = handed_of(workload, outs)
    assert run.parts[1] is workload  # type: ignore[attr-defined]  # direct_run's
    calls.clear()
    run([np.float32(0), x])  # type: ignore[operator]
    workload.hosted[((2, 3),)] = host  # type: ignore[attr-defined]  # kept at its build, later
    got = run([np.float32(0), x])  # type: ignore[operator]
    assert calls == ["steps", "host"]
    np.testing.assert_array_equal(got[0], x * 2)
    np.testing.assert_array_equal(got[1], x)
    assert not np.shares_memory(got[1], x)
    calls.clear()
    run([np.float32(0), np.zeros((4, 3), np.float32)])  # type: ignore[operator]  # other shapes
    run([np.float32(0), torch.zeros(2, 3)])  # type: ignore[operator]  # not NumPy
    token = steps.STOP.set(object())  # under a stop: the steps, which ask it
    try:
        run([np.float32(0), x])  # type: ignore[operator]
    finally:
        steps.STOP.reset(token)
    assert calls == ["steps", "steps", "loop"]
    calls.clear()
    handed_of(workload, [(0, view, step), (0, view, step)])([np.float32(0), x])  # type: ignore
    assert calls == ["steps"]  # an output given twice: not the kept run


@needs_compiler
@pytest.mark.parametrize("model", ["resnet_basic_ts16", "vad_lstm_if_ts16"])
def test_a_compiled_session_runs_its_native_plans_on_the_callers_arrays(
        model: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the compile cache (a Delegate of CpuAcc's blob, its sequence of one Specialized
    step: the forwards), a lone native plan (resnet_basic) and a DecidedIf's version that is a
    native CNN then a native recurrent plan (the VAD: native_cnn._then's chained run)."""
    from backplane.native.arena import ArenaExecutor

    path = f"tests/data/corpus/{model}.onnx"
    feeds = dict(np.load(f"tests/data/corpus/{model}.s0.npz"))
    calls: list[int] = []
    real = ArenaExecutor.host

    def counted(self: ArenaExecutor, *values: np.ndarray) -> list[np.ndarray]:
        calls.append(1)
        return real(self, *values)

    monkeypatch.setattr(ArenaExecutor, "host", counted)
    session = InferenceSession(path, backends=[("CpuAcc", {"background": False}), "CpuRef"],
                               cache_dir=str(tmp_path))
    want = __import__("onnxruntime").InferenceSession(path).run(None, feeds)
    for _ in range(2):
        _close(session.run(None, feeds), want)
    calls.clear()
    got = session.run(None, feeds)
    assert calls  # fails before: the run went through torch's tensors
    _close(got, want)
    again = session.run(None, feeds)
    assert not any(np.shares_memory(a, b) for a in again for b in (*got, *feeds.values()))
