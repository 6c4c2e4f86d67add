"""Control flow whose predicate and trip count come from data, run as straight code
(runtime/steps.py's ``compiled``; backends/builtin/bodies.py, flat.py): a Loop iteration (its
steps, the carried values' handover, the watched outputs) and an If branch are one function each,
made at load; under a stop (``RunOptions``) they run through ``run_steps`` as before. Each model is
built with onnx.helper and held to ONNX Runtime and CpuRef, on CpuRef alone and CpuAcc before
CpuRef: zero, one and many trips, a nested If on computed predicates, NaN in the predicate's
input, a failing kernel named, outputs that are the caller's alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession, RunOptions
from backplane.backends.builtin.flat import FlatBody
from backplane.runtime.loaded_network import ExecutionError
from tests.conftest import host_backend_lists, make_model

ort = pytest.importorskip("onnxruntime")

STRAIGHT = "<backplane steps>"  # the file name of the code steps.compiled makes
RNG = np.random.default_rng(27)


def value(name: str, elem: int, *dims: int | str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(dims))


def const(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def agrees(model: onnx.ModelProto, feeds_list: list[dict], backends: list[str],
           options: RunOptions | None = None) -> InferenceSession:
    """A session of ``model`` on ``backends`` whose outputs on each feed (one session, in order)
    equal ONNX Runtime's and CpuRef's, NaN where theirs are NaN."""
    session = InferenceSession(model, backends=backends)
    reference = InferenceSession(model, backends=["CpuRef"])
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        got = session.run(None, feeds, options)
        for want in (peer.run(None, feeds), reference.run(None, feeds)):
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return session


def workload_of(session: InferenceSession, op_type: str):
    net = session.runtime.network(session.network_id)
    (workload,) = [step.workload for step, layer in zip(net.host_plan.steps, net.host_plan.layers)
                   if layer.op_type == op_type]
    return workload


# -- a Loop: trip count and condition from data, a sequence and a scan output -------------------------
def loop_model() -> onnx.ModelProto:
    """h = tanh(h @ W + x[i]) for i < trips while sum(|h|) > limit (computed each iteration);
    each h appended to a sequence (SequenceInsert) and given as a scan output (h * 2). Outputs:
    the last h, the sequence's length and the scan outputs; ``concat``: the sequence concatenated
    along a new axis 1 (ConcatFromSequence), in a model of its own (an empty sequence has none)."""
    body = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["row"], axis=0, name="row"),
         helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
         helper.make_node("Add", ["hw", "row"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("SequenceInsert", ["seq_in", "h_out"], ["seq_out"]),
         helper.make_node("Abs", ["h_out"], ["mag"]),
         helper.make_node("ReduceSum", ["mag"], ["total"], keepdims=0),
         helper.make_node("Greater", ["total", "limit"], ["cond_out"]),
         helper.make_node("Mul", ["h_out", "two"], ["scan"])],
        "body",
        [value("i", TensorProto.INT64), value("cond_in", TensorProto.BOOL),
         value("h_in", TensorProto.FLOAT, "n", 4),
         helper.make_tensor_sequence_value_info("seq_in", TensorProto.FLOAT, None)],
        [value("cond_out", TensorProto.BOOL), value("h_out", TensorProto.FLOAT, "n", 4),
         helper.make_tensor_sequence_value_info("seq_out", TensorProto.FLOAT, None),
         value("scan", TensorProto.FLOAT, "n", 4)])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"], dtype=TensorProto.FLOAT),
             helper.make_node("Loop", ["trips", "go", "h0", "empty"], ["h", "seq", "scans"],
                              body=body, name="loop"),
             helper.make_node("SequenceLength", ["seq"], ["steps"])]
    return make_model(
        nodes,
        [value("x", TensorProto.FLOAT, "t", "n", 4), value("h0", TensorProto.FLOAT, "n", 4),
         value("trips", TensorProto.INT64), value("go", TensorProto.BOOL),
         value("limit", TensorProto.FLOAT)],
        [value("h", TensorProto.FLOAT, "n", 4), value("steps", TensorProto.INT64),
         value("scans", TensorProto.FLOAT, "s", "n", 4)],
        [const("W", RNG.standard_normal((4, 4)).astype(np.float32)),
         const("two", np.float32(2.0))])


def concat_model() -> onnx.ModelProto:
    """``loop_model`` with its sequence concatenated along a new axis 1 as its output."""
    model = loop_model()
    graph = model.graph
    graph.node.append(helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=1, new_axis=1))
    del graph.output[1:]
    graph.output.append(value("y", TensorProto.FLOAT, "n", "s", 4))
    return model


def loop_feeds(trips: int, limit: float, go: bool = True, t: int = 6, n: int = 3) -> dict:
    return {"x": RNG.standard_normal((t, n, 4)).astype(np.float32),
            "h0": RNG.standard_normal((n, 4)).astype(np.float32),
            "trips": np.array(trips, np.int64), "go": np.array(go),
            "limit": np.array(limit, np.float32)}


# zero trips (a count of 0, and a false condition), one trip (a count of 1, and a condition false
# after the first), many (all 6, and stopped by the data when the limit is reached)
LOOP_FEEDS = [loop_feeds(0, 0.0), loop_feeds(5, 0.0, go=False), loop_feeds(1, 0.0),
              loop_feeds(6, 1e9), loop_feeds(6, 0.0), loop_feeds(6, 7.5, t=6, n=3)]


@pytest.mark.parametrize("backends", host_backend_lists())
def test_a_loop_on_data_runs_its_iterations_as_straight_code(backends: list[str]) -> None:
    session = agrees(loop_model(), LOOP_FEEDS, backends)
    agrees(concat_model(), [f for f in LOOP_FEEDS if f["trips"] > 0 and f["go"]], backends)
    iterated = workload_of(session, "Loop").iterated
    for call in (iterated.first_call, iterated.rest_call):
        assert call.__code__.co_filename == STRAIGHT


@pytest.mark.parametrize("backends", host_backend_lists())
def test_under_a_stop_the_same_loop_runs_through_the_run_loop(backends: list[str]) -> None:
    """A run with a time limit asks before each step: the steps run by ``run_steps``, with the
    same results."""
    agrees(loop_model(), LOOP_FEEDS, backends, RunOptions(timeout_s=600))


def test_a_failing_kernel_in_an_iteration_is_named() -> None:
    """x has 2 rows and the count asks for 4: the third iteration's Gather fails; the error
    names it (the line of the straight code it failed on), as the run loop's does."""
    session = InferenceSession(loop_model(), backends=["CpuRef"])
    with pytest.raises(ExecutionError, match="row"):
        session.run(None, loop_feeds(4, 0.0, t=2))
    out = session.run(None, loop_feeds(2, 0.0, t=2))  # and the session still runs
    assert out[1] == 2


def test_loop_outputs_are_the_callers_alone() -> None:
    session = InferenceSession(loop_model(), backends=["CpuAcc", "CpuRef"])
    feeds = loop_feeds(6, 0.0)
    first = session.run(None, feeds)
    want = [a.copy() for a in first]
    for array in first:
        array[...] = 0
    for got, expected in zip(session.run(None, feeds), want, strict=True):
        np.testing.assert_array_equal(got, expected)


# -- a nested If on computed predicates ---------------------------------------------------------------
def nested_if_model() -> onnx.ModelProto:
    """h = x @ P; if mean(h) > 0: (if max(h) > 2: relu(h) @ A else sigmoid(h) - 0.5)
    else tanh(h) * 2 (cond_nested_dyn18's shape, its predicates computed from data)."""
    inner_then = helper.make_graph(
        [helper.make_node("Relu", ["h"], ["r"]), helper.make_node("MatMul", ["r", "A"], ["a"])],
        "inner_then", [], [value("a", TensorProto.FLOAT, "n", 4)])
    inner_else = helper.make_graph(
        [helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Sub", ["s", "half"], ["b"])],
        "inner_else", [], [value("b", TensorProto.FLOAT, "n", 4)])
    then = helper.make_graph(
        [helper.make_node("ReduceMax", ["h"], ["peak"], keepdims=0),
         helper.make_node("Greater", ["peak", "two"], ["big"]),
         helper.make_node("If", ["big"], ["inner"], then_branch=inner_then,
                          else_branch=inner_else, name="inner")],
        "then", [], [value("inner", TensorProto.FLOAT, "n", 4)])
    other = helper.make_graph(
        [helper.make_node("Tanh", ["h"], ["th"]), helper.make_node("Mul", ["th", "two"], ["c"])],
        "else", [], [value("c", TensorProto.FLOAT, "n", 4)])
    nodes = [helper.make_node("MatMul", ["x", "P"], ["h"]),
             helper.make_node("ReduceMean", ["h"], ["mean"], keepdims=0),
             helper.make_node("Greater", ["mean", "zero"], ["positive"]),
             helper.make_node("If", ["positive"], ["y"], then_branch=then, else_branch=other,
                              name="outer")]
    return make_model(nodes, [value("x", TensorProto.FLOAT, "n", 4)],
                      [value("y", TensorProto.FLOAT, "n", 4)],
                      [const("P", np.eye(4, dtype=np.float32)),
                       const("A", RNG.standard_normal((4, 4)).astype(np.float32)),
                       const("zero", np.float32(0)), const("half", np.float32(0.5)),
                       const("two", np.float32(2))])


def if_feeds() -> list[dict]:
    """Every branch: mean <= 0 (outer else), mean > 0 with max > 2 (inner then) and with
    max <= 2 (inner else); then NaN in x: the mean is NaN, NaN > 0 is false, the outer else runs
    and gives NaN where x had it."""
    small = np.full((2, 4), 0.25, np.float32)
    large = small.copy()
    large[1, 2] = 3.0
    nan = small.copy()
    nan[0, 1] = np.nan
    return [{"x": -small}, {"x": large}, {"x": small}, {"x": nan}, {"x": large}]


@pytest.mark.parametrize("backends", host_backend_lists())
def test_a_nested_if_on_computed_predicates_runs_its_branches_as_straight_code(
        backends: list[str]) -> None:
    session = agrees(nested_if_model(), if_feeds(), backends)
    out = session.run(None, if_feeds()[3])[0]
    assert np.isnan(out[0, 1]) and np.isfinite(out[1]).all()  # NaN in, NaN out, only there
    runs = workload_of(session, "If").runs
    assert all(isinstance(run, FlatBody) for run in runs)  # flat even where nothing expands
    assert all(run.call.__code__.co_filename == STRAIGHT for run in runs)
    then = runs[0].host_plan  # the inner If reads its predicate where Greater made it
    made_by = {slot: layer for step, layer in zip(then.steps, then.layers) for slot in step.outputs}
    (inner,) = [step for step, layer in zip(then.steps, then.layers) if layer.op_type == "If"]
    assert made_by[inner.inputs[0]].op_type == "Greater"
    net = session.runtime.network(session.network_id)  # the network around it: straight too
    assert net.execute.__qualname__ == "straight_run.<locals>.run"


def test_a_body_from_the_compile_cache_runs_its_kernels_flat(tmp_path) -> None:
    """A session loaded from its compile cache holds a body's CpuAcc partition as a Delegate of
    its blob (artifact/compiler.py): the body still runs as its kernels, each a line of its
    straight code, not as the Delegate's per-signature build (2.2x the run of loop_scripted_ts16
    where the bench empties its caches)."""
    model = loop_model()
    for _ in range(2):  # the first session writes the cache, the second loads from it too
        session = InferenceSession(model, backends=["CpuAcc", "CpuRef"], cache_dir=tmp_path)
    assert any(tmp_path.iterdir())
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in LOOP_FEEDS:
        for a, b in zip(session.run(None, feeds), peer.run(None, feeds), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (body,) = workload_of(session, "Loop").runs
    ops = [layer.op_type for layer in body.host_plan.layers]
    assert "Delegate" not in ops and "Specialized" not in ops and "MatMul" in ops, ops


# -- whole Loops, Scans and If branches as one function (looped.py, flat._direct); last in the file:
# they draw from the module's RNG, whose draws the tests above keep as they were ----------------
@pytest.mark.parametrize("backends", host_backend_lists())
def test_a_loop_runs_whole_as_one_function(backends: list[str], monkeypatch) -> None:
    """Without a stop, the Loop's driver and its iterations are one function of straight code
    (builtin/looped.py): no iteration goes through ``Iterations.run``; the same values, NaN in x
    giving NaN (and a condition false on it) as ONNX Runtime and CpuRef."""
    from backplane.backends.builtin import bodies

    def refused(*args, **kwargs):
        raise AssertionError("an iteration ran through Iterations.run")

    monkeypatch.setattr(bodies.Iterations, "run", refused)
    nan = loop_feeds(6, 0.0)  # (after the others: the module's RNG draws they make are theirs)
    nan["x"][2, 1, 3] = np.nan
    session = agrees(loop_model(), [*LOOP_FEEDS, nan], backends)
    whole = workload_of(session, "Loop").whole
    assert whole.__code__.co_filename == STRAIGHT and "while keep_going" in whole.source
    assert np.isnan(session.run(None, nan)[0]).any()


def scan_model() -> onnx.ModelProto:
    """A running sum (state) over the columns of xs (scan input axis 1, read backwards) and the
    rows of zs (axis 0, forwards), each step's tanh a scan output on axis 1."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "col"], ["a"]),
         helper.make_node("Add", ["a", "z"], ["s_out"]),
         helper.make_node("Tanh", ["s_out"], ["y"])],
        "body", [value("s_in", TensorProto.FLOAT, 3), value("col", TensorProto.FLOAT, 3),
                 value("z", TensorProto.FLOAT, 3)],
        [value("s_out", TensorProto.FLOAT, 3), value("y", TensorProto.FLOAT, 3)])
    node = helper.make_node("Scan", ["s0", "xs", "zs"], ["s", "ys"], body=body, num_scan_inputs=2,
                            scan_input_axes=[1, 0], scan_input_directions=[1, 0],
                            scan_output_axes=[1])
    return make_model([node], [value("s0", TensorProto.FLOAT, 3),
                               value("xs", TensorProto.FLOAT, 3, "t"),
                               value("zs", TensorProto.FLOAT, "t", 3)],
                      [value("s", TensorProto.FLOAT, 3), value("ys", TensorProto.FLOAT, 3, "t")])


@pytest.mark.parametrize("backends", host_backend_lists())
def test_a_scan_runs_whole_as_one_function(backends: list[str], monkeypatch) -> None:
    """A Scan's rows and iterations are one function too (looped.scanned, made per the scan
    inputs' axes): no Iterations.run; ONNX Runtime's and CpuRef's values over 0, 1 and 5 steps,
    an input read along axis 1 backwards, NaN in a row giving NaN from that step on."""
    from backplane.backends.builtin import bodies

    def refused(*args, **kwargs):
        raise AssertionError("an iteration ran through Iterations.run")

    monkeypatch.setattr(bodies.Iterations, "run", refused)

    rng = np.random.default_rng(146)

    def feeds(t: int) -> dict:
        return {"s0": rng.standard_normal(3).astype(np.float32),
                "xs": rng.standard_normal((3, t)).astype(np.float32),
                "zs": rng.standard_normal((t, 3)).astype(np.float32)}

    nan = feeds(5)
    nan["zs"][2, 1] = np.nan
    session = agrees(scan_model(), [feeds(5), feeds(1), nan], backends)
    assert np.isnan(session.run(None, nan)[1][1, 2:]).all()
    scan = workload_of(session, "Scan")
    assert list(scan.wholes) == [(1, 0)]
    assert "while i < length" in scan.wholes[(1, 0)].source
    empty = feeds(0)  # no step: the state as given, no scan output (ONNX Runtime 1.32 dies of
    (state, ys) = session.run(None, empty)  # a floating point exception on this one: CpuRef's)
    want = InferenceSession(scan_model(), backends=["CpuRef"]).run(None, empty)
    assert ys.shape == want[1].shape == (3, 0)
    np.testing.assert_array_equal(state, want[0])
    np.testing.assert_array_equal(state, empty["s0"])


@pytest.mark.parametrize("backends", host_backend_lists())
def test_an_if_calls_its_branch_as_one_function(backends: list[str], monkeypatch) -> None:
    """Without a stop an If calls its flat branch's ``direct`` code (flat._direct), not
    ``FlatBody.execute``: every branch's values as ONNX Runtime's and CpuRef's, NaN where x had
    it; under a stop, ``execute`` as before."""
    agrees(nested_if_model(), if_feeds(), backends, RunOptions(timeout_s=600))

    def refused(*args, **kwargs):
        raise AssertionError("a branch ran through FlatBody.execute")

    monkeypatch.setattr(FlatBody, "execute", refused)
    session = agrees(nested_if_model(), if_feeds(), backends)
    assert np.isnan(session.run(None, if_feeds()[3])[0][0, 1])
    for run in workload_of(session, "If").runs:
        assert run.direct.__code__.co_filename == STRAIGHT


def test_a_failing_kernel_in_a_branch_is_named() -> None:
    """The then branch gathers w at an index from the input: out of range, its Gather fails and
    the error names it, as the run loop's does; the session still runs."""
    then = helper.make_graph([helper.make_node("Gather", ["w", "idx"], ["t"], name="picked")],
                             "then", [], [value("t", TensorProto.FLOAT, 1)])
    other = helper.make_graph([helper.make_node("Gather", ["w", "first"], ["e"], name="first_one")],
                              "else", [], [value("e", TensorProto.FLOAT, 1)])
    model = make_model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                       [value("c", TensorProto.BOOL), value("idx", TensorProto.INT64, 1)],
                       [value("y", TensorProto.FLOAT, 1)],
                       [const("w", np.arange(4, dtype=np.float32)),
                        const("first", np.zeros(1, np.int64))])
    session = InferenceSession(model, backends=["CpuRef"])
    with pytest.raises(ExecutionError, match="picked"):
        session.run(None, {"c": np.array(True), "idx": np.array([7], np.int64)})
    (y,) = session.run(None, {"c": np.array(True), "idx": np.array([2], np.int64)})
    assert y.tolist() == [2.0]
