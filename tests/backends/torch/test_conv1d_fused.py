"""CpuAcc's 1-d convolutions as FusedConv layers of height 1 (``fusion.conv._on_line``): which
become one, that they read a transposed (N, L, C) input without copying it, and that they compute
what CpuRef computes, post-ops, padding, groups, a residual and NaN included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_fusion import placed  # noqa: E402
from tests.conftest import float_input, inner_workloads, make_model  # noqa: E402

RNG = np.random.default_rng(5)


def _const(name: str, *shape: int, positive: bool = False) -> onnx.TensorProto:
    value = RNG.standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(np.abs(value) + 0.5 if positive else value * 0.3, name)


def gated_model(length: int = 64, channels: int = 8) -> onnx.ModelProto:
    """bytes_int32_dyn20's pattern: (1, L, C) -> Transpose -> two sibling 1-d convolutions (kernel
    8, stride 4), one through BatchNormalization and Relu, the other through a Sigmoid -> Mul."""
    inits = [_const("w1", 16, channels, 8), _const("b1", 16), _const("w2", 16, channels, 8),
             _const("b2", 16), _const("scale", 16), _const("shift", 16), _const("mean", 16),
             _const("var", 16, positive=True)]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Conv", ["t", "w1", "b1"], ["c1"], name="conv", strides=[4]),
             helper.make_node("BatchNormalization", ["c1", "scale", "shift", "mean", "var"],
                              ["n1"], name="bn"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["t", "w2", "b2"], ["c2"], name="gate", strides=[4]),
             helper.make_node("Sigmoid", ["c2"], ["g"], name="sigmoid"),
             helper.make_node("Mul", ["r1", "g"], ["y"], name="mul")]
    return make_model(nodes, [float_input("x", [1, length, channels])], [float_input("y", None)],
                      inits)


def _session(model: onnx.ModelProto, **options: str) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _cpuref(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]


@pytest.mark.parametrize("compile_mode", ["layers", "auto"])
@pytest.mark.parametrize("route", ["onednn", "torch"])
def test_sibling_1d_convolutions_become_fused_convs(route: str, compile_mode: str) -> None:
    model = gated_model()
    session = _session(model, **{"CpuAcc.conv_route": route, "CpuAcc.compile": compile_mode})
    convs = [layer for layer in placed(session) if layer.op_type == "FusedConv"]
    assert sorted(layer.name for layer in convs) == ["conv+bn+relu", "gate+sigmoid"]
    assert all(layer.attrs["input_shape"] == [1, 8, 1, 64] for layer in convs)
    feeds = {"x": RNG.standard_normal((1, 64, 8)).astype(np.float32)}
    np.testing.assert_allclose(session.run(None, feeds)[0], _cpuref(model, feeds),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("route", ["onednn", "torch"])
def test_a_transposed_input_is_read_without_a_copy(route: str) -> None:
    """The (N, C, L) view of an (N, L, C) tensor is channels-last at height 1: no copy of it
    (torch's conv1d made it contiguous first). 4096 x 8 values: torch's conv2d takes oneDNN's convolution
    from 20480 values (its own, below, makes the input contiguous)."""
    session = _session(gated_model(length=4096), **{"CpuAcc.conv_route": route,
                                                    "CpuAcc.compile": "layers"})
    workloads = inner_workloads(session, "FusedConv")
    assert len(workloads) == 2
    x = torch.randn(1, 4096, 8).transpose(1, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for workload in workloads:
            workload(x)
    copies = {e.key: e.count for e in prof.key_averages()
              if e.key in ("aten::copy_", "aten::clone")}
    assert not copies, copies
    (y,) = workloads[1](x)  # the gate: conv -> sigmoid
    assert y.shape == (1, 16, 1023)


@pytest.mark.parametrize("attrs, x_shape, w_shape", [
    ({"pads": [1, 2], "dilations": [2]}, [1, 6, 40], (12, 6, 3)),
    ({"auto_pad": "SAME_UPPER", "strides": [2]}, [2, 6, 33], (12, 6, 4)),
    ({"group": 3, "pads": [1, 1]}, [1, 6, 40], (12, 2, 3)),
])
def test_padding_dilation_groups_and_nan_as_cpuref(attrs, x_shape, w_shape) -> None:
    inits = [_const("w", *w_shape), _const("b", w_shape[0])]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", **attrs),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = make_model(nodes, [float_input("x", x_shape)], [float_input("y", None)], inits)
    session = InferenceSession(model, backends=["CpuAcc"])
    assert [layer.op_type for layer in placed(session)] == ["FusedConv"]
    x = RNG.standard_normal(x_shape).astype(np.float32)
    x[0, 1, 7] = np.nan  # the outputs whose windows read it are NaN, Relu or not
    got, expected = session.run(None, {"x": x})[0], _cpuref(model, {"x": x})
    assert np.isnan(expected).any() and np.array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_residual_add_is_the_binary_post_op() -> None:
    inits = [_const("w", 8, 8, 3), _const("b", 8)]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["y"], name="relu")]
    model = make_model(nodes, [float_input("x", [1, 8, 50])], [float_input("y", None)], inits)
    session = _session(model, **{"CpuAcc.conv_route": "onednn"})
    (fused,) = placed(session)
    assert fused.op_type == "FusedConv" and fused.attrs["binary"]
    feeds = {"x": RNG.standard_normal((1, 8, 50)).astype(np.float32)}
    np.testing.assert_allclose(session.run(None, feeds)[0], _cpuref(model, feeds),
                               rtol=1e-4, atol=1e-5)


def test_a_quantized_round_trip_keeps_the_1d_convolution_apart() -> None:
    """A QuantizeLinear after it would hand the fused layer to the int8 routes, which take 2-d
    convolutions only: the Conv stays a layer of its own."""
    inits = [_const("w", 8, 4, 3), _const("b", 8),
             numpy_helper.from_array(np.float32(0.05), "s"),
             numpy_helper.from_array(np.uint8(128), "z")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("QuantizeLinear", ["c", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    model = make_model(nodes, [float_input("x", [1, 4, 40])], [float_input("y", None)], inits)
    session = InferenceSession(model, backends=["CpuAcc"])
    assert "FusedConv" not in [layer.op_type for layer in placed(session)]
    feeds = {"x": RNG.standard_normal((1, 4, 40)).astype(np.float32)}
    np.testing.assert_allclose(session.run(None, feeds)[0], _cpuref(model, feeds), atol=0.051)
