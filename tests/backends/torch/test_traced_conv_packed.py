"""A Traced layer's convolutions (issue 27: crnn_paddle_ts12's CNN before its LSTMs,
bytes_int32_dyn20's 1-d ones) read weights packed once: oneDNN's convolution on the packed weight,
an input of the frozen graph (``prepacked.TraceInputs.conv_weight``, ``conv._scripted_conv``),
where torch's conv2d reordered the plain weight at every call."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import prepacked, threads  # noqa: E402
from backplane.backends.torch.fusion import conv, windowed  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_traced_packed import _traced  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(13)


def _weight(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.2).astype(np.float32), name)


def _cnn() -> tuple[onnx.ModelProto, list[int]]:
    """Conv 3x3 -> Relu -> Conv 3x3 stride 2, asymmetric pads -> depthwise Conv -> ReduceMax over
    the image (no op oneDNN Graph takes: a Traced layer)."""
    inits = [_weight("w1", 8, 4, 3, 3), _weight("b1", 8), _weight("w2", 8, 8, 3, 3),
             _weight("w3", 8, 1, 3, 3), _weight("b3", 8)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], strides=[2, 2], pads=[0, 1, 1, 0]),
             helper.make_node("Conv", ["c2", "w3", "b3"], ["c3"], group=8, pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMax", ["c3"], ["y"], axes=[2, 3], keepdims=0)]
    model = make_model(nodes, [float_input("x", [1, 4, 16, 16])], [float_input("y", None)], inits,
                       opset=13)
    return model, [1, 4, 16, 16]


def _gated_1d() -> tuple[onnx.ModelProto, list[int]]:
    """(1, L, C) -> Transpose -> Conv1d and Conv1d -> Sigmoid -> Mul -> ReduceMax: the byte
    classifier's gated convolution."""
    inits = [_weight("w1", 16, 8, 8), _weight("b1", 16), _weight("w2", 16, 8, 8),
             _weight("b2", 16)]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Conv", ["t", "w1", "b1"], ["a"], strides=[4]),
             helper.make_node("Conv", ["t", "w2", "b2"], ["g"], strides=[4]),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["a", "s"], ["m"]),
             helper.make_node("ReduceMax", ["m"], ["y"], axes=[2], keepdims=0)]
    model = make_model(nodes, [float_input("x", [1, 256, 8])], [float_input("y", None)], inits,
                       opset=13)
    return model, [1, 256, 8]


@pytest.mark.parametrize("make, convs", [(_cnn, 3), (_gated_1d, 2)])
def test_a_traced_convolution_reads_its_packed_weight(make, convs, monkeypatch) -> None:
    model, shape = make()
    monkeypatch.setattr(conv, "TRACED_PACKED_MACS", 0)  # these small ones packed too
    monkeypatch.setattr(windowed, "PRODUCT_MACS", -1)  # FusedConvs, not one WindowedConv (H-G)
    session, workload = _traced(model, monkeypatch)
    graph = workload.module.graph
    products = [n for n in graph.nodes() if n.kind() == "mkldnn::_convolution_pointwise"]
    assert len(products) == convs and "aten::_convolution" not in str(graph)
    assert all(p.inputsAt(1).node().kind() == "prim::Param" for p in products)  # not constants
    assert sum(w.is_mkldnn for w in workload.weights) == convs
    x = RNG.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[37] = np.nan  # the outputs whose windows read it NaN, through every layer
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_weight_is_packed_for_the_input_the_convolution_sees(monkeypatch) -> None:
    """Packed for the geometry of the call that reads it: the input as it comes where the
    convolution pads it itself (symmetric pads), the input padded here where it is not
    (asymmetric). A weight packed for another input size is reordered at every call
    (resnet_basic_dyn21_qop's 3x3 ones were packed for 58x58 and run on 56x56)."""
    seen = []
    make = prepacked.TraceInputs.conv_weight

    def spied(self, weight, padding, strides, dilations, groups, input_shape):
        seen.append((list(padding), list(input_shape)))
        return make(self, weight, padding, strides, dilations, groups, input_shape)
    monkeypatch.setattr(prepacked.TraceInputs, "conv_weight", spied)
    monkeypatch.setattr(conv, "TRACED_PACKED_MACS", 0)
    monkeypatch.setattr(windowed, "PRODUCT_MACS", -1)
    model, shape = _cnn()
    session, _ = _traced(model, monkeypatch)
    # Conv pads 1 on 16x16; Conv stride 2, pads (0, 1, 1, 0), padded here to 17x17; depthwise
    assert ([1, 1], [1, 4, 16, 16]) in seen and ([0, 0], [1, 8, 17, 17]) in seen \
        and ([1, 1], [1, 8, 8, 8]) in seen
    assert all(shape in ([1, 4, 16, 16], [1, 8, 17, 17], [1, 8, 8, 8]) for _, shape in seen)
    x = RNG.standard_normal(shape).astype(np.float32)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make, packed", [(_cnn, 1), (_gated_1d, 0)])
def test_a_small_traced_convolution_keeps_torchs_call(make, packed, monkeypatch) -> None:
    """Below ``conv.TRACED_PACKED_MACS`` a convolution of one group keeps torch's conv2d, which
    takes its own kernel there (oneDNN's call costs about 25 us against 7-16: audio_conv1d_dyn19
    ran 0.125 -> 0.229 ms a run packed); a grouped one (the depthwise) is packed whatever its size."""
    monkeypatch.setattr(windowed, "PRODUCT_MACS", -1)  # FusedConvs, not one WindowedConv (H-G)
    model, shape = make()
    session, workload = _traced(model, monkeypatch)
    graph = workload.module.graph
    kinds = [n.kind() for n in graph.nodes()]
    assert kinds.count("mkldnn::_convolution_pointwise") == packed
    assert kinds.count("aten::_convolution") == {_cnn: 2, _gated_1d: 2}[make]
    x = RNG.standard_normal(shape).astype(np.float32)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_trace_inputs_pack_each_convolution_weight_once() -> None:
    inputs = prepacked.TraceInputs()
    w = torch.randn(8, 4, 3, 3)
    first = inputs.conv_weight(w, [1, 1], [1, 1], [1, 1], 1, [1, 4, 10, 10])
    assert first.is_mkldnn and inputs.packed == [first]
    assert inputs.conv_weight(w, [1, 1], [1, 1], [1, 1], 1, [1, 4, 10, 10]) is first
    x = torch.randn(1, 4, 10, 10).contiguous(memory_format=torch.channels_last)
    got = torch.ops.mkldnn._convolution_pointwise(x, first, None, [1, 1], [1, 1], [1, 1], 1,
                                                  "none", [], None)
    torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, None, 1, 1), rtol=1e-4,
                               atol=1e-5)


def test_a_traced_pointwise_convolution_is_one_product_of_its_pixels(monkeypatch) -> None:
    """A 1x1 convolution in a Traced layer is one addmm of its channels-last pixels by the
    weight's transposed view (``conv._pixel_product``), its ReLU done in the product's call
    (``_addmm_activation``): oneDNN's packed call cost 40-100 us a call beyond its kernel."""
    inits = [_weight("w1", 16, 4, 3, 3), _weight("b1", 16), _weight("w2", 24, 16, 1, 1),
             _weight("b2", 24)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("ReduceMax", ["r2"], ["y"], axes=[3], keepdims=0)]
    model = make_model(nodes, [float_input("x", [1, 4, 8, 12])], [float_input("y", None)], inits,
                       opset=13)
    monkeypatch.setattr(conv, "TRACED_PACKED_MACS", 0)  # both would be packed
    session, workload = _traced(model, monkeypatch)
    kinds = [n.kind() for n in workload.module.graph.nodes()]
    assert kinds.count("mkldnn::_convolution_pointwise") == 1  # the 3x3 one
    assert kinds.count("aten::_addmm_activation") == 1 and "aten::relu" in kinds
    x = RNG.standard_normal((1, 4, 8, 12)).astype(np.float32)
    x[0, 1, 3, 5], x[0, 2, 6, 1] = np.nan, -np.inf  # NaN and -Inf through both convolutions
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
