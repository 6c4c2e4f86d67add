"""builtin's prepared control-flow bodies (backends/builtin/bodies.py): hoisted imports of captured
values, carried values kept in a backend's memory between iterations, outer constants bound once.
Each case is held to ONNX Runtime and to CpuRef, on CpuRef alone, on CpuAcc before CpuRef, and on a
backend with memory of its own (every crossing a MemCopy), where a fast path that skipped a copy it
needed, or kept a value past its iteration or its run, would answer wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.backends.builtin.bodies import IteratedBody, fold_outer_constants
from backplane.backends.registry import registry
from backplane.runtime.loaded_network import LoadedNetwork
from tests.conformance.test_node_suite import HalfBackend
from tests.conftest import float_input, host_backend_lists, make_model

ort = pytest.importorskip("onnxruntime")

PLACEMENTS = [*host_backend_lists(), ["HalfCpuRef", "CpuRef"],
              *([["GpuAcc", "CpuRef"]] if registry.create("GpuAcc").availability().ok else [])]


@pytest.fixture(scope="module", autouse=True)
def half_backend():
    with registry.temporarily(HalfBackend.id, HalfBackend):
        yield


def tensor(name: str, elem: int, shape=()) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def check(model: onnx.ModelProto, feeds_list: list[dict], backends: list[str],
          rtol: float = 1e-6, atol: float = 0.0) -> InferenceSession:
    """Every feed through one session (the order matters: runs must not leak into each other),
    against ONNX Runtime and CpuRef (NaN where they have it); the session."""
    session = InferenceSession(model, backends=backends)
    reference = InferenceSession(model, backends=["CpuRef"])
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        got = session.run(None, feeds)
        for want in (peer.run(None, feeds), reference.run(None, feeds)):
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return session


def loop_model() -> onnx.ModelProto:
    """Carried: acc (float, grows by step * scale each iteration), count (int64), a pair swapped
    each iteration (a, b) -> (b, a), and one swapped as they are, body inputs given back as outputs
    (p, q) -> (q, p); scan outputs: acc (a carried output given twice), count before the iteration
    (a carried input given back) and i * 2; stops when sum(acc) >= limit.
    ``scale`` is a graph input and ``twice`` is computed outside: captured values that change
    between runs; ``step`` and ``limit`` are outer constants."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["step", "scale"], ["inc"]),
         helper.make_node("Add", ["acc_in", "inc"], ["acc_out"]),
         helper.make_node("Add", ["count_in", "one"], ["count_out"]),
         helper.make_node("Identity", ["b_in"], ["a_out"]),
         helper.make_node("Identity", ["a_in"], ["b_out"]),
         helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"]),
         helper.make_node("Mul", ["i", "twice"], ["i2"])],
        "body",
        [tensor("i", TensorProto.INT64), tensor("cond_in", TensorProto.BOOL),
         float_input("acc_in", [3]), tensor("count_in", TensorProto.INT64),
         float_input("a_in", [2]), float_input("b_in", [2]), float_input("p_in", [2]),
         float_input("q_in", [2])],
        [tensor("cond_out", TensorProto.BOOL), float_input("acc_out", [3]),
         tensor("count_out", TensorProto.INT64), float_input("a_out", [2]),
         float_input("b_out", [2]), float_input("q_in", [2]), float_input("p_in", [2]),
         float_input("acc_out", [3]), tensor("count_in", TensorProto.INT64),
         tensor("i2", TensorProto.INT64)])
    nodes = [helper.make_node("Mul", ["two", "k"], ["twice"]),
             helper.make_node("Loop", ["M", "cond", "acc0", "count0", "a0", "b0", "a0", "b0"],
                              ["acc", "count", "a", "b", "p", "q", "accs", "counts_before", "evens"],
                              body=body)]
    return make_model(
        nodes, [tensor("M", TensorProto.INT64), tensor("cond", TensorProto.BOOL),
                float_input("acc0", [3]), tensor("count0", TensorProto.INT64),
                float_input("a0", [2]), float_input("b0", [2]), float_input("scale", []),
                tensor("k", TensorProto.INT64)],
        [float_input("acc", [3]), tensor("count", TensorProto.INT64), float_input("a", [2]),
         float_input("b", [2]), float_input("p", [2]), float_input("q", [2]), float_input("accs", [None, 3]),
         tensor("counts_before", TensorProto.INT64, [None]), tensor("evens", TensorProto.INT64, [None])],
        [const("step", np.array([1, 2, 3], np.float32)), const("limit", np.array(60, np.float32)),
         const("one", np.array(1, np.int64)), const("two", np.array(2, np.int64))])


def loop_feeds(trips: int, cond: bool, scale: float, k: int) -> dict:
    return {"M": np.array(trips, np.int64), "cond": np.array(cond),
            "acc0": np.zeros(3, np.float32), "count0": np.array(5, np.int64),
            "a0": np.array([1, 2], np.float32), "b0": np.array([3, 4], np.float32),
            "scale": np.array(scale, np.float32), "k": np.array(k, np.int64)}


@pytest.mark.parametrize("backends", PLACEMENTS, ids="+".join)
def test_loop_carries_swaps_scans_and_stops_on_its_condition(backends: list[str]) -> None:
    # 3 trips; stopped by the condition after 5 (scale 2); 0 trips; cond false at the start; an
    # odd number of swaps; captured values changed between runs of one session
    feeds = [loop_feeds(3, True, 1.0, 1), loop_feeds(20, True, 2.0, 3), loop_feeds(0, True, 1.0, 1),
             loop_feeds(7, False, 1.0, 1), loop_feeds(5, True, 0.5, 7), loop_feeds(3, True, 1.0, 1)]
    check(loop_model(), feeds, backends)


def nested_if_loop_model() -> onnx.ModelProto:
    """A Loop whose body holds an If on the iteration's parity: even iterations add w (an outer
    constant), odd ones multiply by x (a graph input read two scopes down)."""
    even = helper.make_graph([helper.make_node("Add", ["h_in", "w"], ["e"])], "even", [],
                             [float_input("e", [4])])
    odd = helper.make_graph([helper.make_node("Mul", ["h_in", "x"], ["o"])], "odd", [],
                            [float_input("o", [4])])
    body = helper.make_graph(
        [helper.make_node("Mod", ["i", "two"], ["parity"]),
         helper.make_node("Equal", ["parity", "zero"], ["is_even"]),
         helper.make_node("If", ["is_even"], ["h_out"], then_branch=even, else_branch=odd),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [tensor("i", TensorProto.INT64), tensor("cond_in", TensorProto.BOOL),
                 float_input("h_in", [4])],
        [tensor("cond_out", TensorProto.BOOL), float_input("h_out", [4])])
    node = helper.make_node("Loop", ["M", "", "h0"], ["h"], body=body)
    return make_model([node], [tensor("M", TensorProto.INT64), float_input("h0", [4]),
                               float_input("x", [4])], [float_input("h", [4])],
                      [const("w", np.array([1, -2, 3, 0.5], np.float32)),
                       const("two", np.array(2, np.int64)), const("zero", np.array(0, np.int64))])


@pytest.mark.parametrize("backends", PLACEMENTS, ids="+".join)
def test_if_nested_in_a_loop(backends: list[str]) -> None:
    x = np.array([0.5, 2, -1, 3], np.float32)
    feeds = [{"M": np.array(m, np.int64), "h0": np.arange(4, dtype=np.float32), "x": x * s}
             for m, s in ((5, 1), (4, -2), (1, 3), (0, 1))]
    check(nested_if_loop_model(), feeds, backends)


def if_shapes_model() -> onnx.ModelProto:
    """Branches of different shapes: then concatenates x with w ([8]), else sums x * w (a scalar)."""
    then = helper.make_graph([helper.make_node("Concat", ["x", "w"], ["t"], axis=0)], "then", [],
                             [float_input("t", [8])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["p"]),
                               helper.make_node("ReduceSum", ["p"], ["e"], keepdims=0)],
                              "else", [], [float_input("e", [])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    return make_model([node], [tensor("c", TensorProto.BOOL), float_input("x", [4])],
                      [float_input("y", None)], [const("w", np.array([1, -2, 3, -4], np.float32))])


@pytest.mark.parametrize("backends", PLACEMENTS, ids="+".join)
def test_if_branches_of_different_shapes(backends: list[str]) -> None:
    x = np.array([1, 2, 3, 4], np.float32)
    feeds = [{"c": np.array(c), "x": x * s} for c, s in ((True, 1), (False, 1), (True, -1), (False, 2))]
    check(if_shapes_model(), feeds, backends)


def scan_model() -> onnx.ModelProto:
    """Two states (a running sum, a running max), one scan input read backwards, scan outputs on
    axis 1, an outer constant and a graph input read inside."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["row", "gain"], ["scaled"]),
         helper.make_node("Add", ["sum_in", "scaled"], ["sum_out"]),
         helper.make_node("Max", ["max_in", "scaled"], ["max_out"]),
         helper.make_node("Add", ["sum_out", "bias"], ["seen"])],
        "body", [float_input("sum_in", [3]), float_input("max_in", [3]), float_input("row", [3])],
        [float_input("sum_out", [3]), float_input("max_out", [3]), float_input("seen", [3])])
    node = helper.make_node("Scan", ["s0", "m0", "rows"], ["s", "m", "seen_all"], body=body,
                            num_scan_inputs=1, scan_input_directions=[1], scan_output_axes=[1])
    return make_model([node], [float_input("s0", [3]), float_input("m0", [3]),
                               float_input("rows", ["T", 3]), float_input("gain", [])],
                      [float_input("s", [3]), float_input("m", [3]), float_input("seen_all", [3, "T"])],
                      [const("bias", np.array([0.5, -0.5, 1], np.float32))])


@pytest.mark.parametrize("backends", PLACEMENTS, ids="+".join)
def test_scan_states_and_outputs(backends: list[str]) -> None:
    rows = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    feeds = [{"s0": np.zeros(3, np.float32), "m0": np.full(3, -9, np.float32), "rows": rows[:n],
              "gain": np.array(g, np.float32)} for n, g in ((6, 1), (2, -3), (1, 0.5))]
    check(scan_model(), feeds, backends)


def if_identity_model() -> onnx.ModelProto:
    """An If whose then branch returns the outer constant w as it is."""
    then = helper.make_graph([helper.make_node("Identity", ["w"], ["t"])], "then", [],
                             [float_input("t", [4])])
    other = helper.make_graph([helper.make_node("Neg", ["w"], ["e"])], "else", [],
                              [float_input("e", [4])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    return make_model([node], [tensor("c", TensorProto.BOOL)], [float_input("y", [4])],
                      [const("w", np.array([1, -2, 3, -4], np.float32))])


@pytest.mark.parametrize("backends", PLACEMENTS, ids="+".join)
def test_a_folded_constant_returned_is_the_callers_alone(backends: list[str]) -> None:
    session = InferenceSession(if_identity_model(), backends=backends)
    first = session.run(None, {"c": np.array(True)})[0]
    first[:] = 99  # the caller's own array: the body's bound constant must not change
    np.testing.assert_array_equal(session.run(None, {"c": np.array(True)})[0], [1, -2, 3, -4])
    np.testing.assert_array_equal(session.run(None, {"c": np.array(False)})[0], [-1, 2, -3, 4])


# -- the preparation itself ----------------------------------------------------------------------
def cpuacc_loop_body() -> tuple[LoadedNetwork, int]:
    """The loaded body of a Loop carrying h through h + x * w on CpuAcc (x a graph input, w an
    outer constant), and its number of carried values."""
    pytest.importorskip("torch")
    body = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Add", ["h_in", "xw"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [tensor("i", TensorProto.INT64), tensor("cond_in", TensorProto.BOOL), float_input("h_in", [4])],
        [tensor("cond_out", TensorProto.BOOL), float_input("h_out", [4])])
    model = make_model([helper.make_node("Loop", ["M", "", "h0"], ["h"], body=body, name="loop")],
                       [tensor("M", TensorProto.INT64), float_input("h0", [4]), float_input("x", [4])],
                       [float_input("h", [4])], [const("w", np.full(4, 2, np.float32))])
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    layer = next(lay for lay in session.optimized.graph.layers if lay.op_type == "Loop")
    net = layer.attrs["body"]
    known = {"w": session.optimized.graph.constants["w"]}
    return LoadedNetwork(fold_outer_constants(net, known), 0), 1


def test_outer_constants_are_bound_once_captured_imports_hoisted_carried_values_kept() -> None:
    net, n_carried = cpuacc_loop_body()
    names = [layer.name for layer in net.layers]
    assert not any(name.startswith("MemImport[w]") for name in names), names  # bound at load
    body = IteratedBody(net, 2 + n_carried, [(2, 1)], [0])
    hoisted = [body.layer_of[id(s.workload)].name for s in body.hoisted]
    assert hoisted == ["MemImport[x](user->CpuAcc)"]
    assert body.state[0].to_host is not None  # h stays a torch tensor between iterations
    first = {body.layer_of[id(s.workload)].name for s in body.first}
    rest = {body.layer_of[id(s.workload)].name for s in body.rest}
    # the first iteration imports the captured x and the initial h; the others neither
    assert first - rest == {"MemImport[h_in](user->CpuAcc)", "MemImport[x](user->CpuAcc)"}
    x, w = np.array([1, 2, 3, 4], np.float32), 2.0
    captured = [{"x": x}.get(name) for name in net.network.input_names[3:]]  # w: bound, unread
    with body.start([np.zeros(4, np.float32)], captured) as iterations:
        for i in range(3):
            cond, = iterations.run([np.array(i), np.array(True)])
            assert bool(cond)
        h, = iterations.carried()
    assert isinstance(h, np.ndarray)
    np.testing.assert_allclose(h, 3 * x * w)


def test_traced_bodies_run_through_their_network_and_agree(monkeypatch, capsys) -> None:
    # debug level 2 prints every layer as it runs: the bodies then run through their networks'
    # execute (PlainIterations), which must give the same answers
    monkeypatch.setenv("BACKPLANE_DEBUG", "2")
    check(loop_model(), [loop_feeds(3, True, 1.0, 1), loop_feeds(20, True, 2.0, 3)], ["CpuRef"])
    check(scan_model(), [{"s0": np.zeros(3, np.float32), "m0": np.zeros(3, np.float32),
                          "rows": np.ones((2, 3), np.float32), "gain": np.array(2, np.float32)}],
          ["CpuRef"])
    traced = capsys.readouterr().err
    assert "(b_in)" in traced and "(row, gain)" in traced  # the bodies' layers, as they ran


def constant_bounds_loop_model() -> onnx.ModelProto:
    """A Loop whose body slices the graph input x by bounds it unsqueezes from outer constants
    (what the TorchScript exporter writes for ``x[:, a:b]`` in a scripted loop): those Unsqueezes
    read constants only; the body also gives an Unsqueeze of an outer constant as a scan output."""
    body = helper.make_graph(
        [helper.make_node("Constant", [], ["axis"], value=const("axis", np.array([0], np.int64))),
         helper.make_node("Unsqueeze", ["start", "axis"], ["starts"], name="starts"),
         helper.make_node("Unsqueeze", ["end", "axis"], ["ends"], name="ends"),
         helper.make_node("Slice", ["x", "starts", "ends"], ["part"]),
         helper.make_node("Add", ["h_in", "part"], ["h_out"]),
         helper.make_node("Unsqueeze", ["end", "axis"], ["mark"], name="mark"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [tensor("i", TensorProto.INT64), tensor("cond_in", TensorProto.BOOL), float_input("h_in", [2])],
        [tensor("cond_out", TensorProto.BOOL), float_input("h_out", [2]),
         tensor("mark", TensorProto.INT64, [1])])
    node = helper.make_node("Loop", ["M", "", "h0"], ["h", "marks"], body=body, name="loop")
    return make_model([node], [tensor("M", TensorProto.INT64), float_input("h0", [2]),
                               float_input("x", [5])],
                      [float_input("h", [2]), tensor("marks", TensorProto.INT64, [None, 1])],
                      [const("start", np.array(1, np.int64)), const("end", np.array(3, np.int64))])


@pytest.mark.parametrize("backends", PLACEMENTS, ids="+".join)
def test_steps_of_constants_alone_run_once_at_load(backends: list[str]) -> None:
    x = np.arange(5, dtype=np.float32)
    feeds = [{"M": np.array(m, np.int64), "h0": np.full(2, h, np.float32), "x": x * s}
             for m, h, s in ((3, 0, 1), (0, 1, 2), (4, -1, -1))]
    session = check(constant_bounds_loop_model(), feeds, backends)
    marks = session.run(None, feeds[0])[1]
    marks[:] = 99  # the caller's own: the scan output made of constants is made at each call
    np.testing.assert_array_equal(session.run(None, feeds[0])[1], [[3]] * 3)
    if backends == ["CpuRef"]:
        (loop,) = [step.workload for step, layer in zip(*_plan(session)) if layer.op_type == "Loop"]
        body = loop.iterated
        plan = body.net.host_plan  # a layer by the slots its step writes (one kernel: one workload)
        name = {step.outputs: layer.name for step, layer in zip(plan.steps, plan.layers)}
        assert [name[s.outputs] for s in body.folded] == ["starts", "ends"]
        ran = {name[s.outputs] for s in body.first}
        assert "mark" in ran and not ran & {"starts", "ends"}  # a body output: made at each call


def _plan(session: InferenceSession) -> tuple[tuple, tuple]:
    net = session.runtime.network(session.network_id)
    return net.host_plan.steps, net.host_plan.layers
