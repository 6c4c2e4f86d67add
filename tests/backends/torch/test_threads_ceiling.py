"""A session's ``intra_op_num_threads`` as a ceiling (``threads.AtMost``): the count on a quiet
machine, fewer while other processes hold the CPUs, the count again after; ``CpuAcc.threads`` as a
backend option stays fixed. The governors are fed made-up readings: no timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from backplane.backends.torch import threads
from backplane.backends.torch.threads import AtMost, Governed, ThreadGovernor
from tests.backends.torch.test_threads import CPUS, Simulated
from tests.conftest import small_cnn_model


def test_a_sessions_count_is_a_ceiling_and_a_backend_count_is_fixed() -> None:
    assert threads.thread_setting(AtMost(2)) is None and threads.ceiling(AtMost(2)) == 2
    assert threads.thread_setting(2) == 2 and threads.ceiling(2) is None
    assert threads.ceiling("auto") is None and threads.ceiling(None) is None
    assert threads.thread_setting(AtMost(0)) is None and threads.ceiling(AtMost(0)) is None
    # a ceiling of one thread is one thread, ungoverned (no tick, no frame more a call)
    assert threads.thread_setting(AtMost(1)) == 1 and threads.ceiling(AtMost(1)) is None
    assert AtMost(2) == 2 and f"{AtMost(2)}" == "2"  # compares and prints as the count


def test_a_quiet_reading_keeps_a_ceiling_above_the_cpus() -> None:
    """4 threads asked on 2 CPUs: a quiet machine keeps 4 (the user's count, as before), a
    neighbour on both CPUs brings 1, its end 4 again."""
    signal = Simulated()
    applied: list[int] = []
    governor = ThreadGovernor(4, CPUS, read=signal, apply=applied.append, period=0.0)
    governor.tick()
    signal.busy = 2.0
    governor.tick()
    signal.busy = 1.0
    governor.tick()
    signal.busy = 0.0
    governor.tick()
    assert applied == [4, 1, 4]


def test_two_governors_called_from_one_thread_each_apply_their_count() -> None:
    """Sessions of two ceilings run in turn from one thread: each call runs at its own count (a
    count kept per governor took the other's for its own)."""
    applied: list[int] = []
    one = ThreadGovernor(1, CPUS, read=lambda cpus: None, apply=applied.append, period=3600.0)
    two = ThreadGovernor(2, CPUS, read=lambda cpus: None, apply=applied.append, period=3600.0)
    for governor in (one, two, one, one, two):
        governor.tick()
    assert applied == [1, 2, 1, 2]


def _steps(session):
    return [step.workload for step in session.runtime.network(session.network_id).steps]


def test_intra_op_num_threads_follows_the_machine_and_comes_back(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from backplane import InferenceSession, SessionOptions

    signal = Simulated()
    governor = ThreadGovernor(2, CPUS, read=signal, apply=torch.set_num_threads, period=0.0)
    monkeypatch.setattr(threads, "_CEILINGS", {2: governor})
    model = small_cnn_model().SerializeToString()
    image = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": image})
    before = torch.get_num_threads()
    try:
        session = InferenceSession(model, SessionOptions(intra_op_num_threads=2),
                                   backends=["CpuAcc", "CpuRef"])
        assert session.backend_options == {"CpuAcc.threads": 2}
        assert any(isinstance(w, Governed) and w.governor is governor for w in _steps(session))
        (quiet,) = session.run(None, {"x": image})
        assert torch.get_num_threads() == 2
        signal.busy = 2.0
        (busy,) = session.run(None, {"x": image})
        assert torch.get_num_threads() == 1
        signal.busy = 0.0
        (back,) = session.run(None, {"x": image})
        assert torch.get_num_threads() == 2 and governor.decisions == {2: 2, 1: 1}
        for got in (quiet, busy, back):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        image[0, 1, 2, 3] = np.nan
        (nan,) = session.run(None, {"x": image})
        assert np.isnan(nan).all()
        fixed = InferenceSession(model, backends=[("CpuAcc", {"threads": 2}), "CpuRef"])
        assert not any(isinstance(w, Governed) for w in _steps(fixed))
    finally:
        torch.set_num_threads(before)


def test_a_sessions_count_is_a_ceiling_through_the_compile_cache_too(tmp_path, monkeypatch) -> None:
    """A session loaded from its compile-cache entry (bench/wild.py's sessions are): the artifact's
    manifest stores the count as a plain int, which made its workloads fixed at 2, ungoverned; at
    its compile and at its load from the cache alike they follow the session's ceiling."""
    torch = pytest.importorskip("torch")
    from backplane import InferenceSession, SessionOptions

    signal = Simulated()
    governor = ThreadGovernor(2, CPUS, read=signal, apply=torch.set_num_threads, period=0.0)
    monkeypatch.setattr(threads, "_CEILINGS", {2: governor})
    path = tmp_path / "cnn.onnx"
    path.write_bytes(small_cnn_model().SerializeToString())
    image = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (want,) = InferenceSession(str(path), backends=["CpuRef"]).run(None, {"x": image})
    before = torch.get_num_threads()
    try:
        for _ in ("compiled", "from the cache"):
            session = InferenceSession(str(path), SessionOptions(intra_op_num_threads=2),
                                       backends=["CpuAcc", "CpuRef"], cache_dir=str(tmp_path / "c"))
            assert any(isinstance(w, Governed) for w in _steps(session))
            signal.busy = 2.0
            (busy,) = session.run(None, {"x": image})
            assert torch.get_num_threads() == 1
            signal.busy = 0.0
            (quiet,) = session.run(None, {"x": image})
            assert torch.get_num_threads() == 2
            for got in (busy, quiet):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert len(list((tmp_path / "c").rglob("*"))) > 0  # the entry the second load read
    finally:
        torch.set_num_threads(before)
