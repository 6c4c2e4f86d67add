"""On a busy machine at two threads a trace leaves a recurrent layer apart (``traced._alone``: a
trace keeps torch's ops, not the thread count its kernel sets around them), except a layer whose
steps run in backplane's C (``CpuAcc.native`` "auto", ``recurrent.steps_in_c``): that loop runs
on the calling thread whatever torch's count, and left apart the small tier's lstm_bi2_ts14 lost
its one native call (2 threads, a warm route cache, load 4.4: 283 us a run against 8.8)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import traced  # noqa: E402
from backplane.native import build  # noqa: E402

CORPUS = "tests/data/corpus"


@pytest.fixture
def busy_two_threads(monkeypatch):
    monkeypatch.setattr(traced, "_busy", lambda: True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("native", ["auto", "off"])
def test_a_busy_machine_keeps_a_native_lstm_in_its_trace(busy_two_threads, native) -> None:
    if native == "auto" and build.compiler() is None:
        pytest.skip("no C compiler: the LSTM's steps are torch's")
    feeds = dict(np.load(f"{CORPUS}/lstm_bi2_ts14.s0.npz"))
    session = InferenceSession(f"{CORPUS}/lstm_bi2_ts14.onnx",
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               backends=[("CpuAcc", {"route_cache": False, "native": native}),
                                         "CpuRef"])
    ops = [layer.op_type for layer in session.optimized.graph.layers
           if layer.op_type not in ("MemImport", "MemCopy")]
    if native == "auto":  # both LSTMs inside the one trace (one C call: recurrent_net)
        assert ops == ["Traced"], ops
    else:  # torch's LSTM kernels: each apart, between traces
        assert ops.count("LSTM") == 2 and "Traced" in ops, ops
    want = InferenceSession(f"{CORPUS}/lstm_bi2_ts14.onnx", backends=["CpuRef"]).run(None, feeds)
    for got, ref in zip(session.run(None, feeds), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
