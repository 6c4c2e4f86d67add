"""The one-node cases of ONNX Runtime's com.microsoft ops that test_contrib_ops.py holds CpuRef to
ONNX Runtime on (and the torch backends' contrib tests reuse): each op's quantized, transformer,
attention, rotary and grouped-query cases, how a case becomes a model, and how an output is held to
ONNX Runtime's (integers within one quantization step, floats within 1e-5 of the output's scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from backplane.frontends.onnx_contrib import CONTRIB_DOMAIN
from tests.ort_int8 import NO_VNNI, ort_int8_exact, ort_uint8_exact, with_uint8_weights

ort = pytest.importorskip("onnxruntime")

RNG_SEED = 29
MS = CONTRIB_DOMAIN


@dataclass
class Case:
    """A one-node model: inputs in order (None: absent), the first ``fed`` of them fed at run time,
    the rest initializers; outputs with their ONNX element types."""

    op: str
    inputs: list[np.ndarray | None]
    outputs: list[int]
    attrs: dict[str, Any] = field(default_factory=dict)
    fed: int = 1
    domain: str = MS


def _model(case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    names = [f"in{k}" if x is not None else "" for k, x in enumerate(case.inputs)]
    feeds = {n: x for n, x in zip(names[:case.fed], case.inputs[:case.fed]) if n}
    inits = [onnx.numpy_helper.from_array(x, n) for n, x in zip(names, case.inputs)
             if n and n not in feeds]
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype),
                                                  x.shape) for n, x in feeds.items()]
    outs = [f"out{k}" for k in range(len(case.outputs))]
    node = helper.make_node(case.op, names, outs, domain=case.domain, **case.attrs)
    graph = helper.make_graph([node], "one", graph_inputs,
                              [helper.make_tensor_value_info(n, t, None)
                               for n, t in zip(outs, case.outputs)], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8), feeds


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's outputs, of the model with its int8 weights moved to uint8 where its
    u8 x s8 products saturate (tests/ort_int8.py: the same exact integers, no VNNI here)."""
    if not ort_int8_exact():
        if not ort_uint8_exact():
            pytest.skip(NO_VNNI)
        feeds = dict(feeds)
        model = with_uint8_weights(model, feeds)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_matches_ort(actual: list[np.ndarray], expected: list[np.ndarray],
                       tolerance: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape,
                                                                     got.dtype, want.dtype)
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        if want.dtype.kind in "iu":  # one quantization step at most
            assert diff.max(initial=0) <= 1, diff.max()
        else:
            scale = max(float(np.max(np.abs(want), initial=0)), 1.0)
            assert diff.max(initial=0) / scale <= tolerance, diff.max()


# -- the cases ---------------------------------------------------------------------------------
rng = np.random.default_rng(RNG_SEED)
U8, I8, F32, I32 = onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.FLOAT, \
    onnx.TensorProto.INT32


def q(shape, dtype=np.uint8):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, size=shape, dtype=dtype)


def f(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def s(value):
    return np.array(value, np.float32)


def z(value, dtype=np.uint8):
    return np.array(value, dtype)


def _quantized() -> dict[str, Case]:
    cases = {}
    for dtype, zp, elem in ((np.uint8, 128, U8), (np.int8, 3, I8)):
        name = np.dtype(dtype).name
        binary = [q((2, 3, 4), dtype), s(0.05), z(zp - 2, dtype), q((3, 1), dtype), s(0.03),
                  z(zp + 1, dtype), s(0.07), z(zp, dtype)]
        cases[f"QLinearAdd-{name}"] = Case("QLinearAdd", binary, [elem], fed=4)
        cases[f"QLinearMul-{name}"] = Case("QLinearMul", binary, [elem], fed=4)
        unary = [q((2, 3, 5), dtype), s(0.06), z(zp, dtype), s(1 / 255), z(zp - 5, dtype)]
        cases[f"QLinearSigmoid-{name}"] = Case("QLinearSigmoid", unary, [elem])
        cases[f"QLinearLeakyRelu-{name}"] = Case("QLinearLeakyRelu", unary, [elem],
                                                 {"alpha": 0.1})
        cases[f"QLinearConcat-{name}"] = Case(
            "QLinearConcat", [s(0.05), z(zp, dtype), q((1, 2, 3), dtype), s(0.05), z(zp, dtype),
                              q((1, 4, 3), dtype), s(0.02), z(zp - 7, dtype)], [elem],
            {"axis": 1}, fed=0)
        cases[f"QLinearWhere-{name}"] = Case(
            "QLinearWhere", [rng.random((2, 3, 4)) > 0.5, q((2, 3, 4), dtype), s(0.05),
                             z(zp, dtype), q((3, 1), dtype), s(0.02), z(zp - 9, dtype), s(0.04),
                             z(zp + 4, dtype)], [elem], fed=2)
        pool = [q((2, 3, 6, 5), dtype), s(0.04), z(zp, dtype), s(0.03), z(zp + 2, dtype)]
        cases[f"QLinearGlobalAveragePool-{name}"] = Case("QLinearGlobalAveragePool", pool, [elem])
        cases[f"QLinearGlobalAveragePool-nhwc-{name}"] = Case(
            "QLinearGlobalAveragePool", pool, [elem], {"channels_last": 1})
        cases[f"QLinearAveragePool-{name}"] = Case(
            "QLinearAveragePool", pool, [elem],
            {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]})
        cases[f"QLinearAveragePool-include-pad-{name}"] = Case(
            "QLinearAveragePool", pool, [elem],
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1})
        soft = [q((2, 3, 7), dtype), s(0.1), z(zp, dtype), s(1 / 256),
                z(0 if dtype == np.uint8 else -128, dtype)]
        cases[f"QLinearSoftmax-13-{name}"] = Case("QLinearSoftmax", soft, [elem],
                                                  {"opset": 13, "axis": -1})
        cases[f"QLinearSoftmax-11-{name}"] = Case("QLinearSoftmax", soft, [elem],
                                                  {"opset": 11, "axis": 1})
        gemm = [q((4, 6), dtype), s(0.02), z(zp, dtype), q((5, 6), np.int8), f(5, scale=0.01) ** 2
                + 0.01, z(np.zeros(5), np.int8), rng.integers(-500, 500, (5,), dtype=np.int32)]
        cases[f"QGemm-float-{name}"] = Case("QGemm", gemm, [F32], {"transB": 1, "alpha": 1.5})
        cases[f"QGemm-quantized-{name}"] = Case("QGemm", [*gemm, s(0.5), z(zp, dtype)], [elem],
                                                {"transB": 1})
        cases[f"MatMulIntegerToFloat-{name}"] = Case(
            "MatMulIntegerToFloat", [q((2, 3, 6), dtype), q((6, 4), np.int8), s(0.03),
                                     f(4, scale=0.01) ** 2 + 0.01, z(zp, dtype),
                                     z([1, -2, 0, 3], np.int8), f(4)], [F32])
    cases["QGemm-transA-no-C"] = Case("QGemm", [q((6, 4)), s(0.02), z(120), q((6, 5)), s(0.01),
                                                z(130)], [F32], {"transA": 1})
    cases["DynamicQuantizeMatMul"] = Case(
        "DynamicQuantizeMatMul", [f(2, 3, 8), q((8, 5), np.int8), f(5, scale=0.01) ** 2 + 0.01,
                                  z(np.zeros(5), np.int8), f(5)], [F32])
    cases["DynamicQuantizeMatMul-uint8"] = Case(
        "DynamicQuantizeMatMul", [f(4, 8), q((8, 5)), s(0.02), z(127)], [F32])
    return cases


def _nbits(bits: int, k: int, n: int, block: int, zero_points: str) -> Case:
    blocks = -(-k // block)
    packed = q((n, blocks, block * bits // 8))
    scales = f(n, blocks, scale=0.05)
    inputs = [f(3, k), packed, scales.reshape(-1)]
    if zero_points == "packed":
        inputs.append(q((n, -(-blocks * bits // 8))))
    elif zero_points == "float":
        inputs.append(f(n, blocks, scale=2) + 2 ** (bits - 1))
    inputs += [None, f(n)] if zero_points != "none" else [None, None, f(n)]
    return Case("MatMulNBits", inputs, [F32], {"K": k, "N": n, "bits": bits, "block_size": block})


def _lstm(dirs: int, per_channel: bool, dtype: type, **attrs: Any) -> Case:
    hidden, size = 8, 6
    zero = 128 if dtype == np.uint8 else 0
    scales = [f(dirs, 4 * hidden, scale=0.1) ** 2 + 0.01 if per_channel
              else np.full(dirs, scale, np.float32) for scale in (0.02, 0.03)]
    quantized = [(q((dirs, rows, 4 * hidden), dtype), np.full(scale.shape, zero, dtype), scale)
                 for rows, scale in zip((size, hidden), scales)]
    (w, w_zero, w_scale), (r, r_zero, r_scale) = quantized
    direction = "bidirectional" if dirs == 2 else attrs.pop("direction", "forward")
    return Case("DynamicQuantizeLSTM",
                [f(5, 2, size), w, r, f(dirs, 8 * hidden), None, f(dirs, 2, hidden),
                 f(dirs, 2, hidden), attrs.pop("P", None), w_scale, w_zero, r_scale, r_zero],
                [F32, F32, F32], {"hidden_size": hidden, "direction": direction, **attrs})


def _gather_block(dtype: Any, bits: int = 4, zero_points: bool = True,
                  indices: list[list[int]] | None = None, **attrs: Any) -> Case:
    rows, cols, block = 12, 32, 16
    packed = dtype == np.uint8 and bits < 8
    if packed:
        data, zero = q((rows, cols * bits // 8)), q((rows, cols // block * bits // 8))
    else:
        info = ml_dtypes.iinfo(dtype)
        data = rng.integers(info.min, info.max + 1, (rows, cols)).astype(dtype)
        zero = rng.integers(info.min, info.max + 1, (rows, cols // block)).astype(dtype)
    chosen = np.array(indices or [[0, 11, -1], [5, 3, -12]], np.int64)
    return Case("GatherBlockQuantized", [data, chosen, f(rows, cols // block, scale=0.1),
                                         zero if zero_points else None], [F32],
                {"block_size": block, "bits": bits, **attrs}, fed=0)


def _lstm_with_lengths() -> Case:
    case = _lstm(1, False, np.int8)
    case.inputs[4] = np.array([5, 3], np.int32)
    return case


QUANT_CASES = {**_quantized(),
               "GatherBlockQuantized-uint4": _gather_block(ml_dtypes.uint4),
               "GatherBlockQuantized-int4-no-zero": _gather_block(ml_dtypes.int4,
                                                                  zero_points=False),
               "GatherBlockQuantized-uint8-4bit": _gather_block(np.uint8, 4),
               "GatherBlockQuantized-out-of-range": _gather_block(  # zeros there
                   ml_dtypes.uint4, indices=[[0, 12, -13]]),
               "GatherBlockQuantized-uint8-8bit-no-zero": _gather_block(np.uint8, 8,
                                                                       zero_points=False),
               "DynamicQuantizeLSTM": _lstm(1, False, np.int8),
               "DynamicQuantizeLSTM-bidirectional-per-channel": _lstm(2, True, np.int8),
               "DynamicQuantizeLSTM-reverse-uint8-peepholes-clip": _lstm(
                   1, False, np.uint8, direction="reverse", P=f(1, 24), clip=0.8),
               "DynamicQuantizeLSTM-input-forget": _lstm(1, True, np.int8, input_forget=1),
               "MatMulNBits-4bit": _nbits(4, 64, 5, 32, "packed"),
               "MatMulNBits-4bit-ragged-K": _nbits(4, 40, 3, 16, "none"),
               "MatMulNBits-4bit-float-zero": _nbits(4, 32, 4, 16, "float"),
               "MatMulNBits-8bit": _nbits(8, 48, 4, 16, "packed"),
               "MatMulNBits-2bit": _nbits(2, 64, 4, 32, "packed")}


def _transformer() -> dict[str, Case]:
    x, skip, gamma, beta, bias = f(2, 5, 8), f(2, 5, 8), f(8), f(8), f(8)
    ids = rng.integers(0, 20, (2, 5)).astype(np.int32)
    segments = rng.integers(0, 2, (2, 5)).astype(np.int32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    cases = {
        "SkipLayerNormalization": Case("SkipLayerNormalization", [x, skip, gamma, beta, bias],
                                       [F32, F32, F32, F32], {"epsilon": 1e-5}, fed=2),
        "SkipLayerNormalization-no-bias": Case("SkipLayerNormalization", [x, f(5, 8), gamma],
                                               [F32], fed=2),
        "SkipSimplifiedLayerNormalization": Case(
            "SkipSimplifiedLayerNormalization", [x, skip, gamma, bias], [F32, F32, F32, F32],
            {"epsilon": 1e-6}, fed=2),
        "SimplifiedLayerNormalization": Case("SimplifiedLayerNormalization", [x, gamma],
                                             [F32], {"epsilon": 1e-6}, domain=""),
        "EmbedLayerNormalization": Case(
            "EmbedLayerNormalization", [ids, segments, f(20, 8), f(5, 8), f(2, 8), gamma, beta,
                                        mask], [F32, I32, F32], {"epsilon": 1e-5}, fed=2),
        "EmbedLayerNormalization-no-segment": Case(
            "EmbedLayerNormalization", [ids, None, f(20, 8), f(9, 8), None, gamma, beta],
            [F32, I32], fed=1),
        "Gelu": Case("Gelu", [f(3, 7, scale=3)], [F32]),
        "BiasGelu": Case("BiasGelu", [f(3, 7, scale=3), f(7)], [F32]),
        "FastGelu": Case("FastGelu", [f(3, 7, scale=3), f(7)], [F32]),
        "FastGelu-no-bias": Case("FastGelu", [f(3, 7, scale=3)], [F32]),
        "QuickGelu": Case("QuickGelu", [f(3, 7, scale=3)], [F32], {"alpha": 1.5}),
        "FusedMatMul": Case("FusedMatMul", [f(2, 4, 3), f(2, 5, 4)], [F32],
                            {"transA": 1, "transB": 1, "alpha": 0.5}, fed=2),
        "FusedMatMul-broadcast": Case("FusedMatMul", [f(3, 2, 4, 6), f(6, 5)], [F32],
                                      {"alpha": 2.0}, fed=2),
    }
    for activation, params in (("Relu", None), ("LeakyRelu", [0.2]), ("Clip", [-0.5, 0.7]),
                               ("HardSigmoid", [0.3, 0.4]), ("Sigmoid", None), ("Tanh", None)):
        attrs = {"activation": activation, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
        if params:
            attrs["activation_params"] = params
        cases[f"FusedConv-{activation}"] = Case("FusedConv", [f(1, 3, 6, 6), f(4, 3, 3, 3),
                                                              f(4)], [F32], attrs)
    for activation, attrs in (("Relu", {}), ("LeakyRelu", {"activation_alpha": 0.3}),
                              ("HardSigmoid", {"activation_alpha": 0.3, "activation_beta": 0.6})):
        cases[f"FusedGemm-{activation}"] = Case(
            "FusedGemm", [f(4, 6), f(5, 6), f(5)], [F32],
            {"activation": activation, "transB": 1, "alpha": 0.7, "beta": 1.3, **attrs})
    cases["FusedConv-residual"] = Case("FusedConv", [f(1, 2, 5, 5), f(4, 2, 1, 1), f(4),
                                                     f(1, 4, 5, 5)], [F32],
                                       {"activation": "Relu"}, fed=1)
    return cases


def _attention() -> dict[str, Case]:
    hidden, heads = 8, 2
    x, w, b = f(2, 5, hidden), f(hidden, 3 * hidden, scale=0.5), f(3 * hidden)
    raw = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], np.int32)
    attrs = {"num_heads": heads}
    return {
        "Attention": Case("Attention", [x, w, b], [F32, F32], attrs),
        "Attention-raw-mask": Case("Attention", [x, w, b, raw], [F32], attrs),
        "Attention-lengths": Case("Attention", [x, w, b, np.array([3, 5], np.int32)], [F32],
                                  attrs),
        "Attention-3d-mask": Case("Attention", [x, w, b, rng.integers(0, 2, (2, 5, 5)).astype(
            np.int32)], [F32], attrs),
        "Attention-causal-past": Case(
            "Attention", [x, w, b, None, f(2, 2, heads, 3, hidden // heads)], [F32, F32],
            {**attrs, "unidirectional": 1}),
        "Attention-bias-scale": Case("Attention", [x, w, None, None, None, f(1, heads, 5, 5)],
                                     [F32], {**attrs, "scale": 0.3}),
        "Attention-qkv-sizes": Case("Attention", [x, f(hidden, 20), f(20)], [F32],
                                    {**attrs, "qkv_hidden_sizes": [6, 6, 8]}),
        "QAttention": Case("QAttention", [q((2, 5, hidden)), q((hidden, 3 * hidden), np.int8),
                                          b, s(0.02), s(0.01), raw, z(120), z(3, np.int8)],
                           [F32], attrs),
        "QAttention-per-column-causal-past": Case(
            "QAttention", [q((2, 5, hidden)), q((hidden, 3 * hidden), np.int8), b, s(0.02),
                           f(3 * hidden, scale=0.01) ** 2 + 0.005, np.array([3, 5], np.int32),
                           z(128), z(np.zeros(3 * hidden), np.int8),
                           f(2, 2, heads, 3, hidden // heads)], [F32, F32],
            {**attrs, "unidirectional": 1}),
        "MultiHeadAttention": Case("MultiHeadAttention", [f(2, 5, hidden), f(2, 7, hidden),
                                                          f(2, 7, hidden), f(3 * hidden)],
                                   [F32], attrs, fed=3),
        "MultiHeadAttention-mask-past": Case(
            "MultiHeadAttention", [f(2, 3, hidden), f(2, 3, hidden), f(2, 3, hidden), None,
                                   np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.int32), None,
                                   f(2, heads, 2, 4), f(2, heads, 2, 4)],
            [F32, F32, F32], {**attrs, "unidirectional": 1}, fed=3),
        "MultiHeadAttention-cross-cached": Case(
            "MultiHeadAttention", [f(2, 3, hidden), f(2, heads, 6, 4), f(2, heads, 6, 4)],
            [F32], attrs, fed=3),
    }


def _rotary() -> dict[str, Case]:
    cos, sin = f(16, 4), f(16, 4)
    return {
        "RotaryEmbedding": Case("RotaryEmbedding", [f(2, 5, 16), rng.integers(0, 16, (2, 5)),
                                                    cos, sin], [F32], {"num_heads": 2}, fed=2),
        "RotaryEmbedding-offset-interleaved": Case(
            "RotaryEmbedding", [f(2, 2, 5, 8), np.array([3], np.int64), cos, sin], [F32],
            {"interleaved": 1}, fed=2),
        "RotaryEmbedding-partial": Case(
            "RotaryEmbedding", [f(1, 5, 24), np.array([0], np.int64), cos, sin], [F32],
            {"num_heads": 2, "rotary_embedding_dim": 8}, fed=2),
    }


def _gqa() -> dict[str, Case]:
    heads, kv_heads, head = 4, 2, 16  # ONNX Runtime's rotary takes head sizes in multiples of 16
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads}
    cos, sin = f(16, head // 2), f(16, head // 2)

    def lengths(*seqlens: int) -> list[np.ndarray]:  # seqlens_k (one less than each total)
        return [np.array(seqlens, np.int32), np.array(max(seqlens) + 1, np.int32)]

    def qkv(seq: int) -> list[np.ndarray]:
        return [f(2, seq, heads * head), f(2, seq, kv_heads * head), f(2, seq, kv_heads * head)]

    def cache(length: int) -> list[np.ndarray]:
        return [f(2, kv_heads, length, head), f(2, kv_heads, length, head)]

    return {
        "GroupQueryAttention-prompt": Case("GroupQueryAttention", [*qkv(5), None, None,
                                                                   *lengths(4, 4)],
                                           [F32, F32, F32], attrs, fed=3),
        "GroupQueryAttention-decode-rotary": Case(
            "GroupQueryAttention", [*qkv(1), *cache(6), *lengths(6, 6), cos, sin],
            [F32, F32, F32], {**attrs, "do_rotary": 1}, fed=5),
        "GroupQueryAttention-shared-buffer": Case(
            "GroupQueryAttention", [*qkv(1), *cache(10), *lengths(5, 5), cos, sin],
            [F32, F32, F32], {**attrs, "do_rotary": 1, "rotary_interleaved": 1}, fed=5),
        "GroupQueryAttention-packed-window": Case(
            "GroupQueryAttention", [f(2, 6, (heads + 2 * kv_heads) * head), None, None, None,
                                    None, *lengths(5, 5)], [F32, F32, F32],
            {**attrs, "local_window_size": 2}, fed=1),
        "GroupQueryAttention-softcap": Case(
            "GroupQueryAttention", [*qkv(4), None, None, *lengths(3, 3)], [F32, F32, F32],
            {**attrs, "softcap": 2.0}, fed=3),
        "GroupQueryAttention-head-sink": Case(
            "GroupQueryAttention", [*qkv(3), None, None, *lengths(2, 2), None, None, None, None,
                                    f(heads)], [F32, F32, F32], attrs, fed=3),
        "GroupQueryAttention-smooth-softmax-scale": Case(
            "GroupQueryAttention", [*qkv(1), *cache(2), *lengths(2, 2)], [F32, F32, F32],
            {**attrs, "smooth_softmax": 1, "scale": 0.2}, fed=5),
    }


CASES = {**QUANT_CASES, **_transformer(), **_attention(), **_rotary(), **_gqa()}
OLD_ORT = tuple(int(part) for part in ort.__version__.split(".")[:2]) < (1, 32)
"""ONNX Runtime before 1.32 (1.30 on the GPU machine): its contrib kernels differ on a few cases."""
ORT_CRASHES = {"Attention-bias-scale"} if OLD_ORT else set()
"""Cases whose ONNX Runtime kernel kills its process: 1.30's Attention with an attention_bias
(a segmentation fault in its CPU provider's run); 1.32 runs them."""
ORT_REFUSES = {"GatherBlockQuantized-out-of-range"} if OLD_ORT else set()
"""Cases ONNX Runtime 1.30 refuses ('indices element out of data bounds'; 1.32 gives zeros, as
the documentation and CpuRef)."""


def skip_where_ort_crashes(name: str) -> None:
    if name in ORT_CRASHES or name in ORT_REFUSES:
        pytest.skip(f"ONNX Runtime {ort.__version__} crashes on or refuses {name}")
