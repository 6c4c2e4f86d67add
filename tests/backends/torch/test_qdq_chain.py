"""Large QDQ convolutions chained in 8-bit integers on CpuAcc (``fusion/qdq_chain.py``, issue 29):
ONNX Runtime's static quantizer writes a MobileNet-like CNN in the QDQ format (a stem, a max
pool, an inverted residual block with a hard-swish, a residual 3x3 convolution, a Gemm head);
CpuAcc runs each large DequantizeLinear -> Conv -> QuantizeLinear as a QLinearConv reading the
integers the one before wrote, the residual sums and the max pool taken in, the hard-swish a
Lookup, and its outputs stay within one quantization step of ONNX Runtime's and CpuRef's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")
quantization = pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.int8_cpu import torch_int8_exact  # noqa: E402
from tests.models.test_ort_tools import RandomReader, ort_run  # noqa: E402

SHAPE = (1, 3, 128, 128)
EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


def mobile_cnn(path: Path) -> Path:
    """Stem 3 -> 16 (3x3 at 128x128, 7 M multiply-adds), MaxPool 2/2, expand 1x1 16 -> 64 at
    64x64 (4.2 M), hard-swish, depthwise 3x3 (2.4 M), project 1x1 64 -> 16 (4.2 M), the residual
    sum with the pool's output, 3x3 16 -> 16 (9.4 M) and its sum with that, GlobalAveragePool,
    Gemm: every convolution above ``qdq_chain.CHAIN_MACS``."""
    rng = np.random.default_rng(29)

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"w0": w(16, 3, 3, 3), "b0": w(16), "we": w(64, 16, 1, 1), "be": w(64),
               "wd": w(64, 1, 3, 3), "bd": w(64), "wp": w(16, 64, 1, 1, scale=0.1),
               "bp": w(16), "w3": w(16, 16, 3, 3, scale=0.1), "b3": w(16), "wg": w(10, 16),
               "bg": w(10)}
    node = helper.make_node
    nodes = [node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
             node("Relu", ["c0"], ["c0r"]),
             node("MaxPool", ["c0r"], ["r0"], kernel_shape=[2, 2], strides=[2, 2]),
             node("Conv", ["r0", "we", "be"], ["ce"]),
             node("HardSigmoid", ["ce"], ["he"], alpha=1 / 6, beta=0.5),
             node("Mul", ["ce", "he"], ["se"]),
             node("Conv", ["se", "wd", "bd"], ["cd"], pads=[1, 1, 1, 1], group=64),
             node("Relu", ["cd"], ["rd"]),
             node("Conv", ["rd", "wp", "bp"], ["cp"]),
             node("Add", ["cp", "r0"], ["sp"]),
             node("Conv", ["sp", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
             node("Add", ["c3", "sp"], ["s3"]),
             node("Relu", ["s3"], ["r3"]),
             node("GlobalAveragePool", ["r3"], ["gap"]),
             node("Flatten", ["gap"], ["flat"]),
             node("Gemm", ["flat", "wg", "bg"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "mobile_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SHAPE[0], 10])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                ir_version=8), str(path))
    return path


def quantized(tmp_path: Path, activations: str) -> Path:
    path = tmp_path / f"qdq_{activations}.onnx"
    quantization.quantize_static(mobile_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", SHAPE),
                                 quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                 activation_type=getattr(quantization.QuantType, activations),
                                 weight_type=quantization.QuantType.QInt8)
    return path


def output_step(path: Path) -> float:
    """The scale of the DequantizeLinear that makes the model's output."""
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (last,) = [n for n in model.graph.node if model.graph.output[0].name in n.output]
    return float(inits[last.input[1]])


def feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)}


def fused_layers(session: InferenceSession) -> list:
    """The session's layers and those its layers hold (a Traced or OneDnnGraph layer's)."""
    layers = []
    for lay in session.optimized.graph.layers:
        layers += [lay, *lay.attrs.get("layers", [])]
    return layers


@pytest.mark.parametrize("activations", ["QUInt8", "QInt8"])
def test_large_qdq_convolutions_pass_integers(activations: str, tmp_path: Path) -> None:
    path = quantized(tmp_path, activations)
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers",
                                                           "route_cache": False}), "CpuRef"])
    if torch_int8_exact():
        assert_chained_in_integers(session)
    else:  # they saturate (no VNNI): "auto" is "exact", no convolution chained
        ops = [lay.op_type for lay in fused_layers(session)]
        assert "QLinearConv" not in ops and ops.count("QuantDequant") >= 5, ops
    step = output_step(path)
    reference = InferenceSession(path, backends=["CpuRef"])
    for seed in range(2):
        got = session.run(None, feeds(seed))[0]
        assert float(np.max(np.abs(got - ort_run(path, feeds(seed))[0]))) <= step * 1.001
        assert float(np.max(np.abs(got - reference.run(None, feeds(seed))[0]))) <= step * 1.001


def assert_chained_in_integers(session: InferenceSession) -> None:
    graph = session.optimized.graph
    layers = fused_layers(session)
    convs = [lay for lay in layers if lay.op_type == "QLinearConv"]
    assert len(convs) == 5, [lay.op_type for lay in layers]
    made = {out: lay for lay in graph.layers for out in lay.outputs}  # layer by layer
    # all but the stem (which takes the model's QuantizeLinear) read 8-bit integers, made by
    # the convolution or the hard-swish's Lookup before
    assert convs[0].attrs["into"] is not None
    for conv in convs[1:]:
        assert graph.info(conv.inputs[0]).dtype in EIGHT_BIT, conv.name
        assert made[conv.inputs[0]].op_type in ("QLinearConv", "Lookup"), conv.name
    assert [lay.op_type for lay in layers].count("Lookup") == 1
    assert [c.attrs["residual"] is not None for c in convs] == [False, False, False, True, True]
    # the last sum's DequantizeLinear taken (a GlobalAveragePool reads it), the other's not
    assert [c.attrs["residual"].get("dequantized", False) for c in convs[3:]] == [False, True]
    assert [c.attrs["pool"] is not None for c in convs] == [True, False, False, False, False]
    # the residual block's input: its first convolution and its sum read the integers
    read = {name for lay in graph.layers for name in lay.inputs}
    assert not [lay.name for lay in graph.layers if lay.op_type == "DequantizeLinear"
                and not any(out in read for out in lay.outputs)]


def test_exact_keeps_the_round_trips(tmp_path: Path) -> None:
    """``CpuAcc.int8`` "exact": no convolution chained (its requantization is the kernel's)."""
    path = quantized(tmp_path, "QUInt8")
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers", "int8": "exact"}),
                                               "CpuRef"])
    ops = [lay.op_type for lay in fused_layers(session)]
    assert "QLinearConv" not in ops and ops.count("QuantDequant") >= 5, ops


def test_a_compiled_chain_drops_the_dequantizes_nothing_reads(tmp_path: Path) -> None:
    """Traced whole, the subgraph holds no DequantizeLinear whose output no layer reads either;
    its convolutions chained in integers exactly where torch's int8 kernels are exact."""
    path = quantized(tmp_path, "QUInt8")
    session = InferenceSession(path, backends=[("CpuAcc", {"route_cache": False,
                                                           "native": "off"}), "CpuRef"])
    (whole,) = [lay for lay in session.optimized.graph.layers if lay.attrs.get("layers")]
    inner = whole.attrs["layers"]
    read = {name for lay in inner for name in lay.inputs} | set(whole.outputs)
    unread = [lay.name for lay in inner if lay.op_type == "DequantizeLinear"
              and not any(out in read for out in lay.outputs)]
    assert not unread
    assert any(lay.op_type == "QLinearConv" for lay in inner) == torch_int8_exact()
    step = output_step(path)
    got = session.run(None, feeds(0))[0]
    assert float(np.max(np.abs(got - ort_run(path, feeds(0))[0]))) <= step * 1.001


def test_a_nan_quantizes_as_cpuref_does(tmp_path: Path) -> None:
    """A NaN in the float input quantizes to 0, as CpuRef's cast does, in the stem that takes
    the model's QuantizeLinear; the outputs stay CpuRef's within one step."""
    path = quantized(tmp_path, "QUInt8")
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers"}), "CpuRef"])
    x = feeds(3)
    x["x"][0, :, 10:20, 5:9] = np.nan
    got = session.run(None, x)[0]
    want = InferenceSession(path, backends=["CpuRef"]).run(None, x)[0]
    assert np.isfinite(want).all()
    assert float(np.max(np.abs(got - want))) <= output_step(path) * 1.001


@pytest.mark.parametrize("signed", [False, True])
def test_a_lookup_gathers_two_bytes_at_a_time(signed: bool) -> None:
    """``lookup``'s table of byte pairs gives the byte table's values, for an even and an odd
    number of elements (the odd one gathered byte by byte), channels-last and plain."""
    import torch

    from backplane.backends.torch.backend import FUSED_DOMAIN
    from backplane.backends.torch.fusion.lookup import lookup_workload
    from backplane.backends.torch.kernels.quantization import quantize_linear
    from backplane.ir.graph import Layer

    dtype, zero = (np.int8, -5) if signed else (np.uint8, 7)
    constants = {"s": np.array(0.37, np.float32), "z": np.array(zero, dtype)}
    quantize = Layer("q", "QuantizeLinear", ["x", "s", "z"], ["y"], {}, "", 13)
    lookup = Layer("q", "Lookup", ["x"], ["y"], {"layers": [quantize], "x": "x", "y": "y",
                                                 "signed": signed, "constants": constants},
                   FUSED_DOMAIN, 1)

    class Backend:
        @staticmethod
        def kernel_for(layer: Layer):
            return lambda x, s, z: quantize_linear(x.float() * 3 - 40, s, z)

    run = lookup_workload(lookup, Backend())
    torch_type = torch.int8 if signed else torch.uint8
    low = -128 if signed else 0
    x = torch.randint(low, low + 256, (2, 6, 5, 3), dtype=torch_type)
    cases = [x.contiguous(memory_format=torch.channels_last), x[:1, :1, :, :1].contiguous()]
    assert [case.numel() % 2 for case in cases] == [0, 1]
    for case in cases:
        (got,) = run(case)
        (want,) = quantize_linear(case.float() * 3 - 40, *(torch.from_numpy(constants[k])
                                                            for k in ("s", "z")))
        assert got.dtype == want.dtype and torch.equal(got, want)
