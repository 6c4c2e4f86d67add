"""The native CNN plan's moves (Transpose, Slice, Split, Reshape: a view where channels-last
orders the elements alike, else a gather) and a Traced partition's native first layers
(``native_cnn.traced_prefix``: a CNN, then layers the plan does not take, traced), against
CpuRef; pinned by option (CpuAcc.native), never by a measurement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.native.test_cnn import CORPUS, _session, needs_compiler  # noqa: E402


def _partition_routes(session: InferenceSession) -> list[str]:
    loaded = session.runtime.network(session.network_id)
    return [getattr(step.workload, "route", None) for step, layer in
            zip(loaded.steps, loaded.layers) if layer.op_type in ("OneDnnGraph", "Traced")]


@st.composite
def move_cases(draw):
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 6)),
             draw(st.integers(1, 6))]
    op = draw(st.sampled_from(["Transpose", "Slice", "Split", "Reshape"]))
    case = dict(shape=shape, op=op, seed=draw(st.integers(0, 999)),
                tail=draw(st.sampled_from(["", "Erf", "Softsign"])))
    if op == "Transpose":
        case["perm"] = draw(st.permutations(range(4)))
    elif op == "Slice":
        axes = draw(st.lists(st.integers(-4, 3), min_size=1, max_size=3,
                             unique_by=lambda a: a % 4))
        bounds = []
        for axis in axes:
            size = shape[axis % 4]
            step = draw(st.sampled_from([1, 1, 2, -1, -2]))
            start = draw(st.integers(-size - 2, size + 2))
            end = draw(st.integers(-size - 2, size + 2))
            if step > 0 and len(range(*slice(start, end, step).indices(size))) == 0:
                start, end = 0, size
            if step < 0 and len(range(*slice(start, end, step).indices(size))) == 0:
                start, end = size - 1, -size - 1
            bounds.append((start, end, step))
        case.update(axes=axes, bounds=bounds)
    elif op == "Split":
        axis = draw(st.integers(0, 3))
        size = shape[axis]
        cut = sorted(draw(st.sets(st.integers(1, max(1, size - 1)), max_size=2)))
        cut = [c for c in cut if 0 < c < size]
        case.update(axis=axis, sizes=np.diff([0, *cut, size]).tolist())
    else:
        n, c, h, w = shape
        case["target"] = draw(st.sampled_from([[n, c, h * w], [n, c * h, w], [n, -1], [n, c, 1, h * w],
                                               [n * c, h, w], [n, c, w, h]]))
    return case


def _move_model(case: dict):
    rng = np.random.default_rng(case["seed"])
    n, c, h, w = case["shape"]
    inits = [numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y"], ["r"])]
    outs = ["m"]
    op = case["op"]
    if op == "Transpose":
        nodes.append(helper.make_node("Transpose", ["r"], ["m"], perm=list(case["perm"])))
    elif op == "Slice":
        starts, ends, steps = zip(*case["bounds"])
        for name, values in (("s", starts), ("e", ends), ("a", case["axes"]), ("t", steps)):
            inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
        nodes.append(helper.make_node("Slice", ["r", "s", "e", "a", "t"], ["m"]))
    elif op == "Split":
        inits.append(numpy_helper.from_array(np.array(case["sizes"], np.int64), "sp"))
        outs = [f"m{i}" for i in range(len(case["sizes"]))]
        nodes.append(helper.make_node("Split", ["r", "sp"], outs, axis=case["axis"]))
    else:
        inits.append(numpy_helper.from_array(np.array(case["target"], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["r", "shape"], ["m"]))
    if case["tail"]:  # a layer the plan does not take: the CNN is a Traced partition's head
        nodes.append(helper.make_node(case["tail"], [outs[-1]], ["tail"]))
        outs = [*outs[:-1], "tail"]
    model = make_model(nodes, [float_input("x", [n, 3, h, w])],
                       [float_input(o, None) for o in outs], inits)
    x = rng.standard_normal((n, 3, h, w)).astype(np.float32)
    x.reshape(-1)[case["seed"] % x.size] = np.nan  # NaN in, NaN out
    return model, {"x": x}


@needs_compiler
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=move_cases())
def test_a_move_after_a_convolution_matches_cpuref(case):
    model, feeds = _move_model(case)
    session = _session(model)
    routes = _partition_routes(session)
    assert routes and all(str(r).startswith("native") for r in routes), (routes, case)
    got = session.run(None, feeds)
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * max(1.0, np.nanmax(np.abs(r))))


TRACED = {"detect_nms_ts14": "native", "detect_nms_dyn21": "native",
          "crnn_paddle_ts12": "native+", "audio_conv1d_dyn19": "native",
          "bytes_int32_dyn20": "native"}
"""The corpus rows and their Traced partition's route: its first layers native, or all of it
(audio_conv1d's GELUs whole where torch's GELU loses +Inf and CpuAcc leaves them written out:
``cnn_seq.fold``; bytes_int32's int32 and bool inputs as indices, its embedding one record)."""


@needs_compiler
@pytest.mark.parametrize("name", TRACED)
def test_a_traced_partitions_cnn_runs_natively_and_matches_onnx_runtime(name):
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    path, shapes = f"{CORPUS}/{name}.onnx", {k: list(v.shape) for k, v in feeds.items()}
    session = _session(path, input_shapes=shapes)
    routes = [str(r) for r in _partition_routes(session)]
    route = TRACED[name]
    assert any(r == route if route == "native" else r.startswith(route) for r in routes), routes
    assert not any(str(r).startswith("native") for r in _partition_routes(
        _session(path, "off", input_shapes=shapes)))
    got = session.run(None, feeds)
    for want in (InferenceSession(path, backends=["CpuRef"]).run(None, feeds),
                 __import__("onnxruntime").InferenceSession(path).run(None, feeds)):
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, abs(w).max()))


@st.composite
def glue_cases(draw):
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 7)), draw(st.integers(1, 5)),
             draw(st.integers(1, 5))]
    op = draw(st.sampled_from(["Add", "Sub", "Mul", "Div", "Pow", "ReduceMax", "ReduceMin",
                               "ReduceSum", "ReduceMean", "Concat"]))
    case = dict(shape=shape, op=op, seed=draw(st.integers(0, 999)),
                rank5=draw(st.booleans()), tail=draw(st.sampled_from(["Relu", "Erf"])))
    if op in ("Add", "Sub", "Mul", "Div", "Pow"):
        # the other operand: a constant or the conv's Relu, of a shape that broadcasts
        case["other"] = draw(st.sampled_from(["constant", "tensor"]))
        case["other_shape"] = [d if draw(st.booleans()) else 1 for d in shape][
            draw(st.integers(0, 3)):]
        case["swap"] = case["other"] == "tensor" and draw(st.booleans())
    elif op == "Concat":
        case["axis"] = draw(st.integers(-4, 3))
    else:
        case["axes"] = draw(st.lists(st.integers(-4, 3), min_size=0, max_size=3,
                                     unique_by=lambda a: a % 4))
        case["keepdims"] = draw(st.integers(0, 1))
    return case


def _glue_model(case: dict):
    rng = np.random.default_rng(case["seed"])
    n, c, h, w = case["shape"]
    inits = [numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["y"], ["r"])]
    first = "r"
    if case["rank5"] and c > 1 and c % 2 == 0:  # a detector's (N, A, C / A, H, W)
        inits.append(numpy_helper.from_array(np.array([n, 2, c // 2, h, w], np.int64), "s5"))
        nodes.append(helper.make_node("Reshape", ["r", "s5"], ["r5"]))
        first = "r5"
    op = case["op"]
    if op in ("Add", "Sub", "Mul", "Div", "Pow"):
        other_shape = case["other_shape"]
        if first == "r5":
            other_shape = [1] * len(other_shape)
        if case["other"] == "constant":
            value = rng.uniform(0.5, 2.0, other_shape).astype(np.float32)
            inits.append(numpy_helper.from_array(value, "k"))
            second = "k"
        else:  # the first operand's mean over the axes the other has of size 1
            rank = 5 if first == "r5" else 4
            full = [1] * (rank - len(other_shape)) + list(other_shape)
            axes = [i for i in range(rank) if full[i] == 1]
            mean = first
            if axes:
                inits.append(numpy_helper.from_array(np.array(axes, np.int64), "ax2"))
                nodes.append(helper.make_node("ReduceMean", [first, "ax2"], ["m"], keepdims=1))
                mean = "m"
            inits.append(numpy_helper.from_array(np.array(other_shape, np.int64), "ks"))
            nodes.append(helper.make_node("Reshape", [mean, "ks"], ["k2"]))
            second = "k2"
        pair = [second, first] if case.get("swap") else [first, second]
        nodes.append(helper.make_node(op, pair, ["out"]))
    elif op == "Concat":
        axis = case["axis"] if first == "r" else case["axis"] % 4 + 1
        nodes += [helper.make_node("Relu", ["y"], ["q"])]
        other = "q"
        if first == "r5":
            nodes.append(helper.make_node("Reshape", ["q", "s5"], ["q5"]))
            other = "q5"
        nodes.append(helper.make_node("Concat", [first, other], ["out"], axis=axis))
    else:
        rank = 5 if first == "r5" else 4
        axes = sorted({a % rank for a in case["axes"]})
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "ax"))
        nodes.append(helper.make_node(op, [first, "ax"] if axes else [first], ["out"],
                                      keepdims=case["keepdims"]))
    last, tail = "out", case["tail"]
    if op.startswith("Reduce") and not case["keepdims"] and (
            not case["axes"] or len(case["axes"]) == 4 and first == "r"):
        tail = "Relu"  # a 0-d result: CpuRef's Erf takes none
    if tail:
        nodes.append(helper.make_node(tail, ["out"], ["tail"]))
        last = "tail"
    model = make_model(nodes, [float_input("x", [n, 3, h, w])], [float_input(last, None)],
                       inits, opset=18)
    x = rng.standard_normal((n, 3, h, w)).astype(np.float32)
    x.reshape(-1)[case["seed"] % x.size] = np.nan  # NaN in, NaN out
    return model, {"x": x}


@needs_compiler
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=glue_cases())
def test_broadcasts_reduces_and_concats_after_a_convolution_match_cpuref(case):
    model, feeds = _glue_model(case)
    session = _session(model)
    routes = _partition_routes(session)
    assert routes and all(str(r).startswith("native") for r in routes), (routes, case)
    got = session.run(None, feeds)
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
        finite = np.isfinite(r)
        np.testing.assert_allclose(g[finite], r[finite], rtol=1e-4,
                                   atol=1e-4 * max(1.0, np.abs(r[finite]).max(initial=0)))


@st.composite
def norm_cases(draw):
    return dict(c=draw(st.integers(1, 9)), length=draw(st.integers(1, 12)),
                oc=draw(st.integers(1, 7)), transpose=draw(st.booleans()),
                axis=draw(st.sampled_from([-1, 1, 2])), seed=draw(st.integers(0, 999)))


@needs_compiler
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=norm_cases())
def test_a_layer_norm_and_a_product_over_a_sequence_after_a_1d_convolution_match_cpuref(case):
    """audio_conv1d's tail: Conv1d, Transpose to (N, T, C), LayerNormalization (its rows one
    channel apart in the arena), a MatMul over the last axis (the rows gathered)."""
    rng = np.random.default_rng(case["seed"])
    c, length = case["c"], case["length"]
    shape = [1, length, c] if case["transpose"] else [1, c, length]
    axis = case["axis"]
    normed = shape[axis % 3:]
    inits = [numpy_helper.from_array(rng.standard_normal((c, 2, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(normed).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(normed).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((shape[-1], case["oc"]))
                                     .astype(np.float32), "m")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1])]
    last = "y"
    if case["transpose"]:
        nodes.append(helper.make_node("Transpose", ["y"], ["t"], perm=[0, 2, 1]))
        last = "t"
    nodes += [helper.make_node("LayerNormalization", [last, "g", "b"], ["n"], axis=axis),
              helper.make_node("MatMul", ["n", "m"], ["out"])]
    model = make_model(nodes, [float_input("x", [1, 2, length])], [float_input("out", None)],
                       inits, opset=18)
    x = rng.standard_normal((1, 2, length)).astype(np.float32)
    x.reshape(-1)[case["seed"] % x.size] = np.nan  # NaN in, NaN out
    session = _session(model)
    assert _partition_routes(session) == ["native"], case  # the whole partition in C
    got = session.run(None, {"x": x})[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4,
                               atol=1e-4 * max(1.0, np.abs(want[finite]).max(initial=0)))


def test_without_a_compiler_a_traced_partition_keeps_its_torch_routes(tmp_path, monkeypatch):
    from backplane.native import build

    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BACKPLANE_NATIVE_CACHE", str(tmp_path / "native"))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    name = "detect_nms_ts14"
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    path, shapes = f"{CORPUS}/{name}.onnx", {k: list(v.shape) for k, v in feeds.items()}
    session = _session(path, input_shapes=shapes)
    assert not any(str(r).startswith("native") for r in _partition_routes(session))
    for g, w in zip(session.run(None, feeds),
                    InferenceSession(path, backends=["CpuRef"]).run(None, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, abs(w).max()))


@needs_compiler
@pytest.mark.parametrize("op", ["Sub", "Add", "Mul"])
def test_a_constant_first_operand_is_planned_and_matches_cpuref(op):
    """yolo_v8's box decode: anchors - distances (c - x: x * -1 + c, exact), c + x, c * x, the
    constant broadcast over the channels; NaN in, NaN out."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((1, 1, 5, 6)).astype(np.float32), "c")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["y"], ["s"]),
             helper.make_node(op, ["c", "s"], ["out"])]
    model = make_model(nodes, [float_input("x", [1, 3, 5, 6])], [float_input("out", None)],
                       inits)
    x = rng.standard_normal((1, 3, 5, 6)).astype(np.float32)
    x[0, 1, 2, 3] = np.nan
    session = _session(model)
    assert _partition_routes(session) == ["native"]
    got = session.run(None, {"x": x})[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
