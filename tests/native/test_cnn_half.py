"""The native CNN route on float16 partitions (computed in float32, float16 at the edges, as
ONNX Runtime's CPU computes them), whose layers come unfused (Conv, then its Add and activation:
``_Planner.folding`` makes them the convolution's post-ops); against ONNX Runtime and CpuRef."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from tests.native.test_cnn import (CORPUS, _conv_model, _routes, _session,  # noqa: E402
                                   conv_cases, needs_compiler)
from backplane.backends.torch.fusion.traced import native_half  # noqa: E402

pytestmark = pytest.mark.skipif(
    native_half(), reason="this CPU computes float16 itself (AVX512-FP16, AMX-FP16): a float16 "
    "subgraph is not widened to float32 there, so the native plan is not offered (traced.py)")


def _half(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float32 model with float16 initializers, inputs and outputs."""
    for init in model.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float16), init.name))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


def _close(got: np.ndarray, want: np.ndarray, steps: float, nan: bool = True) -> None:
    """Within ``steps`` float16 steps of the largest magnitude; NaN where ``want`` has NaN (with
    ``nan``; else only where both are finite: ONNX Runtime's float16 MaxPool drops a NaN)."""
    assert got.dtype == np.float16 and got.shape == want.shape
    if nan:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    both = np.isfinite(got) & np.isfinite(want)
    scale = np.abs(want[np.isfinite(want)].astype(np.float32)).max(initial=1.0)
    np.testing.assert_allclose(got[both].astype(np.float32), want[both].astype(np.float32),
                               rtol=0, atol=steps * scale * 2.0 ** -10)


@needs_compiler
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=conv_cases(), line=st.booleans())
def test_a_float16_convolution_and_its_unfused_post_ops_match_onnx_runtime(case, line):
    if line:  # a 1-d convolution: the plan's line of height 1
        case.update(h=1, k=(1, case["k"][1]), dilations=[1, case["dilations"][1]],
                    strides=[1, case["strides"][1]], tail="")
        case["pads"][0] = case["pads"][2] = 0
    model, feeds = _conv_model(case)
    if line:
        model = _as_line(model)
        feeds = {k: v[:, :, 0] for k, v in feeds.items()}
    model = _half(model)
    feeds = {k: (v * 0.5).astype(np.float16) for k, v in feeds.items()}
    nan = case["seed"] % 3 == 0
    if nan:
        feeds["x"].reshape(-1)[case["seed"] % feeds["x"].size] = np.nan  # NaN in, NaN out
    session = _session(model)
    assert _routes(session) == ["native"], case
    got = session.run(None, feeds)[0]
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    _close(got, want, 4, nan=not nan)
    reference = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    _close(got, reference, 64)  # CpuRef rounds each layer's output to float16


def _as_line(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model's 2-d convolution of height 1 as a 1-d one (N, C, W)."""
    graph = model.graph
    for init in graph.initializer:
        array = numpy_helper.to_array(init)
        if array.ndim == 4:
            init.CopyFrom(numpy_helper.from_array(array[:, :, 0], init.name))
    for node in graph.node:
        if node.op_type == "Conv":
            for attr in node.attribute:
                if attr.name == "pads":
                    attr.ints[:] = [attr.ints[1], attr.ints[3]]
                elif attr.name in ("kernel_shape", "strides", "dilations"):
                    attr.ints[:] = attr.ints[1:]
    for value in (*graph.input, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if len(dims) == 4:
            del dims[2]
    return model


@needs_compiler
def test_a_conv_output_read_twice_is_not_folded():
    """Conv -> Relu and the Conv's output read by an Add too: the Relu stays a record of its
    own (folded, the Add would read the Relu's values)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float16), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("Add", ["r", "y"], ["out"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT16, [1, 4, 6, 6])], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = rng.standard_normal((1, 3, 6, 6)).astype(np.float16)
    session = _session(model)
    assert _routes(session) == ["native"]
    got = session.run(None, {"x": x})[0]
    _close(got, ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0], 4)


@needs_compiler
def test_the_float16_corpus_cnn_runs_natively_and_matches_onnx_runtime():
    name = "mobilenet_fp16_ts17"
    path, feeds = f"{CORPUS}/{name}.onnx", dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    session = _session(path, input_shapes=shapes)
    assert _routes(session) == ["native"]
    assert _routes(_session(path, "off", input_shapes=shapes)) != ["native"]
    loaded = session.runtime.network(session.network_id)
    (plan,) = [step.workload.executor.plan for step in loaded.steps
               if hasattr(step.workload, "executor")]
    assert plan.input_dtypes == [np.float16]  # converted by the C's import, not by torch
    assert plan.output_dtypes == [np.float16, np.float16]
    got = session.run(None, feeds)
    for g, w in zip(got, ort.InferenceSession(path).run(None, feeds)):
        _close(g, w, 2)
    for g, w in zip(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds)):
        _close(g, w, 8)
    nan = {k: v.copy() for k, v in feeds.items()}
    next(iter(nan.values())).reshape(-1)[7] = np.nan
    for g, w in zip(session.run(None, nan), InferenceSession(path, backends=["CpuRef"]).run(
            None, nan)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
