"""A large bidirectional RNN, GRU or LSTM on CpuAcc runs its two directions at once, the backward
one on a worker thread (``recurrent_parallel.directions``), where the caller has two threads or
more: the values of one fused call (bit for bit), CpuRef's and ONNX Runtime's; on one thread one
call; in a TorchScript trace one op that decides at each run; NaN stays in its direction.

    python -m pytest tests/backends/torch/test_recurrent_parallel.py -q -p no:cacheprovider
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from backplane.backends.torch import small  # noqa: E402
from backplane.backends.torch.kernels import (  # noqa: E402
    recurrent,
    recurrent_fused,
    recurrent_parallel,
)
from tests.backends.torch.test_recurrent_native import (  # noqa: E402
    ACC,
    GATES,
    onnxruntime,
    recurrent_model,
    run,
)

ATTRS = {"RNN": {}, "GRU": {"linear_before_reset": 1}, "LSTM": {}}
KERNEL = {"RNN": recurrent.rnn, "GRU": recurrent.gru, "LSTM": recurrent.lstm}


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every bidirectional layer at once (``PARALLEL_MACS`` 0, none paired), the caller on two
    threads held to one as a OneThread partition is; the ids of the threads each direction's
    fused call ran on."""
    seen: list[int] = []
    kernel = recurrent_parallel._kernel

    def spy(name: str) -> Any:
        inner = kernel(name)

        def call(*args: Any) -> Any:
            seen.append(threading.get_ident())
            return inner(*args)

        return call

    monkeypatch.setattr(recurrent_parallel, "PARALLEL_MACS", 0)
    monkeypatch.setattr(recurrent_fused, "PAIRED_HIDDEN", {})
    monkeypatch.setattr(recurrent_parallel, "_kernel", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with small.at_threads(1):  # a partition held to one thread (small.OneThread)
            yield seen
    finally:
        torch.set_num_threads(before)


def _at_once(seen: list[int]) -> None:
    assert len(seen) == 2 and seen[0] != seen[1] and threading.get_ident() in seen, \
        f"the two directions did not run at once, one on this thread: {seen}"


def _weights(op: str, hidden: int = 6, width: int = 4, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    rows = GATES[op] * hidden
    return [torch.from_numpy((rng.standard_normal(s) * k).astype(np.float32)) for s, k in
            (((2, rows, width), 0.5), ((2, rows, hidden), 0.4), ((2, 2 * rows), 0.3))]


@pytest.mark.parametrize("op", list(KERNEL))
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("states", [True, False], ids=["states", "zeros"])
def test_at_once_against_onnxruntime_and_cpuref(op: str, layout: int, states: bool,
                                                threads: list[int]) -> None:
    model, feeds = recurrent_model(op, "bidirectional", layout, states, attrs=ATTRS[op])
    got = run(model, feeds, ACC)
    assert threads, "the layer did not run by recurrent_parallel.directions"
    for g, o, r in zip(got, onnxruntime(model, feeds), run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", list(KERNEL))
@pytest.mark.parametrize("layout", [0, 1])
def test_at_once_is_one_calls_values(op: str, layout: int, threads: list[int],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each direction is the same fused kernel on the same values as in one bidirectional call:
    the outputs are that call's bit for bit, the caller's thread count put back."""
    W, R, B = _weights(op, hidden=24, width=16)
    X = torch.randn((3, 9, 16) if layout else (9, 3, 16))
    h0 = torch.randn((3, 2, 24) if layout else (2, 3, 24))
    extra = {"initial_c": torch.randn_like(h0)} if op == "LSTM" else {}
    got = KERNEL[op](X, W, R, B, None, h0, direction="bidirectional", layout=layout, **extra,
                     **ATTRS[op])
    _at_once(threads)
    assert (torch.get_num_threads(), small.caller_threads()) == (1, 2)
    monkeypatch.setattr(recurrent_parallel, "PARALLEL_MACS", 1 << 62)
    want = KERNEL[op](X, W, R, B, None, h0, direction="bidirectional", layout=layout, **extra,
                      **ATTRS[op])
    assert len(threads) == 2  # the one call is recurrent_fused.fused
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("caller", ["two threads", "one thread"])
def test_not_held_one_call(caller: str, threads: list[int]) -> None:
    """A caller at two threads runs the layer as one call on it (its OpenMP team would spin on
    the worker's CPU), as does one at one thread not held from more (no second CPU to take)."""
    W, R, B = _weights("LSTM")
    count = 2 if caller == "two threads" else 1
    torch.set_num_threads(count)  # (outside at_threads' hold: as a caller at that count)
    small._HELD.count = 0
    try:
        recurrent.lstm(torch.randn(5, 1, 4), W, R, B, direction="bidirectional")
    finally:
        small._HELD.count = 2
        torch.set_num_threads(1)
    assert threads == [threading.get_ident()]


def test_on_a_busy_machine_one_call(threads: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where other processes left fewer than two CPUs since the last reading, each handoff would
    wait for a CPU: one call on this thread, on one thread; at the next reading with the CPUs
    free, at once again."""
    from backplane.backends.torch import threads as policy

    share, ticks = [0.0], {"all": 0, "idle": 0}

    def reading(_: Any) -> policy.Sample:  # 1000 ticks a reading, `share` of them idle
        ticks["all"] += 1000
        ticks["idle"] += int(1000 * share[0])
        return policy.Sample(ticks["all"] / 1000, 0.0, ticks["idle"], ticks["all"])

    monkeypatch.setattr(policy, "CROWDED_CHECK", True)
    monkeypatch.setattr(policy, "read_sample", reading)
    monkeypatch.setattr(recurrent_parallel, "BUSY_EVERY", 0.0)
    monkeypatch.setattr(recurrent_parallel, "_reading", [reading(None), False])
    W, R, B = _weights("LSTM")
    recurrent.lstm(torch.randn(5, 1, 4), W, R, B, direction="bidirectional")  # none idle
    assert threads == [threading.get_ident()]
    assert torch.get_num_threads() == 1
    share[0], threads[:] = 1.0, []  # all idle from here
    recurrent.lstm(torch.randn(5, 1, 4), W, R, B, direction="bidirectional")
    if len(recurrent_parallel._cpus()) >= 2:  # (one CPU is never two free)
        _at_once(threads)


def test_below_the_threshold_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small layer (the small tier's, 8 steps, hidden 24) runs as one call: the handoff would
    cost more than it saves."""
    calls: list[str] = []
    monkeypatch.setattr(recurrent_parallel, "directions", lambda *a: calls.append(a[0]))
    monkeypatch.setattr(recurrent, "directions", lambda *a: calls.append(a[0]))
    W, R, B = _weights("LSTM", hidden=24, width=16)
    recurrent.lstm(torch.randn(8, 1, 16), W, R, B, direction="bidirectional")
    assert not calls
    assert recurrent_parallel.at_once(100, 1, 512, 64, 128)  # the full tier's first layer


@pytest.mark.parametrize("op", list(KERNEL))
def test_nan_stays_in_its_direction(op: str, threads: list[int]) -> None:
    model, feeds = recurrent_model(op, "bidirectional", attrs=ATTRS[op])
    feeds["X"][1, 0, 2] = np.nan  # step 1 of sequence 0
    got, want = run(model, feeds, ACC), run(model, feeds, ["CpuRef"])
    assert threads, "the layer did not run by recurrent_parallel.directions"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    y = got[0]  # (seq, dirs, batch, hidden): forward before step 1, backward after it finite
    assert np.isfinite(y[:1, 0, 0]).all() and np.isfinite(y[2:, 1, 0]).all()
    assert np.isnan(y[1:, 0, 0]).all() and np.isnan(y[:2, 1, 0]).all()


def test_a_trace_keeps_one_op_that_decides_at_each_run(threads: list[int],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced and frozen (CpuAcc's Traced layers), the layer is one ``recurrent_directions`` op:
    held to one thread from two its directions run at once, at two as one call at two threads
    (as a trace of that call ran), the values the same."""
    counts: list[int] = []
    kernel = recurrent_parallel._kernel

    def counted(name: str) -> Any:
        inner = kernel(name)

        def call(*args: Any) -> Any:
            counts.append(torch.get_num_threads())
            return inner(*args)

        return call

    monkeypatch.setattr(recurrent_parallel, "_kernel", counted)
    W, R, B = _weights("LSTM", hidden=24, width=16)
    X = torch.randn(9, 1, 16)

    class Layer(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return recurrent.lstm(x, W, R, B, direction="bidirectional")

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's warnings
        frozen = torch.jit.freeze(torch.jit.trace(Layer().eval(), (X,), check_trace=False))
        kinds = [n.kind() for n in frozen.graph.nodes()]
        assert "backplane::recurrent_directions" in kinds and "aten::lstm" not in kinds, kinds
        threads.clear()
        held = frozen(X)
        assert len(threads) == 2 and len(set(threads)) == 2, threads
        counts.clear()
        torch.set_num_threads(2)
        small._HELD.count = 0
        try:
            two = frozen(X)
        finally:
            small._HELD.count = 2
            torch.set_num_threads(1)
        assert counts == [2]
        eager = Layer()(X)
    for a, b, c in zip(held, two, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_an_error_on_the_worker_is_raised_here(threads: list[int]) -> None:
    def failing(*args: Any) -> Any:
        raise ValueError("the backward direction failed")

    pending = recurrent_parallel._submit(failing, 1)
    with pytest.raises(ValueError, match="backward direction failed"):
        pending()
    assert recurrent_parallel._submit(lambda a: a + 1, 1)() == 2  # the worker still serves
