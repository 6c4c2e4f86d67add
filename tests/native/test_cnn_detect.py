"""The native CNN plan's detector layers (native/cnn_detect.py, cnn_detect.h): TopK, Gather,
GatherElements and GatherND by computed indices, Expand, ArgMax / ArgMin, Cast of indices,
Softmax, after a convolution, against CpuRef (hypothesis shapes; ties, NaN in -> NaN out), and
the corpus detectors' partitions whole in C against ONNX Runtime; pinned by option
(CpuAcc.native), never by a measurement.

The convolutions here take small integers (inputs, weights, biases): their sums are exact in any
order, so the ties a TopK or an ArgMax meets are CpuRef's own, whatever the kernels' order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.native.test_cnn import CORPUS, _session, needs_compiler  # noqa: E402
from tests.native.test_cnn_moves import _partition_routes  # noqa: E402


def _integer_conv(rng, n: int, c: int, oc: int, h: int, w: int, nan: int | None):
    """x (n, c, h, w) -> Conv 3x3 pad 1 -> Conv 1x1, of small integers: (n, oc, h, w), exact
    sums (two layers: with the one under test, a partition of three, ``traced.MIN_LAYERS``); a
    NaN at ``nan`` (a flat place of x) where given."""
    weight = rng.integers(-2, 3, (oc, c, 3, 3)).astype(np.float32)
    bias = rng.integers(-2, 3, oc).astype(np.float32)
    mixing = rng.integers(-1, 2, (oc, oc, 1, 1)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b"),
             numpy_helper.from_array(mixing, "w1")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y0"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["y0", "w1"], ["y"])]
    x = rng.integers(-2, 3, (n, c, h, w)).astype(np.float32)
    if nan is not None:
        x.reshape(-1)[nan % x.size] = np.nan
    return nodes, inits, x


def _constant(inits: list, name: str, values, dtype=np.int64) -> str:
    inits.append(numpy_helper.from_array(np.array(values, dtype), name))
    return name


def _run_both(model, feeds) -> tuple[list, list, list]:
    session = _session(model)
    got = session.run(None, feeds)
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    return _partition_routes(session), got, want


def _same(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w)  # NaN where CpuRef has NaN: equal here


@st.composite
def topk_cases(draw):
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 5)),
             draw(st.integers(1, 5))]
    axis = draw(st.integers(-4, 3))
    return dict(shape=shape, axis=axis, k=draw(st.integers(1, shape[axis])),
                largest=draw(st.integers(0, 1)), seed=draw(st.integers(0, 999)),
                nan=draw(st.one_of(st.none(), st.integers(0, 500))), clip=draw(st.booleans()))


@needs_compiler
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=topk_cases())
def test_a_topk_after_a_convolution_gives_cpurefs_values_and_indices(case):
    """Ties (a Clip's bounds, small integers) keep the lower index first; a NaN ranks above
    every number for the largest and below for the smallest, as CpuRef's stable sorts."""
    rng = np.random.default_rng(case["seed"])
    n, c, h, w = case["shape"]
    nodes, inits, x = _integer_conv(rng, n, 2, c, h, w, case["nan"])
    source = "y"
    if case["clip"]:
        nodes.append(helper.make_node("Clip", ["y", _constant(inits, "lo", 0, np.float32),
                                               _constant(inits, "hi", 2, np.float32)], ["yc"]))
        source = "yc"
    nodes.append(helper.make_node("TopK", [source, _constant(inits, "k", [case["k"]])],
                                  ["values", "indices"], axis=case["axis"],
                                  largest=case["largest"]))
    model = make_model(nodes, [float_input("x", [n, 2, h, w])],
                       [float_input("values", None),
                        helper.make_tensor_value_info("indices", TensorProto.INT64, None)],
                       inits, opset=17)
    routes, got, want = _run_both(model, {"x": x})
    assert routes == ["native"], (routes, case)
    _same(got, want)


@st.composite
def gather_cases(draw):
    return dict(n=draw(st.integers(1, 2)), oc=draw(st.integers(1, 5)), h=draw(st.integers(1, 4)),
                w=draw(st.integers(1, 4)), op=draw(st.sampled_from(
                    ["GatherElements", "Gather", "GatherND"])),
                k=draw(st.integers(1, 16)), seed=draw(st.integers(0, 999)),
                nan=draw(st.one_of(st.none(), st.integers(0, 500))))


def _gather_model(case: dict):
    """A detector's head: (N, C, H, W) -> (N, H*W, C) candidates, each one's best channel, the
    top k of those, then the candidates (or their best channels' indices) gathered by them."""
    rng = np.random.default_rng(case["seed"])
    n, oc, h, w = case["n"], case["oc"], case["h"], case["w"]
    k = min(case["k"], h * w)
    nodes, inits, x = _integer_conv(rng, n, 2, oc, h, w, case["nan"])
    nodes += [helper.make_node("Reshape", ["y", _constant(inits, "s3", [n, oc, h * w])], ["r"]),
              helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1])]  # (N, HW, C)
    op, outputs = case["op"], ["picked"]
    if op == "GatherElements":  # detect_nms_ts14's: the indices expanded over the channels
        nodes += [helper.make_node("ReduceMax", ["t", _constant(inits, "ax", [-1])], ["best"],
                                   keepdims=0),
                  helper.make_node("TopK", ["best", _constant(inits, "k", [k])], ["top", "idx"],
                                   axis=1),
                  helper.make_node("Unsqueeze", ["idx", _constant(inits, "u", [-1])], ["idx3"]),
                  helper.make_node("Expand", ["idx3", _constant(inits, "e", [1, 1, oc])],
                                   ["idx_e"]),
                  helper.make_node("GatherElements", ["t", "idx_e"], ["picked"], axis=1)]
    elif op == "Gather":  # 2-d indices into the last axis: (N, C, N, k)
        nodes += [helper.make_node("ReduceMax", ["r", _constant(inits, "ax", [1])], ["best"],
                                   keepdims=0),
                  helper.make_node("TopK", ["best", _constant(inits, "k", [k])], ["top", "idx"],
                                   axis=-1),
                  helper.make_node("Gather", ["r", "idx"], ["picked"], axis=2)]
    else:  # detect_nms_dyn21's: the first image, labels by ArgMax, GatherND by (k, 1) indices
        nodes += [helper.make_node("Gather", ["t", _constant(inits, "zero", 0)], ["s"], axis=0),
                  helper.make_node("ReduceMax", ["s", _constant(inits, "ax", [-1])], ["best"],
                                   keepdims=0),
                  helper.make_node("ArgMax", ["s"], ["labels"], axis=-1, keepdims=0),
                  helper.make_node("TopK", ["best", _constant(inits, "k", [k])], ["top", "idx"],
                                   axis=-1),
                  helper.make_node("Unsqueeze", ["idx", _constant(inits, "u", [-1])], ["idx2"]),
                  helper.make_node("GatherND", ["s", "idx2"], ["picked"]),
                  helper.make_node("GatherND", ["labels", "idx2"], ["picked_labels"]),
                  helper.make_node("Cast", ["picked_labels"], ["labels_f"], to=1),
                  helper.make_node("Add", ["picked", "labels_f_2"], ["offset"])]
        nodes.insert(-1, helper.make_node("Unsqueeze", ["labels_f", _constant(inits, "u1", [1])],
                                          ["labels_f_2"]))
        outputs = ["offset", "picked_labels"]
    types = {"picked_labels": TensorProto.INT64}
    model = make_model(nodes, [float_input("x", [n, 2, h, w])],
                       [helper.make_tensor_value_info(o, types.get(o, TensorProto.FLOAT), None)
                        for o in outputs], inits, opset=18)
    return model, {"x": x}


@needs_compiler
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=gather_cases())
def test_gathers_by_a_topks_indices_match_cpuref(case):
    model, feeds = _gather_model(case)
    routes, got, want = _run_both(model, feeds)
    assert routes == ["native"], (routes, case)
    _same(got, want)


@st.composite
def arg_cases(draw):
    return dict(shape=[draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 4)),
                       draw(st.integers(1, 4))],
                op=draw(st.sampled_from(["ArgMax", "ArgMin"])), axis=draw(st.integers(-4, 3)),
                keepdims=draw(st.integers(0, 1)), last=draw(st.integers(0, 1)),
                seed=draw(st.integers(0, 999)), nan=draw(st.one_of(st.none(), st.integers(0, 500))))


@needs_compiler
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=arg_cases())
def test_an_argmax_or_argmin_after_a_convolution_gives_cpurefs_indices(case):
    """The first (or last: select_last_index) of equal extremes; a NaN wins, NumPy's."""
    rng = np.random.default_rng(case["seed"])
    n, c, h, w = case["shape"]
    nodes, inits, x = _integer_conv(rng, n, 2, c, h, w, case["nan"])
    nodes.append(helper.make_node(case["op"], ["y"], ["i"], axis=case["axis"],
                                  keepdims=case["keepdims"], select_last_index=case["last"]))
    model = make_model(nodes, [float_input("x", [n, 2, h, w])],
                       [helper.make_tensor_value_info("i", TensorProto.INT64, None)], inits,
                       opset=17)
    routes, got, want = _run_both(model, {"x": x})
    assert routes == ["native"], (routes, case)
    _same(got, want)


@needs_compiler
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 5), min_size=4, max_size=4), axis=st.integers(-4, 3),
       seed=st.integers(0, 999), nan=st.one_of(st.none(), st.integers(0, 500)))
def test_a_softmax_after_a_convolution_matches_cpuref(shape, axis, seed, nan):
    rng = np.random.default_rng(seed)
    n, c, h, w = shape
    nodes, inits, x = _integer_conv(rng, n, 2, c, h, w, nan)
    x *= 0.25  # exponents of a few units
    nodes.append(helper.make_node("Softmax", ["y"], ["p"], axis=axis))
    model = make_model(nodes, [float_input("x", [n, 2, h, w])], [float_input("p", None)], inits,
                       opset=17)
    routes, (got,), (want,) = _run_both(model, {"x": x})
    assert routes == ["native"], routes
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@needs_compiler
def test_an_index_out_of_its_axis_fails_the_run_as_cpurefs_does():
    """An ArgMax over 5 channels gathering along an axis of 3: index 4 is outside, an error in
    both (the C checks each index it reads; no read past the tensor)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = _integer_conv(rng, 1, 2, 5, 3, 3, None)
    inits[1] = numpy_helper.from_array(np.array([0, 0, 0, 0, 50], np.float32), "b")
    nodes += [helper.make_node("ArgMax", ["y"], ["i"], axis=1, keepdims=0),  # (1, 3, 3): 4s
              helper.make_node("Gather", ["y", "i"], ["g"], axis=2)]
    model = make_model(nodes, [float_input("x", [1, 2, 3, 3])], [float_input("g", None)], inits,
                       opset=17)
    session = _session(model)
    assert _partition_routes(session) == ["native"]
    with pytest.raises(Exception):
        InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    with pytest.raises(Exception, match="out of range|index"):
        session.run(None, {"x": x})


@needs_compiler
def test_arithmetic_on_indices_is_left_to_the_trace():
    """An index's Div is int64's (floor), not a float's: the plan stops before it and the rest is
    traced, CpuRef's values."""
    rng = np.random.default_rng(1)
    nodes, inits, x = _integer_conv(rng, 1, 2, 5, 3, 4, None)
    nodes += [helper.make_node("ArgMax", ["y"], ["i"], axis=1, keepdims=0),
              helper.make_node("Div", ["i", _constant(inits, "two", 2)], ["half"])]
    model = make_model(nodes, [float_input("x", [1, 2, 3, 4])],
                       [helper.make_tensor_value_info("half", TensorProto.INT64, None)], inits,
                       opset=17)
    routes, got, want = _run_both(model, {"x": x})
    assert all(not str(r).startswith("native") or str(r).startswith("native+") for r in routes), \
        routes
    _same(got, want)


DETECTORS = ("detect_nms_ts14", "detect_nms_dyn21")


@needs_compiler
@pytest.mark.parametrize("name", DETECTORS)
def test_a_detectors_partition_is_one_native_call_and_matches_onnx_runtime(name):
    import onnxruntime

    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    path, shapes = f"{CORPUS}/{name}.onnx", {k: list(v.shape) for k, v in feeds.items()}
    session = _session(path, input_shapes=shapes)
    assert _partition_routes(session) == ["native"]
    got = session.run(None, feeds)
    for want in (InferenceSession(path, backends=["CpuRef"]).run(None, feeds),
                 onnxruntime.InferenceSession(path).run(None, feeds)):
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, abs(w).max()))
