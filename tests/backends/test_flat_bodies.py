"""Control-flow bodies as flat call lists (backends/builtin/flat.py, backends/torch/flat.py): a
CpuAcc Specialized layer inside an If branch or a Loop body (free dimensions) runs as its layers'
kernel calls, not as a nested network per call; steps that read only captured values and
constants run in a Loop's first iteration only. Each model is held to ONNX Runtime and CpuRef."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.backends.builtin.bodies import IteratedBody
from backplane.backends.builtin.flat import FlatBody
from backplane.runtime.loaded_network import ExecutionError
from tests.conftest import make_model

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


def free(name: str, *dims: int | str, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(dims))


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def agrees(model: onnx.ModelProto, feeds_list: list[dict]) -> InferenceSession:
    """A CpuAcc,CpuRef session of ``model``, its outputs on each feed equal to ONNX Runtime's and
    CpuRef's."""
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    reference = InferenceSession(model, backends=["CpuRef"])
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        got = session.run(None, feeds)
        for want in (peer.run(None, feeds), reference.run(None, feeds)):
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return session


def runs_of(session: InferenceSession, op_type: str) -> list:
    """What the session's ``op_type`` layer runs: its bodies, flattened where they could be."""
    net = session.runtime.network(session.network_id)
    (workload,) = [step.workload for step, layer in zip(net.host_plan.steps, net.host_plan.layers)
                   if layer.op_type == op_type]
    return workload.runs


def if_model(then_nodes: list, then_outputs: list[str], else_nodes: list,
             else_outputs: list[str], initializers=(), dims=((),)) -> onnx.ModelProto:
    """y0, y1, ... = If(c) over x of a free batch; the branches' nodes and outputs given, each
    output (n, 4) or of its ``dims``."""
    shapes = [d or ("n", 4) for d in dims] + [("n", 4)] * (len(then_outputs) - len(dims))
    then = helper.make_graph(then_nodes, "then", [],
                             [free(n, *d) for n, d in zip(then_outputs, shapes)])
    other = helper.make_graph(else_nodes, "else", [],
                              [free(n, *d) for n, d in zip(else_outputs, shapes)])
    outputs = [f"y{i}" for i in range(len(then_outputs))]
    # c or (x has more than 2**40 elements): c, but read from data (x), so that the If runs its
    # nested branches (an input alone decides it before the run: test_decided_if)
    nodes = [helper.make_node("Size", ["x"], ["size"]),
             helper.make_node("Greater", ["size", "huge"], ["too_big"]),
             helper.make_node("Or", ["c", "too_big"], ["c_or"]),
             helper.make_node("If", ["c_or"], outputs, then_branch=then, else_branch=other,
                              name="cond")]
    return make_model(nodes, [free("x", "n", 4), free("c", elem=TensorProto.BOOL)],
                      [free(n, *d) for n, d in zip(outputs, shapes)],
                      [*initializers, const("huge", np.int64(2**40))])


def test_an_if_branch_on_cpuacc_runs_its_kernels_flat() -> None:
    w = np.array([0.5, -1, 2, 3], np.float32)
    model = if_model([helper.make_node("Relu", ["x"], ["r"], name="then_relu"),
                      helper.make_node("Mul", ["r", "w"], ["rw"], name="then_mul"),
                      helper.make_node("Add", ["rw", "x"], ["t"], name="then_add")], ["t"],
                     [helper.make_node("Neg", ["x"], ["nx"], name="else_neg"),
                      helper.make_node("Sigmoid", ["nx"], ["e"], name="else_sigmoid")], ["e"],
                     [const("w", w)])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((n, 4)).astype(np.float32), "c": np.array(c)}
             for n, c in ((1, True), (3, False), (5, True), (2, False))]
    session = agrees(model, feeds)
    then, other = runs_of(session, "If")
    assert isinstance(then, FlatBody) and isinstance(other, FlatBody)
    ops = [layer.op_type for layer in then.host_plan.layers]
    assert "Specialized" not in ops and {"Relu", "Mul", "Add"} <= set(ops), ops
    assert {layer.backend for layer in then.host_plan.layers if layer.op_type == "Mul"} == {"CpuAcc"}


def test_a_failing_kernel_in_a_flat_branch_is_named() -> None:
    model = if_model([helper.make_node("Gather", ["x", "k"], ["g"], axis=0, name="then_gather"),
                      helper.make_node("Relu", ["g"], ["t"], name="then_relu")], ["t"],
                     [helper.make_node("Neg", ["x"], ["nx"]), helper.make_node("Relu", ["nx"], ["e"])],
                     ["e"])
    model.graph.input.append(free("k", "m", elem=TensorProto.INT64))
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    assert isinstance(runs_of(session, "If")[0], FlatBody)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x, "c": np.array(True),
                                                     "k": np.array([1, 0])})[0], x)
    with pytest.raises(ExecutionError, match="then_gather"):
        session.run(None, {"x": x, "c": np.array(True), "k": np.array([7])})


def test_a_branch_output_folded_to_a_constant_is_the_callers_alone() -> None:
    # Identity(w) of an outer constant w sits in the branch's Specialized layer (w is an input of
    # the body when it is placed); flattened, its output is the folded constant, a copy each run
    w = np.array([1, -2, 3, -4], np.float32)
    model = if_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["t"]),
                      helper.make_node("Identity", ["w"], ["wt"])], ["t", "wt"],
                     [helper.make_node("Neg", ["x"], ["nx"]), helper.make_node("Relu", ["nx"], ["e"]),
                      helper.make_node("Neg", ["w"], ["we"])], ["e", "we"],
                     [const("w", w)], dims=((), (4,)))
    feeds = {"x": np.ones((2, 4), np.float32), "c": np.array(True)}
    session = agrees(model, [feeds])
    then = runs_of(session, "If")[0]
    assert isinstance(then, FlatBody)
    assert "Specialized" in [layer.op_type for layer in then.host_plan.layers]  # Identity folded
    first = session.run(None, feeds)[1]
    first[:] = 99  # the caller's own array: the folded constant must not change
    np.testing.assert_array_equal(session.run(None, feeds)[1], w)


def sliding_loop_model() -> onnx.ModelProto:
    """h = tanh(h + (x * w)[:, i, :]) for i < T over x (B, T, 4), B and T free: the body's Slice
    takes its start from the iteration number; x * w reads a captured value and a constant only.
    Scan output: h after each iteration."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"], name="body_scale"),
         helper.make_node("Unsqueeze", ["i", "zero"], ["start"]),
         helper.make_node("Add", ["start", "one"], ["end"]),
         helper.make_node("Slice", ["xw", "start", "end", "one"], ["row"], name="body_slice"),
         helper.make_node("Squeeze", ["row", "one"], ["step"]),
         helper.make_node("Add", ["h_in", "step"], ["s"]),
         helper.make_node("Tanh", ["s"], ["h_out"], name="body_tanh"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [free("i", elem=TensorProto.INT64), free("cond_in", elem=TensorProto.BOOL),
                 free("h_in", "b", 4)],
        [free("cond_out", elem=TensorProto.BOOL), free("h_out", "b", 4), free("h_out", "b", 4)])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one_scalar"], ["steps"], axis=0),
             helper.make_node("Loop", ["steps", "", "h0"], ["h", "hs"], body=body, name="loop")]
    return make_model(nodes, [free("x", "b", "t", 4), free("h0", "b", 4)],
                      [free("h", "b", 4), free("hs", "t", "b", 4)],
                      [const("w", np.array([1, 0.5, -1, 2], np.float32)),
                       const("zero", np.array([0], np.int64)), const("one", np.array([1], np.int64)),
                       const("one_scalar", np.array(1, np.int64))])


def test_a_loop_body_with_iteration_dependent_slices_runs_flat_and_hoists() -> None:
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((b, t, 4)).astype(np.float32),
              "h0": rng.standard_normal((b, 4)).astype(np.float32)} for b, t in ((1, 6), (3, 2), (2, 1))]
    session = agrees(sliding_loop_model(), feeds)
    (body,) = runs_of(session, "Loop")
    assert isinstance(body, FlatBody)
    ops = [layer.op_type for layer in body.host_plan.layers]
    assert "Specialized" not in ops and "Slice" in ops, ops
    iterated = IteratedBody(body, 3, [(2, 1)], [0, 2])
    hoisted = {iterated.layer_of[id(step.workload)].name for step in iterated.hoisted}
    assert "body_scale" in hoisted  # x * w: the same at every iteration
    assert not {"body_slice", "body_tanh"} & hoisted
    rest = {iterated.layer_of[id(step.workload)].name for step in iterated.rest}
    assert "body_scale" not in rest and {"body_slice", "body_tanh"} <= rest


def test_of_layers_of_one_kernel_the_failing_one_is_named() -> None:
    # Add binds no attribute: each flat call is still an object of its own, named by its layer
    model = if_model([helper.make_node("Add", ["x", "x"], ["a"], name="first_add"),
                      helper.make_node("Add", ["a", "k"], ["b"], name="middle_add"),
                      helper.make_node("Add", ["b", "x"], ["t"], name="last_add")], ["t"],
                     [helper.make_node("Neg", ["x"], ["nx"]), helper.make_node("Relu", ["nx"], ["e"])],
                     ["e"])
    model.graph.input.append(free("k", "m"))
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    assert isinstance(runs_of(session, "If")[0], FlatBody)
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ExecutionError, match="middle_add"):
        session.run(None, {"x": x, "c": np.array(True), "k": np.ones(3, np.float32)})
