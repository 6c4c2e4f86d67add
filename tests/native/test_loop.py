"""A Loop of small float32 layers as one C call (``backends/builtin/native_loop.py``,
``native/loop.c``): the corpus's scripted RNN (``loop_scripted_ts16``) and Loops built with
onnx.helper (scan outputs, carried tensors, a grown sequence, every op the C takes, Gemm's
transposes and bias shapes, broadcasting) against CpuRef and ONNX Runtime, NaN in -> NaN out, one
C call a Loop (pinned by ``builtin.native``); a computed condition, a trip count past the rows a
Gather reads, "off" and no compiler run the body's kernels as before.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_loop.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.backends.builtin import native_loop
from backplane.native import build
from backplane.runtime.runtime import Runtime, RuntimeOptions

ort = pytest.importorskip("onnxruntime")
needs_library = pytest.mark.skipif(not build.available("loop"),
                                   reason="no native loop library (no C compiler)")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"
RNG = np.random.default_rng(18)


@pytest.fixture
def calls(monkeypatch):
    """The C calls made (one per Loop run natively), counted; the real function runs."""
    made: list[int] = []
    try:
        function = native_loop._function()
    except build.NativeUnavailable:
        return made

    def counted(*args):
        made.append(1)
        return function(*args)

    monkeypatch.setattr(native_loop, "_FUNCTIONS", [counted])
    return made


def _session(model, mode, backends=("CpuRef",)):
    options = {"builtin.native": mode}
    return InferenceSession(model, backends=list(backends),
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _agrees(model, feeds, mode="auto", backends=("CpuRef",)):
    session = _session(model, mode, backends)
    want_ref = _session(model, "off").run(None, feeds)  # CpuRef's kernels, no C
    peer = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    for want in (want_ref, peer.run(None, feeds)):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return got


@needs_library
def test_the_scripted_rnn_against_cpuref_and_ort(calls):
    """loop_scripted_ts16's two Loops one C call each a run on both samples and on inputs that stop
    the second sooner: the first's Gather of step t, three Gemms, Add, Tanh and SequenceInsert;
    the second's int64 counter, ReduceMax, Greater, Cast and an If whose branches (a Gather by a
    captured index and a Less; a constant) compute the condition that ends it."""
    path = str(CORPUS / "loop_scripted_ts16.onnx")
    for sample in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"loop_scripted_ts16.{sample}.npz"))
        for scale in (1.0, 0.01):
            calls.clear()
            got = _agrees(path, {"x": feeds["x"] * np.float32(scale)})
            assert len(calls) == 2 and got[2].tolist() == ([4] if scale == 1 else [3])


def _value(name, elem, *dims):
    return helper.make_tensor_value_info(name, elem, None if dims == (None,) else list(dims))


def _loop_model(trips, nodes, consts, *, scan="y", cond="cond_in"):
    """A Loop over ``trips`` (given, or an input) with carried h (2, 8) and an empty sequence;
    the body's ``nodes`` read h_in, the row x[:, i] (x (2, T, 8)) and ``consts``, and make h_out
    and ``scan``; the outputs: the last h, the scan stack and the sequence concatenated."""
    body_nodes = [helper.make_node("Gather", ["x", "i"], ["row"], axis=1),
                  *nodes,
                  helper.make_node("Identity", [cond], ["cond_out"]),
                  helper.make_node("SequenceInsert", ["seq_in", "h_out"], ["seq_out"])]
    body = helper.make_graph(
        body_nodes, "body",
        [_value("i", TensorProto.INT64), _value("cond_in", TensorProto.BOOL),
         _value("h_in", TensorProto.FLOAT, 2, 8),
         helper.make_tensor_sequence_value_info("seq_in", TensorProto.FLOAT, None)],
        [_value("cond_out", TensorProto.BOOL), _value("h_out", TensorProto.FLOAT, 2, 8),
         helper.make_tensor_sequence_value_info("seq_out", TensorProto.FLOAT, None),
         _value(scan, TensorProto.FLOAT, None)])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"], dtype=TensorProto.FLOAT),
             helper.make_node("Loop", ["trips", "go", "h0", "empty"], ["h", "seq", "ys"],
                              body=body),
             helper.make_node("ConcatFromSequence", ["seq"], ["stacked"], axis=1, new_axis=1)]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    inits.append(numpy_helper.from_array(np.array(True), "go"))
    inits.append(numpy_helper.from_array(np.array(True), "yes"))
    inputs = [_value("x", TensorProto.FLOAT, 2, "T", 8), _value("h0", TensorProto.FLOAT, 2, 8)]
    if trips is None:
        inputs.append(_value("trips", TensorProto.INT64))
    else:
        inits.append(numpy_helper.from_array(np.array(trips, np.int64), "trips"))
    graph = helper.make_graph(nodes, "g", inputs,
                              [_value("h", TensorProto.FLOAT, 2, 8),
                               _value("ys", TensorProto.FLOAT, None),
                               _value("stacked", TensorProto.FLOAT, None)], inits)
    # IR 8: what every ONNX Runtime of the last years reads (onnx 1.23 writes 14 by default,
    # which the GPU machine's onnxruntime 1.30 refuses)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _weights():
    f = np.float32
    return {"W": RNG.standard_normal((8, 8)).astype(f) * 0.3,
            "Wt": RNG.standard_normal((8, 8)).astype(f) * 0.3,
            "b_row": RNG.standard_normal(8).astype(f),
            "b_col": RNG.standard_normal((2, 1)).astype(f),
            "b_one": np.array([0.5], f), "b_full": RNG.standard_normal((2, 8)).astype(f),
            "two": np.array(2.0, f), "half_row": RNG.uniform(0.5, 2, (1, 8)).astype(f)}


EVERY_OP = [
    helper.make_node("Gemm", ["h_in", "W", "b_row"], ["g1"]),
    helper.make_node("Gemm", ["row", "Wt", "b_full"], ["g2"], transB=1, alpha=0.5, beta=2.0),
    helper.make_node("Gemm", ["g1", "W", "b_col"], ["g3"]),
    helper.make_node("Gemm", ["g2", "Wt", "b_one"], ["g4"], transB=1),
    helper.make_node("Add", ["g1", "g2"], ["s1"]),
    helper.make_node("Sub", ["s1", "g3"], ["s2"]),
    helper.make_node("Mul", ["s2", "half_row"], ["s3"]),
    helper.make_node("Div", ["g4", "two"], ["s4"]),
    helper.make_node("Sigmoid", ["s4"], ["gate"]),
    helper.make_node("Relu", ["s3"], ["r"]),
    helper.make_node("Neg", ["r"], ["n"]),
    helper.make_node("Abs", ["n"], ["a"]),
    helper.make_node("Mul", ["gate", "a"], ["ga"]),
    helper.make_node("Tanh", ["ga"], ["h_out"]),
    helper.make_node("Add", ["h_out", "row"], ["y"]),
]


@needs_library
@pytest.mark.parametrize("steps", [1, 5])
def test_every_op_against_cpuref_and_ort(calls, steps):
    model = _loop_model(steps, EVERY_OP, _weights())
    feeds = {"x": RNG.standard_normal((2, 6, 8)).astype(np.float32),
             "h0": RNG.standard_normal((2, 8)).astype(np.float32)}
    got = _agrees(model, feeds)
    assert len(calls) == 1 and got[1].shape == (steps, 2, 8) and got[2].shape == (2, steps, 8)
    assert not any(np.shares_memory(a, b) for a in got for b in got if a is not b)


@needs_library
def test_nan_in_nan_out(calls):
    model = _loop_model(4, EVERY_OP, _weights())
    x = RNG.standard_normal((2, 4, 8)).astype(np.float32)
    x[1, 2, 3] = np.nan
    got = _agrees(model, {"x": x, "h0": np.zeros((2, 8), np.float32)})
    assert len(calls) == 1 and np.isnan(got[1][2:, 1]).any() and not np.isnan(got[1][:2]).any()


@needs_library
def test_trips_from_data_and_past_the_rows(calls):
    """A trip count given at run time: natively within the rows the Gather reads; past them the
    body's kernels run and fail as CpuRef's do."""
    model = _loop_model(None, [helper.make_node("Gemm", ["h_in", "W", "b_row"], ["g"]),
                               helper.make_node("Add", ["g", "row"], ["t"]),
                               helper.make_node("Tanh", ["t"], ["h_out"]),
                               helper.make_node("Identity", ["h_out"], ["y"])], _weights())
    feeds = {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32),
             "h0": RNG.standard_normal((2, 8)).astype(np.float32)}
    for trips in (3, 2):
        _agrees(model, {**feeds, "trips": np.array(trips, np.int64)})
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(Exception, match="(?i)index|out of|bounds"):
        _session(model, "auto").run(None, {**feeds, "trips": np.array(4, np.int64)})
    assert not calls


@needs_library
def test_a_computed_condition_stops_the_loop_and_off_runs_the_kernels(calls):
    """The body's condition (ReduceMax, Greater) read after each iteration: the C stops where the
    kernels do, its scan outputs as many rows; "off" makes no C call."""
    nodes = [helper.make_node("Tanh", ["h_in"], ["h_out"]),
             helper.make_node("ReduceMax", ["h_out"], ["top"], keepdims=0),
             helper.make_node("Greater", ["top", "stop"], ["more"]),
             helper.make_node("Identity", ["row"], ["y"])]
    weights = _weights()
    model = _loop_model(5, nodes, {**weights, "stop": np.array(0.62, np.float32)}, cond="more")
    feeds = {"x": RNG.standard_normal((2, 5, 8)).astype(np.float32),
             "h0": RNG.uniform(1, 3, (2, 8)).astype(np.float32)}
    got = _agrees(model, feeds)
    assert len(calls) == 1 and 1 < got[1].shape[0] < 5  # stopped by the condition
    calls.clear()
    _agrees(_loop_model(5, EVERY_OP, weights), {**feeds, "x": feeds["x"]}, mode="off")
    assert not calls


def test_no_compiler_runs_the_kernels(calls, monkeypatch):
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(native_loop, "_FUNCTIONS", [])
    feeds = dict(np.load(CORPUS / "loop_scripted_ts16.s0.npz"))
    _agrees(str(CORPUS / "loop_scripted_ts16.onnx"), feeds)
    assert not calls


@needs_library
def test_an_index_out_of_range_runs_the_kernels(calls):
    """A Gather by an index the body reads from outside: in range natively, out of range the C
    call gives up and the kernels fail as CpuRef's."""
    nodes = [helper.make_node("Gather", ["h_in", "at"], ["picked"], axis=0),
             helper.make_node("Add", ["h_in", "picked"], ["h_out"]),
             helper.make_node("Identity", ["row"], ["y"])]
    model = _loop_model(3, nodes, {})
    graph = model.graph
    graph.input.append(_value("at", TensorProto.INT64))
    feeds = {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32),
             "h0": RNG.standard_normal((2, 8)).astype(np.float32)}
    _agrees(model, {**feeds, "at": np.array(-1, np.int64)})
    assert len(calls) == 1
    with pytest.raises(Exception, match="(?i)index|out of|bounds"):
        _session(model, "auto").run(None, {**feeds, "at": np.array(2, np.int64)})
