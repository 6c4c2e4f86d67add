"""Ifs decided before the run (optimizer/decided.py, builtin/decided.py): an If whose predicate the
model's small inputs compute runs as the version of the network with its branch inlined, one
partition where CpuAcc takes it; a constant predicate inlines its branch; a predicate computed from
data keeps the nested branch networks. Each case is held to ONNX Runtime and to CpuRef, both
branches in one session, in both orders."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.runtime.runtime import within
from tests.backends.test_control_flow_fast import check as checked
from tests.conftest import float_input, host_backend_lists, make_model

pytest.importorskip("onnxruntime")  # the reference of check()
RNG = np.random.default_rng(7)
W_THEN = RNG.standard_normal((4, 3)).astype(np.float32)
W_ELSE = RNG.standard_normal((4, 5)).astype(np.float32)
W_OUT = RNG.standard_normal((1, 6)).astype(np.float32)


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def branch(name: str, weight: str, act: str, out: str) -> onnx.GraphProto:
    """x (outer, [N, 4]) @ weight, then act: [N, 3] or [N, 5] (the branches differ in shape)."""
    nodes = [helper.make_node("MatMul", ["x", weight], [f"{name}_mm"]),
             helper.make_node(act, [f"{name}_mm"], [out])]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, 1, None)])


def sr_model(tail: bool = True) -> onnx.ModelProto:
    """The VAD's pattern: cond = Cast(Equal(Gather(sr, 0), 16000)), an If whose branches give
    tensors of different widths, then layers after it (a ReduceMean over the width, a Gemm)."""
    nodes = [helper.make_node("Gather", ["sr", "zero"], ["sr0"], axis=0),
             helper.make_node("Equal", ["sr0", "rate"], ["eq"]),
             helper.make_node("Cast", ["eq"], ["cond"], to=TensorProto.BOOL),
             helper.make_node("If", ["cond"], ["picked"],
                              then_branch=branch("then", "w_then", "Relu", "t_out"),
                              else_branch=branch("else", "w_else", "Tanh", "e_out"))]
    outputs = [float_input("picked", ["batch", None])]
    if tail:
        nodes += [helper.make_node("ReduceMean", ["picked"], ["mean"], axes=[1], keepdims=1),
                  helper.make_node("Concat", ["x", "mean", "mean"], ["joined"], axis=1),
                  helper.make_node("Gemm", ["joined", "w_out"], ["y"], transB=1)]
        outputs = [float_input("y", ["batch", 1]), *outputs]
    inits = [const("zero", np.int64(0)), const("rate", np.int64(16000)),
             const("w_then", W_THEN), const("w_else", W_ELSE), const("w_out", W_OUT)]
    return make_model(nodes, [float_input("x", ["batch", 4]),
                              helper.make_tensor_value_info("sr", TensorProto.INT64, [1])],
                      outputs, inits, opset=13)


def data_model() -> onnx.ModelProto:
    """The predicate from data: ReduceSum(x) > 0 (stays a nested If)."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero_f"], ["cond"]),
             helper.make_node("If", ["cond"], ["picked"],
                              then_branch=branch("then", "w_then", "Relu", "t_out"),
                              else_branch=branch("else", "w_else", "Tanh", "e_out"))]
    return make_model(nodes, [float_input("x", ["batch", 4])], [float_input("picked", None)],
                      [const("zero_f", np.float32(0)), const("w_then", W_THEN),
                       const("w_else", W_ELSE)], opset=13)


def check(model: onnx.ModelProto, feeds_list: list[dict], backends: list[str]) -> InferenceSession:
    """Every feed through one session, against ONNX Runtime and CpuRef (NaN where they have it)."""
    return checked(model, feeds_list, backends, rtol=1e-5, atol=1e-6)


def feeds(rate: int, batch: int = 2, x: np.ndarray | None = None) -> dict:
    x = RNG.standard_normal((batch, 4)).astype(np.float32) if x is None else x
    return {"x": x, "sr": np.array([rate], np.int64)}


@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
def test_both_branches_in_one_session(backends):
    runs = [feeds(16000), feeds(8000), feeds(16000, 3), feeds(8000, 1), feeds(16000)]
    session = check(sr_model(), runs, backends)
    placement = session.optimized.report.layers[_if_name(session)]
    assert placement.note.startswith("decided by input sr")
    top = session.optimized.graph.layers
    assert [layer.op_type for layer in top] == ["DecidedIf"]
    versions = [top[0].attrs["then_branch"], top[0].attrs["else_branch"]]
    for version in versions:  # the branch inlined: no If, the predicate's layers gone
        ops = [layer.op_type for net in within(version) for layer in net.graph.layers]
        assert "If" not in ops and "Equal" not in ops
    if backends[0] == "CpuAcc":  # the whole network one CpuAcc partition
        assert all(v.report.partitions == ["CpuAcc"] for v in versions)
        assert "then_branch: 1 partitions (CpuAcc)" in str(session.optimized.report)


def _if_name(session: InferenceSession) -> str:
    return next(p.name for p in session.optimized.report.layers.values() if p.op_type == "If")


@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
def test_data_predicate_keeps_nested_branches(backends):
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    session = check(data_model(), [{"x": np.abs(x)}, {"x": -np.abs(x)}, {"x": np.abs(x)}],
                    backends)
    layers = session.optimized.graph.layers
    assert any(layer.op_type == "If" for layer in layers)
    assert not any(layer.op_type == "DecidedIf" for layer in layers)
    assert "not computed from small inputs" in session.optimized.report.layers[_if_name(session)].note


@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
def test_nan_in_nan_out_and_outputs_the_callers(backends):
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    x[1, 2] = np.nan
    session = check(sr_model(), [feeds(16000, x=x), feeds(8000, x=x)], backends)
    for rate in (16000, 8000):
        y, picked = session.run(None, feeds(rate, x=x))
        assert np.isnan(y[1, 0]) and not np.isnan(y[0, 0])
        again = session.run(None, feeds(rate, x=x * 0))  # a later run leaves ours alone
        assert not np.shares_memory(picked, again[1]) and np.isnan(y[1, 0])
        picked[...] = 7  # ours to write: the next run is not changed by it
        np.testing.assert_allclose(session.run(None, feeds(rate, x=x))[1][0],
                                   check_branch(x, rate)[0], rtol=1e-5)


def check_branch(x: np.ndarray, rate: int) -> np.ndarray:
    return np.maximum(x @ W_THEN, 0) if rate == 16000 else np.tanh(x @ W_ELSE)


def test_float_predicate_input_nan():
    """A float input deciding the If: NaN > 0.5 is false, the else branch (as ONNX Runtime)."""
    nodes = [helper.make_node("Greater", ["t", "half"], ["cond"]),
             helper.make_node("If", ["cond"], ["picked"],
                              then_branch=branch("then", "w_then", "Relu", "t_out"),
                              else_branch=branch("else", "w_else", "Tanh", "e_out"))]
    model = make_model(nodes, [float_input("x", ["batch", 4]), float_input("t", [1])],
                       [float_input("picked", None)],
                       [const("half", np.float32(0.5)), const("w_then", W_THEN),
                        const("w_else", W_ELSE)], opset=13)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    runs = [{"x": x, "t": np.array([v], np.float32)} for v in (np.nan, 1.0, np.nan, 0.0)]
    session = check(model, runs, ["CpuAcc", "CpuRef"])
    assert session.optimized.graph.layers[0].op_type == "DecidedIf"


def test_branch_giving_an_input_back():
    """A branch that gives the outer input as it is: the output is a copy, not the caller's feed."""
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t_out"])], "then", [],
                             [helper.make_tensor_value_info("t_out", 1, None)])
    nodes = [helper.make_node("Gather", ["sr", "zero"], ["sr0"], axis=0),
             helper.make_node("Equal", ["sr0", "rate"], ["cond"]),
             helper.make_node("If", ["cond"], ["picked"], then_branch=then,
                              else_branch=branch("else", "w_else", "Tanh", "e_out"))]
    model = make_model(nodes, [float_input("x", ["batch", 4]),
                               helper.make_tensor_value_info("sr", TensorProto.INT64, [1])],
                       [float_input("picked", None)],
                       [const("zero", np.int64(0)), const("rate", np.int64(16000)),
                        const("w_else", W_ELSE)], opset=13)
    given = feeds(16000)
    session = check(model, [given, feeds(8000), given], ["CpuAcc", "CpuRef"])
    (picked,) = session.run(None, given)
    assert not np.shares_memory(picked, given["x"])


def test_two_ifs_four_versions():
    """Two Ifs decided by two inputs: every pair of values, in one session."""
    second = helper.make_graph([helper.make_node("Mul", ["picked", "two"], ["s_out"])], "s_then",
                               [], [helper.make_tensor_value_info("s_out", 1, None)])
    second_else = helper.make_graph([helper.make_node("Neg", ["picked"], ["n_out"])], "s_else",
                                    [], [helper.make_tensor_value_info("n_out", 1, None)])
    base = sr_model(tail=False)
    graph = base.graph
    graph.node.extend([helper.make_node("Cast", ["mode"], ["mode_b"], to=TensorProto.BOOL),
                       helper.make_node("If", ["mode_b"], ["out"], then_branch=second,
                                        else_branch=second_else)])
    graph.input.append(helper.make_tensor_value_info("mode", TensorProto.INT64, []))
    graph.initializer.append(const("two", np.float32(2)))
    del graph.output[:]
    graph.output.append(float_input("out", None))
    runs = [{**feeds(rate), "mode": np.array(mode, np.int64)}
            for rate, mode in ((16000, 1), (8000, 0), (8000, 1), (16000, 0), (16000, 1))]
    session = check(base, runs, ["CpuAcc", "CpuRef"])
    (outer,) = session.optimized.graph.layers
    inner = [outer.attrs[b].graph.layers for b in ("then_branch", "else_branch")]
    assert all([layer.op_type for layer in layers] == ["DecidedIf"] for layers in inner)


def test_constant_predicate_inlined():
    """A predicate constant folding decides: the If is its branch, no builtin layer left."""
    model = sr_model()
    for node in model.graph.node:  # sr replaced by a constant: Gather(rate_c, 0)
        if node.op_type == "Gather":
            node.input[0] = "rate_c"
    model.graph.initializer.append(const("rate_c", np.array([8000], np.int64)))
    session = check(model, [feeds(8000), feeds(16000)], ["CpuAcc", "CpuRef"])
    ops = [layer.op_type for layer in session.optimized.graph.layers]
    assert "If" not in ops and "DecidedIf" not in ops


def test_profile_names_the_branch_taken():
    session = InferenceSession(sr_model(), backends=["CpuAcc", "CpuRef"])
    for rate, branch_name in ((8000, "else_branch"), (16000, "then_branch")):
        _, timings = session.run_profiled(None, feeds(rate))
        names = [t.layer for t in timings]
        assert names[0].endswith(f"({branch_name} taken)")
        assert all(name.startswith(f"{_if_name(session)}/{branch_name}/") for name in names[1:])


def test_weights_too_large_for_versions_stay_nested(monkeypatch):
    """Past ``MAX_BYTES`` of weights the network is not loaded once per branch: the If runs its
    nested branches, and the report says why."""
    from backplane.optimizer import decided

    monkeypatch.setattr(decided, "MAX_BYTES", 64)
    session = check(sr_model(), [feeds(16000), feeds(8000)], ["CpuAcc", "CpuRef"])
    assert any(layer.op_type == "If" for layer in session.optimized.graph.layers)
    assert "too large" in session.optimized.report.layers[_if_name(session)].note


def test_runs_from_several_threads_take_their_own_branch():
    """Runs of both predicate values at once, from four threads: each gets its own version's
    answer."""
    from concurrent.futures import ThreadPoolExecutor

    session = InferenceSession(sr_model(), backends=["CpuAcc", "CpuRef"])
    reference = InferenceSession(sr_model(), backends=["CpuRef"])
    cases = [feeds(16000 if i % 2 else 8000, batch=1 + i % 3) for i in range(40)]
    wanted = [reference.run(None, case) for case in cases]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda case: session.run(None, case), cases))
    for answer, want in zip(got, wanted):
        for a, b in zip(answer, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
