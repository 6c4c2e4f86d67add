"""A QOperator CNN compiled whole by oneDNN Graph (issue 29): its fused QLinearConvs and
QLinearMatMul go into one OneDnnGraph with their centring and requantization written out of place
(``qlinear_traced``), a QuantizeLinear read by two convolutions writes their centred float32
integers (``QuantizeCentred``), and the outputs stay within one step of CpuRef's and ONNX
Runtime's, NaN and infinities in the input included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.qlinear_models import within_a_step  # noqa: E402
from tests.backends.torch.test_qdq_compiled import _graph_layer, _workload  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"


def _static_qlinear_resnet() -> onnx.ModelProto:
    """resnet_qlinear_ort15 (ONNX Runtime's static quantizer, QOperator) at 1x3x32x32: static
    shapes, so the whole model is one subgraph (not a Specialized one per shape)."""
    model = onnx.load(str(CORPUS / "resnet_qlinear_ort15.onnx"))
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 32, 32)):
        dim.ClearField("dim_param")
        dim.dim_value = size
    return model


def _steps(model: onnx.ModelProto) -> dict[str, float]:
    """Each output's step: the scale of the DequantizeLinear nearest before it."""
    scales = {t.name: float(onnx.numpy_helper.to_array(t)) for t in model.graph.initializer
              if t.dims == []}
    made = {out: node for node in model.graph.node for out in node.output}
    steps = {}
    for output in model.graph.output:
        node = made[output.name]
        while node.op_type != "DequantizeLinear":
            node = made[node.input[0]]
        steps[output.name] = scales[node.input[1]]
    return steps


def test_a_qoperator_resnet_is_one_compiled_onednn_graph() -> None:
    model = _static_qlinear_resnet()
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "onednn_graph",
                                                            "int8": "exact"})])
    layer = _graph_layer(session)
    assert layer.op_type == "OneDnnGraph", layer
    inner = layer.attrs["layers"]
    fused = [lay for lay in inner if lay.op_type in ("QLinearConv", "QLinearMatMul")]
    assert [lay.op_type for lay in fused] == ["QLinearConv"] * 6 + ["QLinearMatMul"]
    assert all(lay.attrs["fusable"] for lay in fused)
    # only the stem (the model input's QuantizeLinear taken) can meet a NaN
    assert [lay.attrs["finite"] for lay in fused] == [False] + [True] * 6
    (centred,) = [lay for lay in inner if lay.op_type == "QuantizeCentred"]
    readers = [lay for lay in fused if centred.outputs[0] in lay.inputs]
    assert len(readers) == 2 and all(lay.attrs["takes_centred"] for lay in readers)
    assert _workload(session).route == "onednn_graph"

    reference, steps = InferenceSession(model, backends=["CpuRef"]), _steps(model)
    names = [o.name for o in model.graph.output]
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        x[0, seed, 1, 2:4] = (np.nan, np.inf)
        x[0, 2, 5, seed] = -np.inf
        got = session.run(None, {"input": x})
        want = reference.run(None, {"input": x})
        for name, g, w in zip(names, got, want):
            assert not np.isnan(g).any()
            # features: an average of 2x2 dequantized values, a step's flip moves it a quarter
            within_a_step(g, w, steps[name])


def test_the_uncompiled_layers_give_the_compiled_ones_values() -> None:
    """The same model's layers one by one (CpuAcc.compile=layers: in place, the same float32
    operations) against the compiled subgraph, on the corpus's own inputs."""
    model = _static_qlinear_resnet()
    feeds = dict(np.load(CORPUS / "resnet_qlinear_ort15.s0.npz"))
    compiled = InferenceSession(model, backends=[("CpuAcc", {"compile": "onednn_graph",
                                                             "int8": "exact"})])
    layers = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers", "int8": "exact"})])
    steps = _steps(model)
    for name, g, w in zip([o.name for o in model.graph.output], compiled.run(None, feeds),
                          layers.run(None, feeds)):
        within_a_step(g, w, steps[name])


def test_the_traced_forms_compute_the_in_place_ones_values() -> None:
    """``qlinear_traced``'s centring and requantization (out of place) against the in-place ones:
    ties (rint: half to even), saturation at both ends, NaN (centred to -z), infinities."""
    import torch

    from backplane.backends.torch.fusion import qlinear_float

    for low, high, zero in ((0, 255, 131), (-128, 127, -3)):
        into = {"scale": np.array(np.float32(0.05)), "zero": np.array(np.float32(zero)),
                "low": low, "high": high}
        steps = np.arange(low - zero - 4, high - zero + 4, dtype=np.float64)
        ties = ((steps + 0.5) * 0.05).astype(np.float32)
        x = np.concatenate([ties, np.random.default_rng(0).normal(0, 5, 500).astype(np.float32),
                            np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)])
        a = {"into": into, "x_zero": float(zero), "takes_centred": False}
        eager = qlinear_float._centring(a)(torch.from_numpy(x.copy()))
        traced = torch.jit.trace(qlinear_float._centring({**a, "fusable": True, "finite": False}),
                                 torch.from_numpy(x.copy()))
        np.testing.assert_array_equal(traced(torch.from_numpy(x.copy())).numpy(), eager.numpy())
        back = {"scale": np.array(np.float32(0.25)), "zero": np.array(np.float32(zero))}
        f = {"y_zero": float(zero), "y_low": low, "y_high": high, "back": back, "add": None,
             "activation": None}
        acc = np.concatenate([ties * 20, x[:-5] * 40]).astype(np.float32)
        eager = qlinear_float._finisher(f)(torch.from_numpy(acc.copy()))
        traced = torch.jit.trace(qlinear_float._finisher({**f, "fusable": True}),
                                 torch.from_numpy(acc.copy()))
        np.testing.assert_array_equal(traced(torch.from_numpy(acc.copy())).numpy(), eager.numpy())
