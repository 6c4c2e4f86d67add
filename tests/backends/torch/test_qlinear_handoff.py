"""Fused QLinear layers on the float route hand each other float32 integers less the zero point
(fusion/qlinear_handoff.py): no 8-bit tensor made between them, the same integers, so the same
outputs bit for bit as where the 8-bit tensor is made (here: where the graph also outputs it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from onnx import helper  # noqa: E402

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.qlinear_models import _init, within_a_step  # noqa: E402
from tests.backends.torch.test_qlinear_calls import _recorded  # noqa: E402
from tests.backends.torch.test_quantized_fusion import placed  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

def _conv(rng, name: str, x: str, y: str, zero: str, channels: int) -> tuple[list, list]:
    """A QLinearConv of int8 weights per channel (zero points 0), y's step 0.07."""
    w = rng.integers(-127, 128, (channels, channels, 3, 3)).astype(np.int8)
    inits = [_init(f"{name}_ws", rng.uniform(0.001, 0.002, channels)),
             _init(f"{name}_w", w, np.int8), _init(f"{name}_wz", np.zeros(channels), np.int8),
             _init(f"{name}_b", rng.integers(-300, 300, channels), np.int32)]
    x_scale = "s1" if zero == "z1" else "s2"
    node = helper.make_node("QLinearConv", [x, x_scale, zero, f"{name}_w", f"{name}_ws",
                                            f"{name}_wz", "s2", "z2", f"{name}_b"], [y],
                            pads=[1, 1, 1, 1])
    return [node], inits


def chain_model(also_output: bool = False, branches: int = 1, relu: bool = False) -> object:
    """x -> Q -> QLinearConv -> yq (uint8) -> ``branches`` QLinearConvs -> DQ -> sum of them;
    ``also_output``: yq a graph output too (then it must be made as uint8); ``relu``: yq ->
    DQ -> Relu -> Q on yq's step -> the QLinearConvs."""
    rng, channels = np.random.default_rng(2029), 4
    inits = [_init("s1", 0.05), _init("z1", 120, np.uint8), _init("s2", 0.07),
             _init("z2", 131, np.uint8)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z1"], ["xq"])]
    first, made = _conv(rng, "c0", "xq", "yq", "z1", channels)
    nodes, inits = nodes + first, inits + made
    if relu:
        nodes += [helper.make_node("DequantizeLinear", ["yq", "s2", "z2"], ["yd"]),
                  helper.make_node("Relu", ["yd"], ["yr"])]
        nodes += [helper.make_node("QuantizeLinear", ["yr", "s2", "z2"], [f"rq{k}"])
                  for k in range(branches)]
    outs = []
    for k in range(branches):
        conv, made = _conv(rng, f"c{k + 1}", f"rq{k}" if relu else "yq", f"zq{k}", "z2",
                           channels)
        nodes += [*conv, helper.make_node("DequantizeLinear", [f"zq{k}", "s2", "z2"], [f"d{k}"])]
        inits += made
        outs.append(f"d{k}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    outputs = [float_input("y", None)]
    if also_output:
        outputs.append(helper.make_tensor_value_info("yq", 2, None))
    return make_model(nodes, [float_input("x", [1, channels, 9, 7])], outputs, inits)


def _session(model, int8: str = "exact") -> InferenceSession:
    return InferenceSession(model, backends=[("CpuAcc", {"compile": "layers", "int8": int8}),
                                             "CpuRef"])


def _feed() -> dict[str, np.ndarray]:
    x = np.random.default_rng(29).standard_normal((1, 4, 9, 7)).astype(np.float32) * 4
    x.reshape(-1)[:3] = np.nan  # quantized to the zero point
    return {"x": x}


@pytest.mark.parametrize("relu", [False, True], ids=["8-bit", "dequantized-relu-quantized"])
@pytest.mark.parametrize("branches", [1, 2])
def test_layers_hand_on_float_integers_with_the_same_outputs(branches: int, relu: bool) -> None:
    feed = _feed()
    session = _session(chain_model(branches=branches, relu=relu))
    convs = [lay for lay in placed(session) if lay.op_type == "QLinearConv"]
    assert len(convs) == 1 + branches
    assert (convs[0].attrs["back"] is not None) == relu  # the writer took DQ and Relu
    assert convs[0].attrs.get("hands_centred") and all(
        c.attrs.get("takes_centred") for c in convs[1:])
    made = {dtype for _, dtypes in _recorded(session.run, None, feed) for dtype in dtypes}
    assert torch.uint8 not in made  # the input quantized, the layers' integers float32
    (got,) = session.run(None, feed)
    want, _ = _session(chain_model(True, branches, relu)).run(None, feed)
    np.testing.assert_array_equal(got, want)  # the same integers as through uint8
    (spec,) = InferenceSession(chain_model(False, branches, relu), backends=["CpuRef"]).run(None, feed)
    within_a_step(got, spec, 0.07 * branches)


def test_a_tensor_the_graph_outputs_stays_8_bit() -> None:
    feed = _feed()
    session = _session(chain_model(also_output=True))
    assert not any(lay.attrs.get("hands_centred") for lay in placed(session))
    _, yq = session.run(None, feed)
    _, want = InferenceSession(chain_model(also_output=True), backends=["CpuRef"]).run(None, feed)
    assert yq.dtype == np.uint8
    assert np.abs(yq.astype(int) - want).max() <= 1


def test_no_hand_on_where_the_int8_route_may_run() -> None:
    """``CpuAcc.int8`` "kernels": the int8 convolution reads and writes 8-bit tensors."""
    with pytest.warns(RuntimeWarning) if not _exact_kernels() else _nothing():
        session = _session(chain_model(), int8="kernels")
    assert not any(lay.attrs.get("hands_centred") or lay.attrs.get("takes_centred")
                   for lay in placed(session))


def _exact_kernels() -> bool:
    from backplane.backends.torch.fusion.int8_exact import exact_kernels

    return exact_kernels()


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("compile_mode", ["auto", "layers"])
def test_a_residual_sum_is_handed_to_both_readings_of_the_next_block(compile_mode: str) -> None:
    """ONNX Runtime's QOperator residual blocks (x -> QLinearConv -> QLinearAdd(x) -> s1 ->
    QLinearConv -> QLinearAdd(s1)): the first sum goes to the next layer's convolution and to
    its sum as float32 integers, with the outputs of the graph that also outputs s1."""
    import onnx

    from tests.backends.torch.test_contrib_quant import residual_blocks

    model, feeds = residual_blocks(split=False)
    backends = [("CpuAcc", {"compile": compile_mode, "int8": "exact"}), "CpuRef"]
    session = InferenceSession(model, backends=backends)
    first, second = [lay for lay in placed(session) if lay.op_type == "QLinearConv"]
    assert first.attrs.get("hands_centred") and not first.attrs.get("takes_centred")
    assert second.attrs.get("takes_centred") and second.attrs.get("takes_centred_other")
    (got,) = session.run(None, feeds)
    seen = onnx.ModelProto()
    seen.CopyFrom(model)
    seen.graph.output.append(onnx.helper.make_tensor_value_info("s1", onnx.TensorProto.UINT8, None))
    (want, _) = InferenceSession(seen, backends=backends).run(None, feeds)
    np.testing.assert_array_equal(got, want)
