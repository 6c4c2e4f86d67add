"""oneDNN Graph fusion is one process-wide TorchScript switch, which compiled calls turn on and traces
without the fuser turn off (``fusion.compiled.fusion_switch``). Saved and restored by each call, two
threads' first runs of one session left it on for the process, and every later trace in it was
fused: a traced LSTM lost the NaN of its input, routes changed (test_traced_recurrent and test_traced
failed after test_compile_at_first_run's two-thread case in one process). Now it is back as it was
after the last block, and a block that wants it the other way waits for the others."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.compiled import fusion_switch  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_graph_rule import _cnn  # noqa: E402

X = np.random.default_rng(5).standard_normal((1, 3, 16, 16)).astype(np.float32)


def _compiled_session() -> InferenceSession:
    options = {"CpuAcc.route_cache": False, "CpuAcc.compile": "onednn_graph"}
    return InferenceSession(_cnn(), backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _in_threads(count: int, work) -> list:
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(work())) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("attempt", range(3))
def test_first_runs_in_several_threads_leave_the_switch_as_it_was(attempt: int) -> None:
    assert not torch.jit.onednn_fusion_enabled()
    session = _compiled_session()
    want = InferenceSession(_cnn(), backends=["CpuRef"]).run(None, {"x": X})[0]
    results = _in_threads(4, lambda: [session.run(None, {"x": X})[0] for _ in range(5)])
    assert not torch.jit.onednn_fusion_enabled()
    for runs in results:
        for got in runs:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_block_that_wants_it_off_waits_for_the_blocks_that_hold_it_on() -> None:
    inside, release, entered = threading.Event(), threading.Event(), []

    def holder() -> None:
        with fusion_switch(True):
            inside.set()
            release.wait(10)

    def other() -> None:
        with fusion_switch(False):
            entered.append(torch.jit.onednn_fusion_enabled())

    first = threading.Thread(target=holder)
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=other)
    second.start()
    time.sleep(0.2)  # time enough to enter, were it not held
    assert entered == [] and torch.jit.onednn_fusion_enabled()
    release.set()
    first.join(10)
    second.join(10)
    assert entered == [False]
    assert not torch.jit.onednn_fusion_enabled()


def test_the_callers_own_setting_comes_back() -> None:
    torch.jit.enable_onednn_fusion(True)
    try:
        with fusion_switch(False):
            assert not torch.jit.onednn_fusion_enabled()
            with fusion_switch(False):
                pass
            assert not torch.jit.onednn_fusion_enabled()
        assert torch.jit.onednn_fusion_enabled()
    finally:
        torch.jit.enable_onednn_fusion(False)
