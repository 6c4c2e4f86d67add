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
from tests.conftest import float_input, inner_workloads, make_model  # noqa: E402

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


def placed(session: InferenceSession) -> list:
    """The layers as placed, copies left out, each OneDnnGraph's and Traced's own layers in its
    place."""
    layers = []
    for layer in session.optimized.graph.layers:
        if layer.op_type in ("OneDnnGraph", "Traced"):
            layers += layer.attrs["layers"]
        elif layer.op_type not in ("MemCopy", "MemImport"):
            layers.append(layer)
    return layers


def _on_cpuacc(model: onnx.ModelProto, **options: str) -> InferenceSession:
    """The model on CpuAcc alone, with backend options."""
    return InferenceSession(model, backends=["CpuAcc"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def assert_matches_cpuref(session: InferenceSession, model: onnx.ModelProto) -> None:
    """CpuAcc's output within 1e-4 (relative) of CpuRef's on random inputs."""
    feeds = _feeds(model)
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype(np.float32) for i in model.graph.input}


@pytest.mark.parametrize("route", ["onednn", "torch"])
@pytest.mark.parametrize("tail", ["relu", "add_relu", "swish", "clip"])
def test_conv_chains_become_one_layer(tail: str, route: str) -> None:
    model = conv_model(tail)
    session = _on_cpuacc(model, **{"CpuAcc.conv_route": route})
    fused = placed(session)
    assert [layer.op_type for layer in fused] == ["FusedConv"]
    assert {"conv", "bn"} <= set(fused[0].name.split("+"))
    assert_matches_cpuref(session, model)


def test_asymmetric_padding_is_padded_first() -> None:
    model = conv_model("relu", pads=[0, 1, 2, 1])
    session = InferenceSession(model, backends=["CpuAcc"])
    assert_matches_cpuref(session, model)


def test_an_intermediate_read_elsewhere_is_not_fused() -> None:
    model = conv_model("relu")
    model.graph.output.append(helper.make_empty_tensor_value_info("n"))  # the BN output is read
    session = InferenceSession(model, backends=["CpuAcc"])
    ops = [layer.op_type for layer in placed(session)]
    assert ops == ["FusedConv", "Relu"]


def _hard_sigmoid_gated_conv(alpha: float, gate_first: bool) -> onnx.ModelProto:
    """x -> Conv -> x * HardSigmoid(x): torch.onnx's hard-swish below opset 14."""
    mul = ["g", "c"] if gate_first else ["c", "g"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("HardSigmoid", ["c"], ["g"], name="gate", alpha=alpha),
             helper.make_node("Mul", mul, ["y"], name="mul")]
    return make_model(nodes, [float_input("x", [1, 4, 6, 6])], [float_input("y", [1, 8, 6, 6])],
                      [_const("w", 8, 4, 3, 3), _const("b", 8)])


@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("route", ["onednn", "torch"])
def test_conv_times_its_hard_sigmoid_is_one_hardswish_conv(route: str, gate_first: bool) -> None:
    model = _hard_sigmoid_gated_conv(1 / 6, gate_first)
    session = _on_cpuacc(model, **{"CpuAcc.conv_route": route})
    (conv,) = placed(session)
    assert conv.op_type == "FusedConv" and conv.attrs["unary"] == ("hardswish", [], None)
    assert_matches_cpuref(session, model)
    x = _feeds(model)["x"]
    x[0, 1, 2, 3] = np.nan
    got = session.run(None, {"x": x})[0]
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.isnan(got).any()


def test_another_hard_sigmoid_slope_stays_apart() -> None:
    model = _hard_sigmoid_gated_conv(0.2, False)  # ONNX's default alpha: not hard-swish
    session = _on_cpuacc(model)
    assert [layer.op_type for layer in placed(session)] == ["FusedConv", "HardSigmoid", "Mul"]
    assert_matches_cpuref(session, model)


@pytest.mark.parametrize("route", ["mkl", "onednn", "auto"])
def test_matmul_add_gelu_becomes_one_linear(route: str) -> None:
    inits = [_const("w", 16, 24), _const("bias", 24)]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["bias", "m"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    model = make_model(nodes, [float_input("x", [2, 5, 16])], [float_input("y", [2, 5, 24])], inits)
    session = _on_cpuacc(model, **{"CpuAcc.linear_route": route})
    ops = [layer.op_type for layer in placed(session)]
    assert ops == ["Linear"]
    assert_matches_cpuref(session, model)


def test_gemm_with_alpha_beta_and_trans_b() -> None:
    inits = [_const("w", 24, 16), _const("c", 24)]
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm", alpha=0.5, beta=2.0,
                              transB=1)]
    model = make_model(nodes, [float_input("x", [3, 16])], [float_input("y", [3, 24])], inits)
    session = InferenceSession(model, backends=["CpuAcc"])
    assert [lay.op_type for lay in placed(session)] == ["Linear"]
    assert_matches_cpuref(session, model)


def _gelu_nodes(x: str, y: str, half_first: bool) -> list[onnx.NodeProto]:
    """GELU as the torch exporter writes it: x * 0.5 * (1 + erf(x / sqrt(2))), in either Mul order."""
    nodes = [helper.make_node("Div", [x, "sqrt2"], ["d"], name="div"),
             helper.make_node("Erf", ["d"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["p"], name="plus_one")]
    if half_first:
        return nodes + [helper.make_node("Mul", [x, "half"], ["h"], name="half"),
                        helper.make_node("Mul", ["h", "p"], [y], name="gelu")]
    return nodes + [helper.make_node("Mul", [x, "p"], ["h"], name="times"),
                    helper.make_node("Mul", ["h", "half"], [y], name="gelu")]


GELU_CONSTANTS = [numpy_helper.from_array(np.float32(v), n)
                  for n, v in (("sqrt2", np.sqrt(2)), ("one", 1.0), ("half", 0.5))]


@pytest.mark.parametrize("half_first", [False, True])
@pytest.mark.parametrize("route", ["mkl", "onednn"])
def test_linear_with_erf_gelu_becomes_one_layer(route: str, half_first: bool) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "bias"], ["a"], name="add"), *_gelu_nodes("a", "y", half_first)]
    model = make_model(nodes, [float_input("x", [1, 6, 16])], [float_input("y", [1, 6, 24])],
                       [_const("w", 16, 24), _const("bias", 24), *GELU_CONSTANTS])
    session = _on_cpuacc(model, **{"CpuAcc.linear_route": route})
    (linear,) = placed(session)
    assert linear.op_type == "Linear" and linear.attrs["unary"] == ("gelu", [], "none")
    assert_matches_cpuref(session, model)


def test_a_gelu_lookalike_with_another_constant_stays_apart() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="matmul"), *_gelu_nodes("a", "y", False)]
    constants = [*GELU_CONSTANTS[:2], numpy_helper.from_array(np.float32(0.25), "half")]
    model = make_model(nodes, [float_input("x", [1, 6, 16])], [float_input("y", [1, 6, 24])],
                       [_const("w", 16, 24), *constants])
    session = InferenceSession(model, backends=["CpuAcc"])
    ops = [lay.op_type for lay in placed(session)]
    assert ops == ["Linear", "Div", "Erf", "Add", "Mul", "Mul"]
    assert_matches_cpuref(session, model)


@pytest.mark.parametrize("route", ["mkl", "onednn"])
def test_linear_plus_residual_becomes_one_layer(route: str) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "bias"], ["a"], name="add"),
             helper.make_node("Add", ["x", "a"], ["y"], name="residual")]
    model = make_model(nodes, [float_input("x", [1, 6, 16])], [float_input("y", [1, 6, 16])],
                       [_const("w", 16, 16), _const("bias", 16)])
    session = _on_cpuacc(model, **{"CpuAcc.linear_route": route})
    (linear,) = placed(session)
    assert linear.op_type == "Linear" and linear.attrs["binary"]
    assert session.report.layers["residual"].substituted_by == linear.name
    assert_matches_cpuref(session, model)


def squeeze_excite_model(act: str, gate: str) -> onnx.ModelProto:
    """x -> GlobalAveragePool -> 1x1 Conv -> act -> 1x1 Conv -> gate -> Mul(x, gate), as in
    mobilenet_v3 (Relu, HardSigmoid) and efficientnet (x * Sigmoid(x), Sigmoid)."""
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"], name="pool"),
             helper.make_node("Conv", ["p", "w1", "b1"], ["r"], name="reduce")]
    if act == "swish":
        nodes += [helper.make_node("Sigmoid", ["r"], ["rs"], name="act_sigmoid"),
                  helper.make_node("Mul", ["r", "rs"], ["a"], name="act")]
    else:
        nodes.append(helper.make_node(act, ["r"], ["a"], name="act"))
    gate_attrs = {"alpha": 1 / 6, "beta": 0.5} if gate == "HardSigmoid" else {}
    nodes += [helper.make_node("Conv", ["a", "w2", "b2"], ["e"], name="expand"),
              helper.make_node(gate, ["e"], ["g"], name="gate", **gate_attrs),
              helper.make_node("Mul", ["x", "g"], ["y"], name="scale")]
    inits = [_const("w1", 4, 16, 1, 1), _const("b1", 4), _const("w2", 16, 4, 1, 1), _const("b2", 16)]
    return make_model(nodes, [float_input("x", [1, 16, 5, 5])], [float_input("y", [1, 16, 5, 5])], inits)


@pytest.mark.parametrize(("act", "gate"), [("Relu", "HardSigmoid"), ("swish", "Sigmoid")])
def test_squeeze_excite_becomes_one_layer(act: str, gate: str) -> None:
    model = squeeze_excite_model(act, gate)
    session = InferenceSession(model, backends=["CpuAcc"])
    (fused,) = placed(session)
    assert fused.op_type == "SqueezeExcite"
    assert {session.report.layers[n].substituted_by for n in ("pool", "reduce", "gate", "scale")} \
        == {fused.name}
    assert_matches_cpuref(session, model)


def test_a_squeeze_excite_whose_gate_is_not_a_sigmoid_is_left_to_the_convolutions() -> None:
    model = squeeze_excite_model("Relu", "Relu")
    session = InferenceSession(model, backends=["CpuAcc"])
    ops = [lay.op_type for lay in placed(session)]
    assert "SqueezeExcite" not in ops and ops.count("FusedConv") == 2
    assert_matches_cpuref(session, model)


def _gelu_tanh_nodes(x: str, y: str) -> list[onnx.NodeProto]:
    """GELU's tanh form as GPT-2's export writes it."""
    return [helper.make_node("Mul", [x, "half"], ["h"], name="half"),
            helper.make_node("Pow", [x, "three"], ["c"], name="cube"),
            helper.make_node("Mul", ["c", "k"], ["ck"], name="cubic"),
            helper.make_node("Add", [x, "ck"], ["i"], name="inner"),
            helper.make_node("Mul", ["i", "s"], ["si"], name="scaled"),
            helper.make_node("Tanh", ["si"], ["t"], name="tanh"),
            helper.make_node("Add", ["t", "one"], ["p"], name="plus_one"),
            helper.make_node("Mul", ["h", "p"], [y], name="gelu")]


@pytest.mark.parametrize("route", ["mkl", "onednn"])
def test_gemm_reshape_tanh_gelu_becomes_one_layer(route: str) -> None:
    """GPT-2's MLP: Gemm on (tokens, features), Reshape back to (1, tokens, features), GELU (tanh)."""
    constants = [numpy_helper.from_array(np.float32(v), n) for n, v in
                 (("half", 0.5), ("three", 3.0), ("k", 0.044715), ("s", np.sqrt(2 / np.pi)),
                  ("one", 1.0))]
    shape = numpy_helper.from_array(np.array([1, 6, 24], np.int64), "shape")
    nodes = [helper.make_node("Gemm", ["x", "w", "bias"], ["m"], name="gemm"),
             helper.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
             *_gelu_tanh_nodes("r", "y")]
    model = make_model(nodes, [float_input("x", [6, 16])], [float_input("y", [1, 6, 24])],
                       [_const("w", 16, 24), _const("bias", 24), shape, *constants])
    session = _on_cpuacc(model, **{"CpuAcc.linear_route": route})
    (linear,) = placed(session)
    assert linear.op_type == "Linear" and linear.attrs["unary"] == ("gelu", [], "tanh")
    assert_matches_cpuref(session, model)


def _gelu_tanh_cubed_nodes(x: str, y: str, square_first: bool) -> list[onnx.NodeProto]:
    """GELU's tanh form with the cube as x * (x * x), constants first: torch.onnx's export of
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x * x * x)))`` (gpt_causal_ts15)."""
    cube = ["xx", x] if square_first else [x, "xx"]
    return [helper.make_node("Mul", [x, x], ["xx"], name="square"),
            helper.make_node("Mul", cube, ["c"], name="cube"),
            helper.make_node("Mul", ["k", "c"], ["ck"], name="cubic"),
            helper.make_node("Add", [x, "ck"], ["i"], name="inner"),
            helper.make_node("Mul", ["s", "i"], ["si"], name="scaled"),
            helper.make_node("Tanh", ["si"], ["t"], name="tanh"),
            helper.make_node("Add", ["one", "t"], ["p"], name="plus_one"),
            helper.make_node("Mul", [x, "p"], ["h"], name="times"),
            helper.make_node("Mul", ["half", "h"], [y], name="gelu")]


@pytest.mark.parametrize("square_first", [False, True])
@pytest.mark.parametrize("route", ["mkl", "onednn"])
def test_matmul_tanh_gelu_with_the_cube_as_products_becomes_one_layer(route: str,
                                                                      square_first: bool) -> None:
    constants = [numpy_helper.from_array(np.float32(v), n) for n, v in
                 (("half", 0.5), ("k", 0.044715), ("s", np.sqrt(2 / np.pi)), ("one", 1.0))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["bias", "m"], ["a"], name="add"),
             *_gelu_tanh_cubed_nodes("a", "y", square_first)]
    model = make_model(nodes, [float_input("x", [1, 6, 16])], [float_input("y", [1, 6, 24])],
                       [_const("w", 16, 24), _const("bias", 24), *constants])
    session = _on_cpuacc(model, **{"CpuAcc.linear_route": route})
    (linear,) = placed(session)
    assert linear.op_type == "Linear" and linear.attrs["unary"] == ("gelu", [], "tanh")
    assert_matches_cpuref(session, model)


def test_a_square_read_elsewhere_keeps_the_gelu_apart() -> None:
    """x * x also a graph output: the chain's layers stay, computing what CpuRef does."""
    constants = [numpy_helper.from_array(np.float32(v), n) for n, v in
                 (("half", 0.5), ("k", 0.044715), ("s", np.sqrt(2 / np.pi)), ("one", 1.0))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="matmul"),
             *_gelu_tanh_cubed_nodes("a", "y", False)]
    model = make_model(nodes, [float_input("x", [1, 6, 16])],
                       [float_input("y", [1, 6, 24]), float_input("xx", [1, 6, 24])],
                       [_const("w", 16, 24), *constants])
    session = _on_cpuacc(model)
    ops = [layer.op_type for layer in placed(session)]
    assert "Tanh" in ops and ops.count("Mul") >= 5
    assert_matches_cpuref(session, model)


@pytest.mark.parametrize("route", ["mkl", "onednn"])
def test_gemm_reshape_residual_becomes_one_layer(route: str) -> None:
    shape = numpy_helper.from_array(np.array([1, 6, 16], np.int64), "shape")
    nodes = [helper.make_node("Gemm", ["x", "w", "bias"], ["m"], name="gemm"),
             helper.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
             helper.make_node("Add", ["skip", "r"], ["y"], name="residual")]
    model = make_model(nodes, [float_input("x", [6, 16]), float_input("skip", [1, 6, 16])],
                       [float_input("y", [1, 6, 16])], [_const("w", 16, 16), _const("bias", 16), shape])
    session = _on_cpuacc(model, **{"CpuAcc.linear_route": route})
    (linear,) = placed(session)
    assert linear.op_type == "Linear" and linear.attrs["binary"]
    assert linear.attrs["output_shape"] == [1, 6, 16]
    assert_matches_cpuref(session, model)


@pytest.mark.parametrize("tail", ["relu", "add_relu", "swish"])
@pytest.mark.parametrize("route", ["gemm", "auto"])
def test_a_pointwise_conv_runs_as_a_matrix_product(tail: str, route: str) -> None:
    """A 1x1 convolution on channels-last pixels is (pixels, C) x (C, K): the gemm route."""
    model = conv_model(tail, pads=[0, 0, 0, 0])
    weight = next(init for init in model.graph.initializer if init.name == "w")
    weight.CopyFrom(_const("w", 8, 4, 1, 1))
    for node in model.graph.node:
        if node.op_type == "Conv":
            del node.attribute[:]
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 6
    session = _on_cpuacc(model, **{"CpuAcc.conv_route": route, "CpuAcc.compile": "layers"})
    (fused,) = placed(session)
    assert fused.op_type == "FusedConv"
    if route == "gemm":
        (workload,) = inner_workloads(session, "FusedConv")
        assert workload.route == "gemm"
    assert_matches_cpuref(session, model)
