"""CpuAcc's optimize_subgraph: which patterns become one fused layer, and that they compute what the
unfused layers compute on CpuRef."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(0)


def _const(name: str, *shape: int, positive: bool = False) -> onnx.TensorProto:
    value = RNG.standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(np.abs(value) + 0.5 if positive else value * 0.3, name)


def conv_model(tail: str, pads: list[int] | None = None) -> onnx.ModelProto:
    """x -> Conv (-> BatchNorm) -> tail, where tail is one of the patterns below."""
    inits = [_const("w", 8, 4, 3, 3), _const("b", 8), _const("scale", 8), _const("shift", 8),
             _const("mean", 8), _const("var", 8, positive=True)]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=pads or [1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"],
                              name="bn")]
    out_shape = [1, 8, 6, 6] if pads is None else None
    if tail == "relu":
        nodes.append(helper.make_node("Relu", ["n"], ["y"], name="relu"))
    elif tail == "add_relu":
        nodes += [helper.make_node("Add", ["n", "skip"], ["s"], name="add"),
                  helper.make_node("Relu", ["s"], ["y"], name="relu")]
    elif tail == "swish":
        nodes += [helper.make_node("Sigmoid", ["n"], ["g"], name="sigmoid"),
                  helper.make_node("Mul", ["n", "g"], ["y"], name="mul")]
    elif tail == "clip":
        inits += [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
        nodes.append(helper.make_node("Clip", ["n", "lo", "hi"], ["y"], name="clip"))
    inputs = [float_input("x", [1, 4, 6, 6])] + ([float_input("skip", [1, 8, 6, 6])]
                                                 if tail == "add_relu" else [])
    return make_model(nodes, inputs, [float_input("y", out_shape)], inits)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype(np.float32) for i in model.graph.input}


@pytest.mark.parametrize("route", ["onednn", "torch"])
@pytest.mark.parametrize("tail", ["relu", "add_relu", "swish", "clip"])
def test_conv_chains_become_one_layer(tail: str, route: str) -> None:
    model = conv_model(tail)
    feeds = _feeds(model)
    options = RuntimeOptions(backend_options={"CpuAcc.conv_route": route})
    session = InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(options))
    fused = [layer for layer in session.optimized.graph.layers if layer.op_type != "MemCopy"]
    assert [layer.op_type for layer in fused] == ["FusedConv"]
    assert session.report.layers["conv"].substituted_by == fused[0].name
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)


def test_asymmetric_padding_is_padded_first() -> None:
    model = conv_model("relu", pads=[0, 1, 2, 1])
    feeds = _feeds(model)
    session = InferenceSession(model, backends=["CpuAcc"])
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)


def test_an_intermediate_read_elsewhere_is_not_fused() -> None:
    model = conv_model("relu")
    model.graph.output.append(helper.make_empty_tensor_value_info("n"))  # the BN output is read
    session = InferenceSession(model, backends=["CpuAcc"])
    ops = [layer.op_type for layer in session.optimized.graph.layers if layer.op_type != "MemCopy"]
    assert ops == ["FusedConv", "Relu"]


@pytest.mark.parametrize("route", ["mkl", "onednn", "auto"])
def test_matmul_add_gelu_becomes_one_linear(route: str) -> None:
    inits = [_const("w", 16, 24), _const("bias", 24)]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["bias", "m"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    model = make_model(nodes, [float_input("x", [2, 5, 16])], [float_input("y", [2, 5, 24])], inits)
    feeds = _feeds(model)
    options = RuntimeOptions(backend_options={"CpuAcc.linear_route": route})
    session = InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(options))
    ops = [layer.op_type for layer in session.optimized.graph.layers if layer.op_type != "MemCopy"]
    assert ops == ["Linear"]
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)


def test_gemm_with_alpha_beta_and_trans_b() -> None:
    inits = [_const("w", 24, 16), _const("c", 24)]
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm", alpha=0.5, beta=2.0,
                              transB=1)]
    model = make_model(nodes, [float_input("x", [3, 16])], [float_input("y", [3, 24])], inits)
    feeds = _feeds(model)
    session = InferenceSession(model, backends=["CpuAcc"])
    assert [lay.op_type for lay in session.optimized.graph.layers if lay.op_type != "MemCopy"] == ["Linear"]
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)
