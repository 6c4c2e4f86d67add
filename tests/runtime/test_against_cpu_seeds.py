"""Which models ``backplane.against_cpu`` times on seeded inputs at load, and which at their first
run on the caller's (``at_load``): an integer or boolean input of a model with an If, Loop or Scan
is seeded 0 or 1 and may steer it another way than the caller's (the corpus VAD's sampling rate
picks its If's branch: seeded at 1 the H200 machine timed the 8 kHz branch of a model its inputs
run at 16 kHz). The verdict is pinned (``_turns`` answers given medians after running both
networks on the inputs it is given), so a shared machine's noise decides nothing here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession, against_cpu
from backplane.frontends.onnx import import_onnx
from backplane.frontends.onnx_file import read_model

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
AUTO = [("CpuAcc", {"against_cpuref": "auto"}), "CpuRef"]


def _steered(rate_type: int = TensorProto.INT64, control_flow: bool = True) -> bytes:
    """x (N, 4) through an If on ``rate == 16000``: doubled at that rate, else plus one (or,
    without control flow, the rate's comparison added to x)."""
    def branch(op: str, const: float, name: str):  # noqa: ANN202
        c = helper.make_tensor(f"{name}_c", TensorProto.FLOAT, (), [const])
        return helper.make_graph([helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"]),
                                  helper.make_node("Tanh", [f"{name}_y"], [f"{name}_t"])],
                                 name, [], [helper.make_tensor_value_info(f"{name}_t",
                                                                          TensorProto.FLOAT, None)],
                                 [c])
    nodes = [helper.make_node("Equal", ["rate", "r16k"], ["is16k"])]
    if control_flow:
        nodes += [helper.make_node("Squeeze", ["is16k"], ["cond"]),
                  helper.make_node("If", ["cond"], ["y"], then_branch=branch("Mul", 2.0, "then"),
                                   else_branch=branch("Add", 1.0, "else"))]
    else:
        nodes += [helper.make_node("Cast", ["is16k"], ["f"], to=TensorProto.FLOAT),
                  helper.make_node("Add", ["x", "f"], ["y"])]
    nodes.append(helper.make_node("Relu", ["y"], ["z"]))
    dtype = {TensorProto.INT64: np.int64, TensorProto.FLOAT: np.float32}[rate_type]
    graph = helper.make_graph(
        nodes, "steered", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ("N", 4)),
                           helper.make_tensor_value_info("rate", rate_type, (1,))],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [helper.make_tensor("r16k", rate_type, (1,), np.array([16000], dtype))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime 1.30 (the GPU machine's) refuses onnx 1.23's IR 14
    return model.SerializeToString()


@pytest.mark.parametrize("model, seeded", [
    (lambda: _steered(), False),  # an integer input and an If: at the first run
    (lambda: _steered(TensorProto.FLOAT), True),  # a float rate: seeded as before
    (lambda: _steered(control_flow=False), True),  # an integer input, no control flow
    (lambda: str(CORPUS / "vad_lstm_if_ts16.onnx"), False),  # its sampling rate, int64
    (lambda: str(CORPUS / "cond_nested_dyn18.onnx"), True),  # an If on float inputs alone
])
def test_integer_inputs_steering_control_flow_are_not_seeded(model, seeded) -> None:
    assert against_cpu.at_load(import_onnx(read_model(model()))) is seeded


def test_a_steered_if_is_timed_on_the_first_runs_inputs(monkeypatch) -> None:
    """Not timed at load (no turns, no measurement); timed at the first run on the caller's rate,
    each network run on it, the faster kept (CpuRef's, by the pinned medians), its outputs the
    model's at that rate and at another after."""
    given: list[dict] = []

    def turns(runtime, ids, feeds, budget_s):
        for network_id in ids.values():
            runtime.run(network_id, feeds)
        given.append(dict(feeds))
        return {"placed": 0.05, "other": 0.02}

    monkeypatch.setattr(against_cpu, "_turns", turns)
    # The rule made to hold for this model (its If is decided per predicate, compiled whole,
    # which CONTROL_FLOW leaves alone; the GPU rule holds for any model, but wants a GPU), and
    # every run small enough to time on a busy machine.
    monkeypatch.setattr(against_cpu, "CONTROL_FLOW", dataclasses.replace(
        against_cpu.CONTROL_FLOW, limit_ms=1e6, holds=lambda network: True))
    session = InferenceSession(_steered(), providers=AUTO)
    assert "CpuAcc" in session.report.counts()
    assert not given and not session.report.measurements
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    rate = np.array([16000], np.int64)
    np.testing.assert_allclose(session.run(None, {"x": x, "rate": rate})[0],
                               np.maximum(np.tanh(x * 2), 0), rtol=1e-6)
    assert len(given) == 1 and given[0]["rate"].tolist() == [16000]
    assert all("the first run's inputs" in m.note for m in session.report.measurements)
    assert [m.backend for m in session.report.measurements if m.chosen] == ["CpuRef"]
    np.testing.assert_allclose(session.run(None, {"x": x, "rate": np.array([8000])})[0],
                               np.maximum(np.tanh(x + 1), 0), rtol=1e-6)
    assert len(given) == 1  # timed once
