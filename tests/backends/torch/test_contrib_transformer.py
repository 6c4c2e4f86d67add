"""ONNX Runtime's transformer fusions on CpuAcc (``torch/kernels/contrib_transformer.py`` and
``contrib_attention.py``): each one node against CpuRef (finite inputs, then NaN and +-Inf ones:
the same positions NaN), every attention case of test_contrib_ops (Attention, QAttention,
MultiHeadAttention, GroupQueryAttention, RotaryEmbedding, EmbedLayerNormalization) against ONNX
Runtime and CpuRef, and an optimized BERT from ONNX Runtime's transformer optimizer wholly on
CpuAcc, against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession, OptimizerOptions  # noqa: E402
from tests.conftest import make_model  # noqa: E402

MS = "com.microsoft"
RNG = np.random.default_rng(7)
SHAPE = (2, 3, 8)


def _vec() -> np.ndarray:
    return RNG.standard_normal(SHAPE[-1]).astype(np.float32)


# op, domain, float inputs (name -> value: None for a data input of SHAPE), attributes, outputs
CASES = {
    "SkipLayerNormalization": (MS, {"input": None, "skip": None, "gamma": _vec(), "beta": _vec(),
                                    "bias": _vec()}, {"epsilon": 1e-5}, 4),
    "SkipSimplifiedLayerNormalization": (MS, {"input": None, "skip": None, "gamma": _vec()},
                                         {"epsilon": 1e-6}, 4),
    "SimplifiedLayerNormalization": ("", {"X": None, "scale": _vec()}, {"epsilon": 1e-6}, 2),
    "Gelu": (MS, {"X": None}, {}, 1),
    "BiasGelu": (MS, {"A": None, "B": _vec()}, {}, 1),
    "FastGelu": (MS, {"X": None, "bias": _vec()}, {}, 1),
    "QuickGelu": (MS, {"X": None}, {"alpha": 1.5}, 1),
    "BiasAdd": (MS, {"X": None, "bias": _vec(), "skip": None}, {}, 1),
}


def _model(op: str):
    domain, inputs, attrs, n_out = CASES[op]
    data = [n for n, v in inputs.items() if v is None]
    node = helper.make_node(op, list(inputs), [f"y{i}" for i in range(n_out)], domain=domain, **attrs)
    model = make_model([node], [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in data],
                       [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None)
                        for i in range(n_out)],
                       [helper.make_tensor(n, TensorProto.FLOAT, v.shape, v) for n, v in inputs.items()
                        if v is not None])
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model, data


BACKENDS = {"CpuAcc": [("CpuAcc", {"compile": "layers"})], "GpuAcc": ["GpuAcc"]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize("op", CASES)
def test_each_fusion_on_cpuacc_is_cpurefs(op: str, special: bool, backend: str) -> None:
    if backend == "GpuAcc" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, data = _model(op)
    feeds = {n: (RNG.standard_normal(SHAPE) * 2).astype(np.float32) for n in data}
    if special:
        feeds[data[0]].reshape(-1)[[0, 5, 9]] = [np.nan, np.inf, -np.inf]
    session = InferenceSession(model, backends=BACKENDS[backend])
    assert set(session.report.counts()) == {backend}
    got = session.run(None, feeds)
    for have, want in zip(got, InferenceSession(model, backends=["CpuRef"]).run(None, feeds)):
        np.testing.assert_array_equal(np.isnan(have), np.isnan(want))
        np.testing.assert_allclose(have, want, rtol=2e-5, atol=2e-6)


ATTENTION = ["EmbedLayerNormalization", "EmbedLayerNormalization-no-segment", "Attention",
             "Attention-raw-mask", "Attention-lengths", "Attention-3d-mask",
             "Attention-causal-past", "Attention-bias-scale", "Attention-qkv-sizes", "QAttention",
             "QAttention-per-column-causal-past", "MultiHeadAttention",
             "MultiHeadAttention-mask-past", "MultiHeadAttention-cross-cached", "RotaryEmbedding",
             "RotaryEmbedding-offset-interleaved", "RotaryEmbedding-partial",
             "GroupQueryAttention-prompt", "GroupQueryAttention-decode-rotary",
             "GroupQueryAttention-shared-buffer", "GroupQueryAttention-packed-window",
             "GroupQueryAttention-softcap", "GroupQueryAttention-head-sink",
             "GroupQueryAttention-smooth-softmax-scale"]
"""test_contrib_ops' cases of the ops kernels/contrib_attention.py (and EmbedLayerNormalization)
run on the torch backends."""
AS_IS = OptimizerOptions(fold_constants=False)
"""The optimizer's passes off: the kernels themselves (with them, Attention is written as plain ops
where it can be: tests/optimizer/test_ort_lowered.py)."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ATTENTION)
def test_attention_on_cpuacc_matches_onnx_runtime(name: str, backend: str) -> None:
    from tests.backends.contrib_cases import CASES as ORT_CASES
    from tests.backends.contrib_cases import _model as ort_model
    from tests.backends.contrib_cases import ORT_CRASHES, assert_matches_ort, ort_run

    if backend == "GpuAcc" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, feeds = ort_model(ORT_CASES[name])
    session = InferenceSession(model, backends=[*BACKENDS[backend], "CpuRef"],
                               optimizer_options=AS_IS)
    assert set(session.report.counts()) == {backend}
    if name not in ORT_CRASHES:  # else against CpuRef alone, below
        assert_matches_ort(session.run(None, feeds), ort_run(model, feeds))
    want = InferenceSession(model, backends=["CpuRef"], optimizer_options=AS_IS).run(None, feeds)
    for have, expected in zip(session.run(None, feeds), want):
        np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-5)


NAN_CASES = ["Attention-lengths", "Attention-causal-past", "MultiHeadAttention-mask-past",
             "RotaryEmbedding", "GroupQueryAttention-prompt", "GroupQueryAttention-softcap"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAN_CASES)
def test_attention_propagates_nan_as_cpuref(name: str, backend: str) -> None:
    """A NaN in one query token's input: the same outputs NaN as CpuRef's, the rest close."""
    from tests.backends.contrib_cases import CASES as ORT_CASES
    from tests.backends.contrib_cases import _model as ort_model

    if backend == "GpuAcc" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, feeds = ort_model(ORT_CASES[name])
    first = next(iter(feeds))
    feeds[first] = feeds[first].copy()
    feeds[first][0, 1, :2] = np.nan  # (B, S, d): the second token of the first sequence
    got = InferenceSession(model, backends=BACKENDS[backend], optimizer_options=AS_IS).run(None,
                                                                                           feeds)
    want = InferenceSession(model, backends=["CpuRef"], optimizer_options=AS_IS).run(None, feeds)
    assert np.isnan(want[0]).any()
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(np.isnan(have), np.isnan(expected))
        np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-5)


def test_attention_reads_no_sizes_in_a_trace() -> None:
    """The optimized BERT's Attention (a lengths mask) traced reads one size (the keys' count, for
    the mask's positions): each ``aten::size`` node, with its NumToTensor and Int, runs at every
    call; it was 16 such reads (of 175 nodes), the optimized model slower than the plain one
    (issue 29)."""
    from backplane.backends.torch.kernels.contrib_attention import attention

    x, weights, bias = torch.randn(1, 16, 32), torch.randn(32, 96), torch.randn(96)
    lengths = torch.tensor([12], dtype=torch.int32)
    traced = torch.jit.trace(lambda x, m: attention(x, weights, bias, m, num_heads=2)[0],
                             (x, lengths), check_trace=False)
    kinds = [node.kind() for node in traced.graph.nodes()]
    assert kinds.count("aten::size") <= 1 and "aten::scaled_dot_product_attention" in kinds
    torch.testing.assert_close(traced(x, torch.tensor([5], dtype=torch.int32)),
                               attention(x, weights, bias, torch.tensor([5], dtype=torch.int32),
                                         num_heads=2)[0])


def test_an_optimized_bert_runs_its_fusions_on_cpuacc(tmp_path) -> None:
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    from tests.models.test_models import DATA, assert_close, ort_outputs

    path = tmp_path / "opt.onnx"
    optimizer.optimize_model(str(DATA / "tiny_bert.onnx"), model_type="bert", num_heads=2,
                             hidden_size=32, opt_level=0).save_model_to_file(str(path))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    assert set(session.report.counts()) == {"CpuAcc"}  # Attention, the norms and GELUs too
    feeds = dict(np.load(DATA / "tiny_bert.npz"))
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
