"""A recurrent layer whose kernel runs its steps on one thread (``recurrent.runs_alone``) is kept
out of a trace loaded at more threads on a busy machine, which would hold its ops but not the
thread count; the layers around it are traced in runs of their own, and the whole computes what
CpuRef computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import traced as traced_module  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(11)
SEQ, WIDTH = 12, 8


def _tagger(hidden: int, steps: int = SEQ) -> onnx.ModelProto:
    """x (steps, 1, WIDTH) -> MatMul -> Relu -> Mul -> Add -> LSTM (hidden) -> Squeeze -> MatMul
    -> Sigmoid -> Mul: three layers (after fusion) on each side of the LSTM."""
    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((RNG.standard_normal(shape) * 0.2).astype(np.float32), name)

    inits = [weight("w_in", WIDTH, 16), weight("W", 1, 4 * hidden, 16),
             weight("R", 1, 4 * hidden, hidden), weight("B", 1, 8 * hidden),
             weight("w_out", hidden, 4), numpy_helper.from_array(np.array([1], np.int64), "axis"),
             numpy_helper.from_array(np.float32(2), "two"), numpy_helper.from_array(np.float32(1), "one")]
    nodes = [helper.make_node("MatMul", ["x", "w_in"], ["m"], name="embed"),
             helper.make_node("Relu", ["m"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "two"], ["r2"], name="twice"),
             helper.make_node("Add", ["r2", "one"], ["r3"], name="plus_one"),
             helper.make_node("LSTM", ["r3", "W", "R", "B"], ["y"], name="lstm", hidden_size=hidden),
             helper.make_node("Squeeze", ["y", "axis"], ["s"], name="squeeze"),
             helper.make_node("MatMul", ["s", "w_out"], ["o"], name="head"),
             helper.make_node("Sigmoid", ["o"], ["g"], name="sigmoid"),
             helper.make_node("Mul", ["g", "two"], ["p"], name="double")]
    return make_model(nodes, [float_input("x", [steps, 1, WIDTH])],
                      [float_input("p", [steps, 1, 4])], inits)


def _session(model: onnx.ModelProto, native: str = "auto") -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.compile": "onednn_graph", "CpuAcc.route_cache": False,
                         "CpuAcc.native": native})))


def _where_lstm_runs(session: InferenceSession) -> str:
    for layer in session.optimized.graph.layers:
        if layer.op_type == "LSTM":
            return "alone"
        if layer.op_type == "Traced" and any(lay.op_type == "LSTM" for lay in layer.attrs["layers"]):
            return "traced"
    raise AssertionError("no LSTM layer")


@pytest.mark.parametrize("hidden, steps, count, busy, where", [
    (32, SEQ, 2, True, "alone"), (256, SEQ, 2, True, "alone"), (384, SEQ, 2, True, "traced"),
    (32, 1, 2, True, "traced"), (32, SEQ, 1, True, "traced"), (32, SEQ, 2, False, "traced")])
def test_a_recurrence_on_one_thread_is_not_traced(monkeypatch, hidden: int, steps: int,
                                                  count: int, busy: bool, where: str) -> None:
    """On a busy machine only: on a quiet one the partner thread is not preempted and the trace
    is faster (lstm_bi2_ts14 at 2 threads: 0.37 ms a run traced whole, 0.55-0.60 apart). torch's
    LSTM kernels (``CpuAcc.native`` off): backplane's C loop runs on the calling thread and stays
    traced (tests/backends/torch/test_traced_alone.py)."""
    monkeypatch.setattr(threads, "crowded", lambda: False)  # a load that compiles
    monkeypatch.setattr(traced_module, "_busy", lambda: busy)  # the load average it reads for the LSTM
    model = _tagger(hidden, steps)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        session = _session(model, native="off")
    finally:
        torch.set_num_threads(before)
    assert _where_lstm_runs(session) == where
    if where == "alone":  # the layers before and after it traced on their own
        traced = [lay for lay in session.optimized.graph.layers if lay.op_type == "Traced"]
        assert traced and all(lay.op_type != "LSTM" for t in traced for lay in t.attrs["layers"])
    x = RNG.standard_normal((steps, 1, WIDTH)).astype(np.float32)
    x[-1, 0, 2] = np.nan  # the last step's outputs are NaN, the earlier ones not
    got = session.run(None, {"x": x})[0]
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    assert np.isnan(got[-1]).all() and not np.isnan(got[:-1]).any()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
