"""A QDQ CNN compiled whole by oneDNN Graph (issue 29, item 1): its QuantDequant layers, each
holding a FusedConv or a Linear, go into one OneDnnGraph with their round trips written as the
fuser takes them (``quantized.fusable``), and the results stay within one step of CpuRef's, NaN
and infinities in the input included."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_quantized_fusion import qdq_conv_model  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402


def _graph_layer(session: InferenceSession):
    (layer,) = [lay for lay in session.optimized.graph.layers
                if lay.op_type not in ("MemImport", "MemCopy")]
    return layer


def _workload(session: InferenceSession):
    loaded = session.runtime.network(session.network_id)
    (step,) = [s for s, lay in zip(loaded.steps, loaded.layers) if lay.op_type == "OneDnnGraph"]
    return step.workload


@pytest.mark.parametrize("activation", [None, "Relu", "Clip"])
def test_a_qdq_cnn_is_one_compiled_onednn_graph(activation: str | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from backplane.backends.torch.fusion import qdq_chain

    monkeypatch.setattr(qdq_chain, "CHAIN_MACS", 1 << 20)  # QuantDequant layers, not chained
    model, step = qdq_conv_model(activation, np.random.default_rng(3))
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "onednn_graph"})])
    layer = _graph_layer(session)
    assert layer.op_type == "OneDnnGraph", layer
    trips = [lay for lay in layer.attrs["layers"] if lay.op_type == "QuantDequant"]
    assert [lay.attrs["layers"][0].op_type for lay in trips if lay.attrs["layers"]] \
        == ["FusedConv", "Linear"]
    assert all(lay.attrs["fusable"] for lay in trips)
    # only the model input's round trip can meet a NaN: the others read finite values
    assert [lay.attrs["finite"] for lay in trips] == [False, True, True]
    assert _workload(session).route == "onednn_graph"
    reference = InferenceSession(model, backends=["CpuRef"])
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 4, 6, 6)).astype(np.float32)
        x[0, seed, 1, 2:4] = (np.nan, np.inf)
        x[0, 3, 5, seed] = -np.inf
        got = session.run(None, {"x": x})[0]
        want = reference.run(None, {"x": x})[0]
        assert not np.isnan(got).any()
        assert float(np.max(np.abs(got - want))) <= step * 1.001


def test_the_fusable_round_trip_computes_the_in_place_ones_values() -> None:
    """Traced (out of place) and run (in place): ties (rint: half to even), saturation at both
    ends, NaN (quantized to 0), infinities."""
    import torch

    from backplane.backends.torch.fusion.quantized import _fusable_round_trip, _round_trip

    scale = np.float32(0.05)
    for low, high, zero in ((0, 255, 131), (-128, 127, -3)):
        params = {"scale": np.array(scale), "zero": np.array(np.float32(zero)), "low": low,
                  "high": high}
        steps = np.arange(low - zero - 4, high - zero + 4, dtype=np.float64)
        ties = ((steps + 0.5) * np.float64(scale)).astype(np.float32)
        x = np.concatenate([ties, np.random.default_rng(0).normal(0, 5, 500).astype(np.float32),
                            np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)])
        want = _round_trip(params, params)(torch.from_numpy(x), False)
        fusable = _fusable_round_trip(params, params, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation
            traced = torch.jit.trace(lambda t: fusable(t, False), (torch.from_numpy(x),))
        assert "aten::round_" not in str(traced.graph)  # out of place, as the fuser takes it
        torch.testing.assert_close(traced(torch.from_numpy(x)), want, rtol=0, atol=0)
        torch.testing.assert_close(fusable(torch.from_numpy(x), False), want, rtol=0, atol=0)


def _qdq_hardswish_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, float]:
    """x -> Q -> DQ -> Conv -> Q -> DQ (c) -> HardSigmoid -> Q -> DQ (h) -> Mul(c, h) -> Q -> DQ
    -> Conv -> Q -> DQ: a QDQ MobileNet's hard-swish between two convolutions, as ONNX Runtime's
    quantizer writes it; and the last step."""
    from tests.backends.torch.test_quantized_fusion import _init

    node = helper.make_node
    inits = [_init("xs", 0.02), _init("xz", 131, np.uint8), _init("cs", 0.04), _init("cz", 90, np.uint8),
             _init("hs", 1 / 255), _init("hz", 0, np.uint8), _init("ms", 0.03), _init("mz", 20, np.uint8),
             _init("ys", 0.05), _init("yz", 128, np.uint8), _init("wz", np.zeros(8), np.int8)]
    nodes = [node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"])]
    for i, (inp, out, (channels, scale, zero)) in enumerate(
            (("xd", "c", (4, "cs", "cz")), ("md", "y", (8, "ys", "yz")))):
        inits += [_init(f"w{i}", rng.integers(-127, 128, (8, channels, 3, 3)), np.int8),
                  _init(f"ws{i}", rng.uniform(0.002, 0.01, 8)),
                  _init(f"b{i}", rng.standard_normal(8) * 0.1)]
        nodes += [node("DequantizeLinear", [f"w{i}", f"ws{i}", "wz"], [f"wd{i}"], axis=0),
                  node("Conv", [inp, f"wd{i}", f"b{i}"], [f"{out}f"], pads=[1, 1, 1, 1]),
                  node("QuantizeLinear", [f"{out}f", scale, zero], [f"{out}q"]),
                  node("DequantizeLinear", [f"{out}q", scale, zero], [out if out == "y" else "cd"])]
        if i == 0:
            nodes += [node("HardSigmoid", ["cd"], ["h"], alpha=1 / 6),
                      node("QuantizeLinear", ["h", "hs", "hz"], ["hq"]),
                      node("DequantizeLinear", ["hq", "hs", "hz"], ["hd"]),
                      node("Mul", ["cd", "hd"], ["m"]),
                      node("QuantizeLinear", ["m", "ms", "mz"], ["mq"]),
                      node("DequantizeLinear", ["mq", "ms", "mz"], ["md"])]
    model = make_model(nodes, [float_input("x", [1, 4, 6, 6])], [float_input("y", [1, 8, 6, 6])],
                       inits)
    return model, 0.05


def _compiled_hardswish(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, float, Any, Any]:
    """The QDQ hard-swish model, its step, a CpuAcc session compiling it with oneDNN Graph (its
    round trips QuantDequant layers, not chained) and that session's OneDnnGraph layer."""
    from backplane.backends.torch.fusion import qdq_chain

    monkeypatch.setattr(qdq_chain, "CHAIN_MACS", 1 << 20)
    model, step = _qdq_hardswish_model(np.random.default_rng(5))
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "onednn_graph",
                                                            "int8": "exact"})])
    layer = _graph_layer(session)
    assert layer.op_type == "OneDnnGraph", layer
    return model, step, session, layer


def test_a_qdq_hardswish_needs_no_nan_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round trips of a QDQ hard-swish's HardSigmoid and product read values that hold no
    NaN (a HardSigmoid of a round trip's result is finite, a product of finite values at most
    infinite): their NaN step, a pass outside the fuser's partitions, is left out; a NaN or an
    infinity in the model's input still gives CpuRef's values, within one step."""
    model, step, session, layer = _compiled_hardswish(monkeypatch)
    trips = [lay for lay in layer.attrs["layers"] if lay.op_type == "QuantDequant"]
    assert [lay.attrs["finite"] for lay in trips] == [False, True, True, True, True]
    within_a_step_with_specials(session, InferenceSession(model, backends=["CpuRef"]), step, 2)


def within_a_step_with_specials(session: InferenceSession, reference: InferenceSession,
                                step: float, scale: float) -> None:
    """``session`` gives ``reference``'s values within one quantization step (and no NaN: the
    round trips clip) on inputs of 1 x 4 x 6 x 6 holding NaN, +Inf and -Inf."""
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 4, 6, 6)).astype(np.float32) * scale
        x[0, seed, 1, 2:4] = (np.nan, np.inf)
        x[0, 3, 5, seed] = -np.inf
        got = session.run(None, {"x": x})[0]
        want = reference.run(None, {"x": x})[0]
        assert not np.isnan(got).any()
        assert float(np.max(np.abs(got - want))) <= step * 1.001


def test_a_qdq_hardswish_hard_sigmoid_is_in_the_fusers_partition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The HardSigmoid of a round trip's result (finite) is a ``FiniteHardSigmoid``: x * alpha +
    beta clamped, which oneDNN Graph's fuser takes into the partition of the round trips after
    it, where torch's hardsigmoid ran apart (a pass and a tensor of its own); CpuRef's formula,
    bit for bit outside a trace, and the model within one step of CpuRef."""
    import torch

    from backplane.backends.torch.fusion import quantized

    model, step, session, layer = _compiled_hardswish(monkeypatch)
    ops = [lay.op_type for lay in layer.attrs["layers"]]
    assert "HardSigmoid" not in ops and ops.count("FiniteHardSigmoid") == 1, ops
    (sigmoid,) = [lay for lay in layer.attrs["layers"] if lay.op_type == "FiniteHardSigmoid"]
    values = np.concatenate([np.linspace(-4, 4, 4001, dtype=np.float32),
                             np.array([-3.0, 3.0, 1e30, -1e30, np.inf, -np.inf], np.float32)])
    (got,) = quantized.finite_hard_sigmoid_workload(sigmoid, None)(torch.from_numpy(values))
    alpha = np.float32(sigmoid.attrs["alpha"])
    np.testing.assert_array_equal(got.numpy(), np.clip(values * alpha + np.float32(0.5), 0, 1))
    reference = InferenceSession(model, backends=["CpuRef"])
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 4, 6, 6)).astype(np.float32) * 2
        want = reference.run(None, {"x": x})[0]
        assert float(np.max(np.abs(session.run(None, {"x": x})[0] - want))) <= step * 1.001


def test_the_compile_check_samples_the_same_values_at_every_load() -> None:
    """The compile's check (``quantized.within_steps`` of a QDQ output) runs on a seeded sample
    (``onednn_graph.SAMPLE_SEED``), so it decides alike at every load: on random ones it refused
    the full tier's QDQ MobileNet about once in 10-30 loads (its far share 0.34-1.15% over seeds
    0-10, the limit 1%). The caller's torch random state is neither read nor moved."""
    import torch

    from backplane.backends.torch.fusion import onednn_graph
    from backplane.ir.graph import TensorInfo

    inputs = [TensorInfo((1, 3, 8, 8), np.dtype(np.float32)),
              TensorInfo((2, 5), np.dtype(np.float32))]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = onednn_graph._sample(inputs, [True, False])
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(7)
    second = onednn_graph._sample(inputs, [True, False])
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert first[0].is_contiguous(memory_format=torch.channels_last)
    assert float(first[1].std()) > 0.1  # random values, not a constant
