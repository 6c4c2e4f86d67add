"""A small QLinearConv's int8 convolution inside a TorchScript trace (``fusion/int8_traced.py``,
issue 29): the trace holds ``quantized::conv2d`` with its packed weight as a constant, where the
tracer refused the packed weight and the layer kept its float route (about ten calls). Values:
the kernel's integers are CpuRef's (float64 requantization) on random cases, and the small
tier's QOperator ResNet matches ONNX Runtime within one step with its convolutions traced so."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
if "x86" not in torch.backends.quantized.supported_engines:
    pytest.skip("no x86 int8 kernels in this torch", allow_module_level=True)

from backplane import InferenceSession, SessionOptions  # noqa: E402
from backplane.backends.torch.fusion import int8_exact, int8_traced, onednn_graph  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"


def packed_case(seed: int, relu: bool = False):
    """A random per-channel int8 convolution of uint8 activations, the packed weight, a quint8
    input and what CpuRef computes: rint(acc * (s_x * s_w / s_y)) + z_y in float64, saturated."""
    rng = np.random.default_rng(seed)
    cin, cout, size = int(rng.integers(3, 33)), int(rng.integers(4, 33)), int(rng.integers(4, 17))
    k, stride = int(rng.choice([1, 3, 5])), int(rng.integers(1, 3))
    x = rng.integers(0, 256, (1, cin, size, size)).astype(np.uint8)
    w = rng.integers(-127, 128, (cout, cin, k, k)).astype(np.int8)
    x_scale, x_zero = np.float32(0.02), int(rng.integers(0, 256))
    w_scale = (rng.random(cout) * 0.01 + 0.001).astype(np.float32)
    y_scale, y_zero = np.float32(rng.random() * 0.5 + 0.3), int(rng.integers(0, 256))
    bias = rng.integers(-2000, 2000, cout).astype(np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(
            torch.from_numpy(w), torch.from_numpy(w_scale.astype(np.float64)),
            torch.zeros(cout, dtype=torch.long), 0)
        real_bias = torch.from_numpy((bias * x_scale * w_scale.astype(np.float64)).astype(
            np.float32))
        packed = int8_traced.prepack(weight, real_bias, [stride] * 2, [k // 2] * 2, [1, 1], 1)
        q = torch._make_per_tensor_quantized_tensor(torch.from_numpy(x), float(x_scale), x_zero)
    acc = torch.nn.functional.conv2d(torch.from_numpy(x.astype(np.float64) - x_zero),
                                     torch.from_numpy(w.astype(np.float64)),
                                     torch.from_numpy(bias.astype(np.float64)), stride, k // 2)
    acc = acc.clamp(min=0) if relu else acc
    multiplier = torch.from_numpy((x_scale * w_scale / y_scale).astype(np.float32)
                                  .astype(np.float64)).view(1, -1, 1, 1)
    want = torch.round(acc * multiplier).add(y_zero).clamp(0, 255).to(torch.uint8)
    return q.contiguous(memory_format=torch.channels_last), packed, float(y_scale), y_zero, want


@pytest.mark.parametrize("relu", [False, True])
def test_trace_holds_the_call(relu):
    """The frozen trace runs one quantized::conv2d[_relu] with the weight a constant, and gives
    the eager call's integers; torch.jit.trace of the op alone refuses the packed weight."""
    q, packed, scale, zero, _ = packed_case(3, relu)

    def run(x):
        return int8_traced.conv2d(x, packed, scale, zero, relu).int_repr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frozen = onednn_graph._freeze(onednn_graph._trace(run, [q], fusion=False), fusion=False)
        with pytest.raises(RuntimeError, match="not part of the active trace"):
            torch.jit.trace(lambda x: torch.ops.quantized.conv2d(x, packed, scale, zero), (q,))
    kinds = [node.kind() for node in frozen.graph.nodes()]
    name = "quantized::conv2d_relu" if relu else "quantized::conv2d"
    assert kinds.count(name) == 1, kinds
    assert torch.equal(frozen(q), run(q))


@pytest.mark.skipif(not int8_exact.exact_kernels(), reason="this CPU's int8 kernels saturate")
@pytest.mark.parametrize("seed", range(24))
def test_integers_are_cpuref(seed):
    """On random cases the kernel's requantized integers are CpuRef's (ONNX Runtime's too: both
    round the same products), at most one step off where a float32 rounding meets a half."""
    q, packed, scale, zero, want = packed_case(seed, relu=seed % 2 == 1)
    got = int8_traced.conv2d(q, packed, scale, zero, relu=seed % 2 == 1).int_repr()
    off = (got.int() - want.int()).abs()
    assert int(off.max()) <= 1 and int((off > 0).sum()) <= max(1, off.numel() // 1000)


def trace_graphs(monkeypatch) -> list:
    """The frozen graphs of the Traced layers a session builds from here on."""
    graphs: list = []
    freeze = onednn_graph._freeze

    def spy(module, fusion=True):
        frozen = freeze(module, fusion)
        graphs.append(frozen.graph)
        return frozen
    monkeypatch.setattr(onednn_graph, "_freeze", spy)
    return graphs


def output_steps(path: Path) -> list[float]:
    """The scale of the DequantizeLinear that makes each of the model's outputs (0: a float op
    after it makes the output, held to 1e-5 of its largest value as against ONNX Runtime)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    made = {out: node for node in model.graph.node for out in node.output}
    return [float(inits[made[out.name].input[1]])
            if made[out.name].op_type == "DequantizeLinear" else 0.0 for out in model.graph.output]


@pytest.mark.parametrize("size", [0, 1])
@pytest.mark.parametrize("model", ["resnet_qlinear_ort15", "resnet_qdq_ort17"])
def test_small_int8_resnets_traced_int8(monkeypatch, tmp_path, size, model):
    """The small tier's QOperator ResNet and its QDQ twin (six convolutions of 16-32 channels at
    4x4 to 32x32, below int8.KNOWN_MACS; the QDQ one chained in integers, qdq_chain, where it
    was a OneDnnGraph of float convolutions): each trace holds six int8 convolutions and no
    float one, and the outputs are ONNX Runtime's within one step (0 here: the same integers).
    Where torch's int8 kernels saturate (no VNNI; ONNX Runtime's too) "auto" traces none, and
    the outputs are CpuRef's within one step of each output's DequantizeLinear (output_steps)."""
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path / "routes"))
    monkeypatch.setenv("BACKPLANE_COMPILE_CACHE", str(tmp_path / "compiled"))
    graphs = trace_graphs(monkeypatch)
    path = CORPUS / f"{model}.onnx"
    feeds = dict(np.load(CORPUS / f"{model}.s{size}.npz"))
    options = SessionOptions()
    options.intra_op_num_threads = 1
    # torch's route pinned: the native int8 plan (native/qcnn.c) takes these where it is built
    session = InferenceSession(str(path), sess_options=options, providers=["CpuAcc", "CpuRef"],
                               provider_options=[{"CpuAcc.native": "off"}, {}])
    for _ in range(3):
        got = session.run(None, feeds)
    kinds = [node.kind() for graph in graphs for node in graph.nodes()]
    if not int8_exact.exact_kernels():
        assert "quantized::conv2d" not in kinds, sorted(set(kinds))
        want = InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds)
        for mine, theirs, step in zip(got, want, output_steps(path)):
            bound = max(step * 1.001, 1e-5 * float(np.abs(theirs).max()))
            assert float(np.max(np.abs(mine - theirs))) <= bound
        return
    assert kinds.count("quantized::conv2d") == 6, sorted(set(kinds))
    assert "aten::_convolution" not in kinds and "mkldnn::_convolution_pointwise" not in kinds
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for mine, theirs in zip(got, reference.run(None, feeds)):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5 * float(np.abs(theirs).max()))
