"""The float route of a fused QLinearConv in as few torch calls as its exactness allows
(fusion/qlinear.py): a trace (a QOperator model's subgraph) pays each call, about as much as a
small tensor's arithmetic. Its values stay CpuRef's bit for bit (test_quantized_fusion's
``test_qlinear_conv_is_one_layer_bit_for_bit`` holds the same models to CpuRef and ONNX Runtime);
here the calls are counted, and the values checked against the calls they replace."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import qlinear  # noqa: E402
from tests.backends.torch.test_quantized_fusion import placed, qlinear_conv_model  # noqa: E402


def _fused(quantized_io: bool) -> dict:
    model = qlinear_conv_model(quantized_io, 1, np.uint8)
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers"})])
    (layer,) = [lay for lay in placed(session) if lay.op_type == "QLinearConv"]
    return layer.attrs


def _calls(function, sample) -> list[str]:
    with torch.no_grad():
        graph = torch.jit.trace(function, (sample,)).graph
    return [node.kind() for node in graph.nodes() if node.kind().startswith("aten::")]


def test_the_requantization_widens_in_its_product_and_takes_the_relu_into_its_clamp() -> None:
    """rint(acc * multiplier) in float64 as one call (the multiplier a float64 tensor: type
    promotion widens acc), and the Relu after the DequantizeLinear the clamp's floor at 0: five
    calls where there were seven (acc.double(), the product, ..., torch's relu)."""
    a = _fused(quantized_io=True)
    assert a["activation"][0] == "relu"
    acc = torch.from_numpy(np.random.default_rng(3).integers(-4000, 4000, (1, 6, 9, 4))
                           .astype(np.float32))
    calls = _calls(qlinear._finisher(a), acc)
    assert "aten::relu" not in calls and calls.count("aten::to") == 1 and len(calls) == 5
    multiplier = torch.from_numpy(a["multiplier"].astype(np.float64))
    y = torch.round(acc.double() * multiplier).clamp_(a["y_low"] - a["y_zero"],
                                                       a["y_high"] - a["y_zero"])
    scale = float(a["back"]["scale"])
    expected = torch.relu((y * scale).float())
    np.testing.assert_array_equal(qlinear._finisher(a)(acc.clone()).numpy(), expected.numpy())


def test_an_integer_input_is_centred_in_one_call() -> None:
    a = _fused(quantized_io=False)
    x = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (1, 6, 7, 8)).astype(np.uint8))
    centre = qlinear._centring(a)
    assert _calls(centre, x) == ["aten::sub"]
    got = centre(x)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), x.numpy().astype(np.float32) - a["x_zero"])


def test_a_large_requantization_widens_apart() -> None:
    """From ``WIDEN_BELOW`` values the float32 sums are widened by their own call (a product of
    two types is TensorIterator's casting loop: the full tier's QOperator stem, (1, 64, 112, 112),
    1.4 -> 2.0 ms the other way); the values the same either way."""
    a = _fused(quantized_io=True)
    rng = np.random.default_rng(6)
    small = torch.from_numpy(rng.integers(-4000, 4000, (1, 6, 9, 4)).astype(np.float32))
    large = torch.from_numpy(rng.integers(-4000, 4000, (1, 6, 64, 64)).astype(np.float32))
    assert large.numel() >= qlinear.WIDEN_BELOW > small.numel()
    widened = qlinear._widening(a["multiplier"])
    assert _calls(widened, small) == ["aten::mul"]
    assert _calls(widened, large) == ["aten::to", "aten::mul_"]
    for acc in (small, large):
        got = widened(acc)
        assert got.dtype == torch.float64
        np.testing.assert_array_equal(
            got.numpy(), acc.double().numpy() * a["multiplier"].astype(np.float64))
