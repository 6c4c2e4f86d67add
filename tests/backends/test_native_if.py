"""A network of small float32 layers around an If as one C call (``backends/builtin/native_net.py``,
``native/loop.c``'s ``backplane_net``): the corpus's ``torch.cond`` export (cond_nested_dyn18) on
each of its three leaves and batch sizes, and networks built with onnx.helper (reductions over all
axes, reshapes, outputs that are an input or a constant, bool and int64 outputs) against CpuRef's
kernels and ONNX Runtime, one C call a run (pinned by ``builtin.native``); NaN in -> NaN out; a sum
or a mean bit for bit CpuRef's; the outputs the caller's alone; what the C refuses (branches of two
shapes, a shape computed from data), "off", no compiler and a run under a stop run the kernels;
the library built for plain x86-64 and without AVX-512 computes the same.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/backends/test_native_if.py
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.backends.builtin import native_net
from backplane.native import build
from backplane.runtime import steps
from backplane.runtime.runtime import Runtime, RuntimeOptions

ort = pytest.importorskip("onnxruntime")
needs_library = pytest.mark.skipif(not build.available("loop"),
                                   reason="no native loop library (no C compiler)")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"
RNG = np.random.default_rng(21)
F = TensorProto.FLOAT


@pytest.fixture
def calls(monkeypatch):
    """The C calls made (one per network run natively), counted; the real function runs."""
    made: list[int] = []
    try:
        function = native_net._function()
    except build.NativeUnavailable:
        return made

    def counted(*args):
        made.append(1)
        return function(*args)

    monkeypatch.setattr(native_net, "_FUNCTIONS", [counted])
    return made


def _session(model, mode="auto"):
    return InferenceSession(model, backends=["CpuRef"], runtime=Runtime(
        RuntimeOptions(backend_options={"builtin.native": mode})))


def _agrees(model, feeds, session=None, rtol=1e-5, atol=1e-6):
    """``session``'s outputs (auto by default) against CpuRef's kernels ("off") and ONNX Runtime."""
    got = (session or _session(model)).run(None, feeds)
    peer = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(),
                                providers=["CPUExecutionProvider"])
    for want in (_session(model, "off").run(None, feeds), peer.run(None, feeds)):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return got


def _value(name, elem, *dims):
    return helper.make_tensor_value_info(name, elem, None if dims == (None,) else list(dims))


def _branch(name, nodes, output, elem=F, dims=None):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, elem, dims)])


def _model(nodes, inits, outputs, inputs=None):
    graph = helper.make_graph(nodes, "g", inputs or [_value("x", F, "batch", 8)], outputs,
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _weights():
    f = np.float32
    return {"W": RNG.standard_normal((8, 8)).astype(f) * 0.4, "b": RNG.standard_normal(8).astype(f),
            "zero": np.array(0.0, f), "two": np.array(2.0, f), "all": np.array([0, 1], np.int64),
            "flat": np.array([-1], np.int64), "axis0": np.array([0], np.int64)}


def _if_model():
    """Gemm, a mean of x, a sum (axes given, all of them), reshapes, a max, then an If whose then
    branch is a Gemm, Sigmoid, Unsqueeze, Squeeze and Flatten and whose else branch hands back the input;
    a second output the bool predicate, a third the int64 shape constant."""
    then = _branch("then", [helper.make_node("Gemm", ["h", "W", "b"], ["t1"], transB=1),
                            helper.make_node("Sigmoid", ["t1"], ["t2"]),
                            helper.make_node("Unsqueeze", ["t2", "axis0"], ["t3"]),
                            helper.make_node("Squeeze", ["t3", "axis0"], ["t4"]),
                            helper.make_node("Flatten", ["t4"], ["y_then"], axis=1)],
                   "y_then")
    other = _branch("else", [helper.make_node("Identity", ["x"], ["y_else"])], "y_else")
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"]),
             helper.make_node("ReduceMean", ["x"], ["m"], keepdims=1),
             helper.make_node("ReduceSum", ["h", "all"], ["s"], keepdims=0),
             helper.make_node("Reshape", ["m", "flat"], ["m1"]),
             helper.make_node("Squeeze", ["m1"], ["m0"]),
             helper.make_node("Mul", ["s", "zero"], ["s0"]),  # the sum computed, its sign not read
             helper.make_node("Add", ["m0", "s0"], ["ms"]),
             helper.make_node("ReduceMax", ["ms"], ["top"], keepdims=0),
             helper.make_node("Greater", ["top", "zero"], ["p"]),
             helper.make_node("If", ["p"], ["y"], then_branch=then, else_branch=other)]
    return _model(nodes, _weights(), [_value("y", F, "batch", 8), _value("p", TensorProto.BOOL),
                                      _value("all", TensorProto.INT64, 2)])


@needs_library
@pytest.mark.parametrize("sample", ["s0", "s1"])
def test_the_corpus_cond_against_cpuref_and_ort(calls, sample):
    """cond_nested_dyn18 (Gemm, ReduceMean, Squeeze, Greater, an If whose then branch is ReduceMax,
    Greater and a nested If) one C call a run on each of its three leaves, as CpuRef and ONNX
    Runtime compute them, at its sample's batch and two others."""
    import onnx

    path = str(CORPUS / "cond_nested_dyn18.onnx")
    x = np.load(CORPUS / f"cond_nested_dyn18.{sample}.npz")["x"]
    known = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    weight, bias = known["proj.weight"].astype(np.float64), known["proj.bias"]
    # rows whose projection is 1 give mean 1 > 0 and max 1 <= 2: the nested else branch
    level = ((1.0 - bias) @ np.linalg.inv(weight.T)).astype(np.float32)
    session = _session(path)
    leaves = set()
    for shift in (-3.0, 0.0, 3.0, None):
        for rows in (x, np.concatenate([x, x[:1] * 0.5]), x[:1]):
            given = (rows + np.float32(shift)).astype(np.float32) if shift is not None else \
                np.tile(level, (len(rows), 1)) + (rows * np.float32(0.01))
            calls.clear()
            _agrees(path, {"x": given}, session)
            assert len(calls) == 1
            linear = given @ known["proj.weight"].T + known["proj.bias"]  # the leaf it took
            if linear.mean() <= known["scalar_tensor_default"]:
                leaves.add("else")
            else:
                leaves.add("then/" + ("then" if linear.max() > known["val_0_2"] else "else"))
    assert leaves == {"else", "then/then", "then/else"}


@needs_library
def test_built_networks_against_cpuref_and_ort(calls):
    model = _if_model()
    session = _session(model)
    for shift in (-2.0, 2.0):  # each branch of the If
        for batch in (1, 3):
            calls.clear()
            x = (RNG.standard_normal((batch, 8)) + shift).astype(np.float32)
            y, p, shape = _agrees(model, {"x": x}, session)
            assert len(calls) == 1 and p.dtype == np.bool_ and shape.tolist() == [0, 1]
            assert bool(p) == (shift > 0) and not np.shares_memory(y, x)


@needs_library
def test_the_networks_own_run_takes_the_c_too(calls):
    """The loaded network's ``execute`` (what a run the direct run does not take goes through:
    ``steps.straight_run``) calls the same plan; a float64 input, which it was not made for,
    runs the steps."""
    model = _if_model()
    session = _session(model)
    x = (RNG.standard_normal((2, 8)) + 2).astype(np.float32)
    want = _session(model, "off").run(None, {"x": x})
    got = _network(session).execute([x])
    assert len(calls) == 1
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert _network(session).execute.native([x.astype(np.float64)]) is None


@needs_library
def test_a_sum_and_a_mean_are_cpurefs_bit_for_bit(calls):
    """NumPy's pairwise float32 sum, in its order: the same bits as CpuRef's for 1 to 300 values
    (under 8 in order, eight running sums to 128, halves past it)."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["p"]),
             helper.make_node("If", ["p"], ["y"],
                              then_branch=_branch("t", [helper.make_node("Identity", ["m"], ["a"])],
                                                  "a"),
                              else_branch=_branch("e", [helper.make_node("Neg", ["m"], ["b"])],
                                                  "b"))]
    model = _model(nodes, {"zero": np.array(0.0, np.float32)},
                   [_value("s", F), _value("y", F)], [_value("x", F, "n")])
    native, kernels = _session(model), _session(model, "off")
    for n in [*range(1, 40), 127, 128, 129, 136, 255, 256, 257, 300]:
        x = (RNG.standard_normal(n) * 10 ** RNG.uniform(-3, 3, n)).astype(np.float32)
        calls.clear()
        got, want = native.run(None, {"x": x}), kernels.run(None, {"x": x})
        assert len(calls) == 1
        assert [v.tobytes() for v in got] == [v.tobytes() for v in want], n


@needs_library
def test_nan_in_nan_out(calls):
    model = _if_model()
    x = (RNG.standard_normal((2, 8)) + 2).astype(np.float32)
    x[1, 3] = np.nan  # the mean and the sum NaN: the predicate false, the else branch
    y, p, _ = _agrees(model, {"x": x})
    assert len(calls) == 1 and not p and np.isnan(y[1, 3]) and np.isnan(y).sum() == 1


@needs_library
def test_outputs_are_the_callers_alone(calls):
    model = _if_model()
    session = _session(model)
    x = (RNG.standard_normal((2, 8)) - 2).astype(np.float32)  # the else branch: x itself
    first = session.run(None, {"x": x})
    second = session.run(None, {"x": x})
    assert len(calls) == 2
    for a, b in zip(first, second):
        assert not np.shares_memory(a, b)
    assert not np.shares_memory(first[0], x)
    first[0][:] = 7.0
    first[2][:] = 9
    again = session.run(None, {"x": x})
    np.testing.assert_array_equal(again[0], x)
    assert again[2].tolist() == [0, 1]


def _two_shapes_model():
    then = _branch("then", [helper.make_node("Identity", ["x"], ["a"])], "a")
    other = _branch("else", [helper.make_node("ReduceMax", ["x"], ["c"], keepdims=0)], "c")
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["p"]),
             helper.make_node("If", ["p"], ["y"], then_branch=then, else_branch=other)]
    return _model(nodes, {"zero": np.array(0.0, np.float32)}, [_value("y", F, None)])


@needs_library
def test_what_the_c_refuses_runs_the_kernels(calls):
    """Branches of two shapes, and a Reshape to a shape the network computes (Shape): the steps
    run, as CpuRef's; the signature refused once, not planned again."""
    model = _two_shapes_model()
    session = _session(model)
    for shift in (2.0, -2.0, 2.0):
        _agrees(model, {"x": (RNG.standard_normal((2, 8)) + shift).astype(np.float32)}, session)
    assert not calls
    assert _network(session).execute.native.refused == {((2, 8),)}

    shaped = [helper.make_node("Shape", ["x"], ["dims"]),
              helper.make_node("Reshape", ["x", "dims"], ["x2"]),
              helper.make_node("ReduceMean", ["x2"], ["m"], keepdims=0),
              helper.make_node("Greater", ["m", "zero"], ["p"]),
              helper.make_node("If", ["p"], ["y"],
                               then_branch=_branch("t", [helper.make_node("Relu", ["x2"], ["a"])],
                                                   "a"),
                               else_branch=_branch("e", [helper.make_node("Neg", ["x2"], ["b"])],
                                                   "b"))]
    model = _model(shaped, {"zero": np.array(0.0, np.float32)}, [_value("y", F, "batch", 8)])
    _agrees(model, {"x": RNG.standard_normal((3, 8)).astype(np.float32)})
    assert not calls


@needs_library
def test_large_values_run_the_kernels(calls):
    """Past MOST_VALUES elements in a buffer the kernels run (NumPy's SIMD loops and BLAS win
    there); below it the C. Both as CpuRef computes."""
    path = str(CORPUS / "cond_nested_dyn18.onnx")
    session = _session(path)
    rows = native_net.MOST_VALUES // 16
    for batch in (rows, rows + 1, 4 * rows):
        calls.clear()
        _agrees(path, {"x": RNG.standard_normal((batch, 16)).astype(np.float32)}, session)
        assert len(calls) == (batch == rows)
    assert _network(session).execute.native.refused == {((rows + 1, 16),), ((4 * rows, 16),)}


def _network(session):
    return session.runtime.network(session.network_id)


@needs_library
def test_off_no_compiler_and_a_stop_run_the_kernels(calls, monkeypatch):
    model = _if_model()
    x = (RNG.standard_normal((2, 8)) + 2).astype(np.float32)
    _agrees(model, {"x": x}, _session(model, "off"))
    assert not calls and _network(_session(model, "off")).execute.native is None
    token = steps.STOP.set(lambda: None)  # a run asked to stop between layers: the steps
    try:
        _agrees(model, {"x": x})
    finally:
        steps.STOP.reset(token)
    assert not calls
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(native_net, "_FUNCTIONS", [])
    session = _session(model)
    _agrees(model, {"x": x}, session)
    assert _network(session).execute.native is None


@needs_library
def test_runs_from_two_threads_agree(calls):
    """Two threads running one session at once: one holds a plan's arena, the other runs the
    steps where it finds the plan taken; every output CpuRef's."""
    model = _if_model()
    session, kernels = _session(model), _session(model, "off")
    feeds = [{"x": (RNG.standard_normal((2, 8)) + s).astype(np.float32)} for s in (-2, 2) * 4]
    wants = [kernels.run(None, f) for f in feeds]
    assert not _raced(session, feeds, wants, 200) and calls


@needs_library
@pytest.mark.parametrize("march", ["x86-64", ["-march=native", "-mno-avx512f"]])
def test_other_builds_compute_the_same(monkeypatch, tmp_path, march):
    """loop.c built for plain x86-64 and for this CPU without AVX-512 (a CI machine's): the
    corpus's cond and the built network as CpuRef computes them."""
    import platform

    from tests.native.flavours import built

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 flavours")
    function = built("loop", march, tmp_path).backplane_net
    function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int64
    made = []

    def counted(*args):
        made.append(1)
        return function(*args)

    monkeypatch.setattr(native_net, "_FUNCTIONS", [counted])
    path = str(CORPUS / "cond_nested_dyn18.onnx")
    x = np.load(CORPUS / "cond_nested_dyn18.s1.npz")["x"]
    for shift in (-3.0, 0.6, 3.0):
        _agrees(path, {"x": (x + np.float32(shift)).astype(np.float32)})
    _agrees(_if_model(), {"x": (RNG.standard_normal((3, 8)) + 2).astype(np.float32)})
    assert len(made) == 4


def _loop_model():
    """A Loop of 3 trips over a body of the records the network's plan added (a mean and a sum
    over all axes, Squeeze, Unsqueeze, Reshape, Flatten), a scan output the sums."""
    body = helper.make_graph(
        [helper.make_node("ReduceMean", ["h_in"], ["m"], keepdims=1),
         helper.make_node("ReduceSum", ["h_in"], ["s"], keepdims=0),
         helper.make_node("Squeeze", ["m"], ["m0"]),
         helper.make_node("Sub", ["h_in", "m0"], ["c"]),
         helper.make_node("Unsqueeze", ["c", "axis0"], ["c3"]),
         helper.make_node("Flatten", ["c3"], ["c2"], axis=2),
         helper.make_node("Reshape", ["c2", "back"], ["c1"]),
         helper.make_node("Tanh", ["c1"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Identity", ["s"], ["y"])],
        "body", [_value("i", TensorProto.INT64), _value("cond_in", TensorProto.BOOL),
                 _value("h_in", F, 2, 8)],
        [_value("cond_out", TensorProto.BOOL), _value("h_out", F, 2, 8), _value("y", F)])
    nodes = [helper.make_node("Loop", ["trips", "go", "x"], ["h", "ys"], body=body)]
    inits = {"trips": np.array(3, np.int64), "go": np.array(True), "axis0": np.array([0], np.int64),
             "back": np.array([2, 8], np.int64)}
    return _model(nodes, inits, [_value("h", F, 2, 8), _value("ys", F, 3)],
                  [_value("x", F, 2, 8)])


@pytest.fixture
def loop_calls(monkeypatch):
    """The native Loop's C calls, counted."""
    from backplane.backends.builtin import native_loop

    function = native_loop._function()
    made: list[int] = []
    monkeypatch.setattr(native_loop, "_FUNCTIONS", [lambda *a: made.append(1) or function(*a)])
    return made


@needs_library
def test_a_loop_body_with_a_mean_and_reshapes_is_one_c_call(loop_calls):
    _agrees(_loop_model(), {"x": RNG.standard_normal((2, 8)).astype(np.float32)})
    assert len(loop_calls) == 1
    x = RNG.standard_normal((8, 2)).astype(np.float32).T  # not C-contiguous: copied for the C
    _agrees(_loop_model(), {"x": x})
    assert len(loop_calls) == 2


@needs_library
def test_a_native_loop_from_two_threads(loop_calls):
    """A plan's table and arena are made once (``native_loop.Bound``): a second thread at the same
    time runs a table and an arena of its own; every output CpuRef's."""
    model = _loop_model()
    session, kernels = _session(model), _session(model, "off")
    feeds = [{"x": RNG.standard_normal((2, 8)).astype(np.float32)} for _ in range(6)]
    wants = [kernels.run(None, f) for f in feeds]
    assert not _raced(session, feeds, wants, 300) and len(loop_calls) == 2 * 300 * 6


def _raced(session, feeds, wants, rounds):
    """The outputs two threads running ``session`` at once got unlike ``wants`` (CpuRef's), each
    thread ``rounds`` times over ``feeds``."""
    failures = []

    def runner():
        for _ in range(rounds):
            for f, want in zip(feeds, wants):
                for a, b in zip(session.run(None, f), want):
                    if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
                        failures.append((a, b))

    threads = [threading.Thread(target=runner) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
