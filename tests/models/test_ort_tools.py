"""Models made at test time by ONNX Runtime's own tools (its quantizer: dynamic, static QOperator
and QDQ, per tensor and per channel; its transformer optimizer; its 4-bit / 8-bit weight
quantizer; its saved optimized models) load and match ONNX Runtime, graph optimizations off, on
CpuRef, on CpuAcc with CpuRef behind it and, where CUDA is, on GpuAcc with CpuRef behind it (the
com.microsoft ops the first backend has kernels for run there, the others fall back to CpuRef layer
by layer). The fused-op sets ONNX Runtime 1.32's transformer optimizer writes are asserted on 1.32
and later only (``FUSES_ATTENTION``)."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from tests.ort_int8 import NO_VNNI, ort_int8_exact, ort_uint8_exact, with_uint8_weights

ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")

DATA = Path(__file__).resolve().parent.parent / "data"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


TOLERANCE = 1e-5  # max |diff| relative to the output's max |value|
BACKEND_LISTS = {"cpuref": ["CpuRef"], "cpuacc+cpuref": ["CpuAcc", "CpuRef"],
                 # issue 29's done-when: GpuAcc, CpuRef on the GPU machine (skipped without CUDA)
                 "gpuacc+cpuref": pytest.param(["GpuAcc", "CpuRef"], marks=pytest.mark.skipif(
                     not _cuda(), reason="no CUDA device"))}
FUSES_ATTENTION = tuple(int(part) for part in ort.__version__.split(".")[:2]) >= (1, 32)
"""Whether ONNX Runtime's transformer optimizer writes Attention for tiny_bert (1.32 does; 1.30,
the GPU machine's, leaves its attention unfused): the fused-op sets are asserted only there."""
QOPERATOR_OPS = {"QLinearLeakyRelu", "QLinearSigmoid", "QLinearMul", "QLinearConcat",
                 "QLinearAveragePool", "QLinearAdd", "QLinearGlobalAveragePool", "QGemm",
                 "QLinearSoftmax"}


def contrib_ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node if n.domain == "com.microsoft"}


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's outputs; where its u8 x s8 products saturate (no VNNI), of the model with
    its int8 weights moved to uint8 (tests/ort_int8.py: the same integers, multiplied exactly)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    model: str | bytes = str(path)
    if not ort_int8_exact():
        if not ort_uint8_exact():
            pytest.skip(NO_VNNI)
        feeds = dict(feeds)
        model = with_uint8_weights(onnx.load(str(path)), feeds).SerializeToString()
    return ort.InferenceSession(model, options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_matches_ort(path: Path, feeds: dict[str, np.ndarray], backends: list[str],
                       steps: dict[str, float] | None = None) -> None:
    """``steps``: per output, a difference of one quantization step allowed (``output_steps``)."""
    if "CpuAcc" in backends:
        pytest.importorskip("torch")
    session = InferenceSession(path, backends=backends)
    expected = ort_run(path, feeds)
    actual = session.run(None, feeds)
    assert len(actual) == len(expected)
    names = [o.name for o in session.get_outputs()]
    for name, got, want in zip(names, actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        scale = max(float(np.max(np.abs(want))), 1e-12)
        step = (steps or {}).get(name, 0.0) * (1 + 1e-6)
        assert float(np.max(np.abs(got.astype(np.float64) - want))) <= max(TOLERANCE * scale, step)
    if "CpuAcc" in backends:  # the com.microsoft layers CpuAcc has kernels for ran on CpuAcc
        from backplane.backends.torch.kernels import KERNELS
        from backplane.optimizer.ort_lowered import LOWERED

        contrib = contrib_ops(path)
        placed = session.report.layers.values()
        ran = {(p.op_type, p.backend) for p in placed if p.op_type in contrib}
        assert ran <= {(op, "CpuAcc" if f"com.microsoft::{op}" in KERNELS else "CpuRef")
                       for op in contrib}
        assert contrib - {op for op, _ in ran} <= LOWERED  # the others ran as the plain ops
        assert "CpuAcc" in session.report.counts()


# -- the models --------------------------------------------------------------------------------
def small_cnn(path: Path) -> Path:
    """Conv, LeakyRelu, Sigmoid, Mul, Concat, AveragePool, a residual Add, GlobalAveragePool,
    Gemm, Softmax: every op ONNX Runtime's static quantizer turns into a com.microsoft one."""
    rng = np.random.default_rng(29)

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"w1": w(8, 3, 3, 3), "b1": w(8), "w2": w(8, 8, 3, 3, scale=0.15), "b2": w(8),
               "w3": w(16, 16, 1, 1, scale=0.2), "b3": w(16), "wg": w(10, 16), "bg": w(10)}
    node = helper.make_node
    nodes = [node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             node("LeakyRelu", ["c1"], ["l1"], alpha=0.1),
             node("Conv", ["l1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             node("Sigmoid", ["c2"], ["s2"]),
             node("Mul", ["s2", "l1"], ["m2"]),
             node("Concat", ["m2", "l1"], ["cat"], axis=1),
             node("AveragePool", ["cat"], ["ap"], kernel_shape=[2, 2], strides=[2, 2]),
             node("Conv", ["ap", "w3", "b3"], ["c3"]),
             node("Add", ["c3", "ap"], ["res"]),
             node("GlobalAveragePool", ["res"], ["gap"]),
             node("Flatten", ["gap"], ["flat"]),
             node("Gemm", ["flat", "wg", "bg"], ["logits"], transB=1),
             node("Softmax", ["logits"], ["probs"], axis=-1)]
    graph = helper.make_graph(
        nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                ir_version=8), str(path))  # ONNX Runtime 1.30 reads IR 13 at most
    return path


class RandomReader(quantization.CalibrationDataReader):
    """A few random samples for static quantization's calibration."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        rng = np.random.default_rng(0)
        self.samples = iter([{name: rng.standard_normal(shape).astype(np.float32)}
                             for _ in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.samples, None)


def ort_saved(source: Path, path: Path) -> Path:
    """The model as ONNX Runtime saves it after its extended graph optimizations (its fusions into
    com.microsoft ops; not the layout-specific level above)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return path


# -- static and dynamic quantization -----------------------------------------------------------
STATIC = {"qoperator-per-tensor": ("QOperator", False),
          "qoperator-per-channel": ("QOperator", True),
          "qdq-per-tensor": ("QDQ", False),
          "qdq-per-channel": ("QDQ", True)}


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("variant", STATIC)
def test_static_quantization_of_a_small_cnn(variant: str, backends: list[str], tmp_path) -> None:
    fmt, per_channel = STATIC[variant]
    path = tmp_path / "q.onnx"
    quantization.quantize_static(small_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", (1, 3, 16, 16)),
                                 quant_format=getattr(quantization.QuantFormat, fmt),
                                 per_channel=per_channel)
    assert contrib_ops(path) == (QOPERATOR_OPS if fmt == "QOperator" else set())
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    assert_matches_ort(path, feeds, backends, output_steps(path) if fmt == "QDQ" else None)


def output_steps(path: Path) -> dict[str, float]:
    """Each graph output's quantization step (the scale of the DequantizeLinear that makes it).

    A QDQ model computes in float between its QuantizeLinear/DequantizeLinear pairs, and its
    quantized tensors land on exact rounding ties (an AveragePool of four quantized values is a
    quarter-step multiple), where a float ulp decides the side: with every tensor of the
    per-channel small CNN made an output, CpuRef's, CpuAcc's and GpuAcc's quantized tensors each
    differ from ONNX Runtime's by 1-3 steps on 3-12% of their values (the H200 machine, and here),
    and the outputs' agreement to the bit is the draw's: GpuAcc's probabilities were one step
    (1/255) off ONNX Runtime's in one of ten on the GPU machine (cuDNN on and off alike). The
    integer-only QOperator form is held to the bit."""
    model = onnx.load(str(path))
    scales = {t.name: float(numpy_helper.to_array(t).max()) for t in model.graph.initializer}
    return {n.output[0]: scales[n.input[1]] for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input[1] in scales
            and n.output[0] in {o.name for o in model.graph.output}}


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
def test_static_qoperator_mobilenet(backends: list[str], tmp_path) -> None:
    path = tmp_path / "q.onnx"
    quantization.quantize_static(DATA / "tiny_mobilenet_v3.onnx", path,
                                 RandomReader("input", (1, 3, 64, 64)),
                                 quant_format=quantization.QuantFormat.QOperator,
                                 per_channel=True)
    assert contrib_ops(path) == {"QLinearAdd", "QLinearMul", "QGemm", "QLinearGlobalAveragePool"}
    assert_matches_ort(path, dict(np.load(DATA / "tiny_mobilenet_v3.npz")), backends)


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt2"])
def test_dynamic_quantization_saved_by_onnx_runtime(name: str, backends: list[str],
                                                    tmp_path) -> None:
    # quantize_dynamic writes standard ops (MatMulInteger); ORT's optimizer fuses them into
    # DynamicQuantizeMatMul and MatMulIntegerToFloat in the model it saves.
    quantized = tmp_path / "dq.onnx"
    quantization.quantize_dynamic(DATA / f"{name}.onnx", quantized)
    feeds = dict(np.load(DATA / f"{name}.npz"))
    assert_matches_ort(quantized, feeds, backends)
    saved = ort_saved(quantized, tmp_path / "saved.onnx")
    assert "DynamicQuantizeMatMul" in contrib_ops(saved)
    if name == "tiny_bert":
        assert "MatMulIntegerToFloat" in contrib_ops(saved)
    assert_matches_ort(saved, feeds, backends)


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_dynamic_quantization_of_an_lstm(per_channel: bool, backends: list[str],
                                         tmp_path) -> None:
    path = tmp_path / "dq.onnx"
    quantization.quantize_dynamic(DATA / "corpus" / "lstm_bi2_ts14.onnx", path,
                                  per_channel=per_channel)
    assert contrib_ops(path) == {"DynamicQuantizeLSTM"}
    assert_matches_ort(path, dict(np.load(DATA / "corpus" / "lstm_bi2_ts14.s0.npz")), backends)


# -- transformer optimizer and ORT's saved optimized models ------------------------------------
OPTIMIZER = {"tiny_bert": ("bert", {"Attention", "SkipLayerNormalization", "BiasGelu"}),
             "tiny_gpt2": ("gpt2", {"SkipLayerNormalization", "FastGelu"})}


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("name", OPTIMIZER)
def test_transformer_optimizer(name: str, backends: list[str], tmp_path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    model_type, expected_ops = OPTIMIZER[name]
    # num_heads and hidden_size: tests/data/README.md; opt_level 0: the fusions alone
    optimized = optimize_model(str(DATA / f"{name}.onnx"), model_type=model_type, num_heads=2,
                               hidden_size=32, opt_level=0)
    path = tmp_path / "opt.onnx"
    optimized.save_model_to_file(str(path))
    assert contrib_ops(path)  # something fused; every op it wrote loads and matches below
    if FUSES_ATTENTION or "Attention" not in expected_ops:
        assert contrib_ops(path) == expected_ops
    assert_matches_ort(path, dict(np.load(DATA / f"{name}.npz")), backends)


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
def test_dynamic_quantization_of_the_optimized_bert(backends: list[str], tmp_path) -> None:
    # The optimizer's Attention becomes QAttention (its projection quantized), the rest stays
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = tmp_path / "opt.onnx"
    optimize_model(str(DATA / "tiny_bert.onnx"), model_type="bert", num_heads=2, hidden_size=32,
                   opt_level=0).save_model_to_file(str(optimized))
    path = tmp_path / "dq.onnx"
    # the quantizer's shape inference cannot type the com.microsoft ops' outputs: they are float
    quantization.quantize_dynamic(optimized, path,
                                  extra_options={"DefaultTensorType": TensorProto.FLOAT})
    assert contrib_ops(path)  # every op written loads and matches below
    if FUSES_ATTENTION:
        assert contrib_ops(path) == {"QAttention", "SkipLayerNormalization", "BiasGelu"}
    assert_matches_ort(path, dict(np.load(DATA / "tiny_bert.npz")), backends)


SAVED = {"tiny_mobilenet_v3": {"FusedConv"},
         "tiny_bert": {"SkipLayerNormalization", "FusedMatMul", "FusedGemm", "Gelu"},
         "tiny_gpt2": {"SkipLayerNormalization", "FusedMatMul", "FastGelu"}}


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("name", SAVED)
def test_models_onnx_runtime_saves_optimized(name: str, backends: list[str], tmp_path) -> None:
    path = ort_saved(DATA / f"{name}.onnx", tmp_path / "saved.onnx")
    assert contrib_ops(path) == SAVED[name]
    assert_matches_ort(path, dict(np.load(DATA / f"{name}.npz")), backends)


# -- 4-bit and 8-bit weights -------------------------------------------------------------------
@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt2"])
def test_matmul_nbits_quantizer(name: str, bits: int, backends: list[str], tmp_path) -> None:
    pytest.importorskip("onnx_ir")  # the quantizer's own dependency
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(DATA / f"{name}.onnx")), block_size=16,
                                     is_symmetric=False, bits=bits)
    quantizer.process()
    path = tmp_path / "nbits.onnx"
    quantizer.model.save_model_to_file(str(path))
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["MatMulNBits"] >= 1
    assert_matches_ort(path, dict(np.load(DATA / f"{name}.npz")), backends)


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
def test_4bit_quantizer_with_embeddings(backends: list[str], tmp_path) -> None:
    pytest.importorskip("onnx_ir")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # the embedding tables quantized too: GatherBlockQuantized over uint4 blocks along axis 1
    quantizer = MatMulNBitsQuantizer(onnx.load(str(DATA / "tiny_gpt2.onnx")), block_size=16,
                                     bits=4, op_types_to_quantize=("MatMul", "Gather"),
                                     quant_axes=(("MatMul", 0), ("Gather", 1)))
    quantizer.process()
    path = tmp_path / "nbits.onnx"
    quantizer.model.save_model_to_file(str(path))
    assert contrib_ops(path) == {"MatMulNBits", "GatherBlockQuantized"}
    assert_matches_ort(path, dict(np.load(DATA / "tiny_gpt2.npz")), backends)
