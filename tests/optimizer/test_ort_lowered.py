"""ONNX Runtime's SkipLayerNormalization, Attention, FusedGemm and FusedConv written back as the
plain ops they fused (optimizer/ort_lowered.py, with optimizer/ort_patterns.py's other undoings):
which are (and which are left as they are), with ONNX Runtime's values on CpuRef and CpuAcc, NaN
where CpuRef's own kernel gives it, and each file ONNX Runtime's tools write of the benchmark's
transformers traced on CpuAcc as the plain export is (issue 29: "the optimized BERT no slower
than the plain one")."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession, OptimizerOptions
from tests.backends.contrib_cases import CASES, F32, MS, Case, _model, assert_matches_ort, \
    ort_run, skip_where_ort_crashes

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).resolve().parent.parent / "data"
LOWERED_OPS = {"Attention", "SkipLayerNormalization", "FusedGemm", "FusedConv"}
AS_IS = OptimizerOptions(fold_constants=False)  # the optimizer's passes off: the ops as they are
RNG = np.random.default_rng(31)


def placed(session: InferenceSession) -> collections.Counter:
    return collections.Counter(p.op_type for p in session.report.layers.values())


def backends_of(name: str) -> list[str]:
    if name == "CpuAcc":
        pytest.importorskip("torch")
        return ["CpuAcc", "CpuRef"]
    return ["CpuRef"]


def extra_cases() -> dict[str, Case]:
    """Cases test_contrib_ops has not: a causal Attention without a past (its present unread),
    a SkipLayerNormalization writing its sum but not its statistics."""
    hidden, heads = 8, 2
    x, w, b = RNG.standard_normal((2, 5, hidden)), RNG.standard_normal((hidden, 3 * hidden)) / 2, \
        RNG.standard_normal(3 * hidden)
    x, w, b = (v.astype(np.float32) for v in (x, w, b))
    lengths = np.array([4, 2], np.int32)
    vec = [RNG.standard_normal(hidden).astype(np.float32) for _ in range(3)]
    return {
        "Attention-causal": Case("Attention", [x, w, b], [F32],
                                 {"num_heads": heads, "unidirectional": 1}),
        "Attention-causal-lengths": Case("Attention", [x, w, b, lengths], [F32],
                                         {"num_heads": heads, "unidirectional": 1,
                                          "mask_filter_value": -1e4}),
        "SkipLayerNormalization-sum": Case("SkipLayerNormalization",
                                           [x, x[::-1].copy(), *vec], [F32, F32, F32, F32],
                                           {"epsilon": 1e-5}, fed=2),
    }


ALL = {**CASES, **extra_cases()}
LOWERED = ["Attention-raw-mask", "Attention-lengths", "Attention-bias-scale",
           "Attention-qkv-sizes", "Attention-causal", "Attention-causal-lengths",
           "SkipLayerNormalization-no-bias", "SkipLayerNormalization-sum",
           *(name for name in CASES if name.startswith(("FusedGemm", "FusedConv")))]
PLAIN = {"Attention": "Softmax", "SkipLayerNormalization": "LayerNormalization",
         "FusedGemm": "Gemm", "FusedConv": "Conv"}
"""Each lowered op -> a plain op it becomes."""
KEPT = {"Attention": "its present is an output",
        "Attention-3d-mask": "a (B, S, T) mask",
        "Attention-causal-past": "a past",
        "SkipLayerNormalization": "its mean and inverse deviation are outputs"}


def case_model(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model, feeds = _model(ALL[name])
    if name == "SkipLayerNormalization-sum":  # outputs y and the sum; the statistics unnamed
        node = model.graph.node[0]
        node.output[1], node.output[2] = "", ""
        del model.graph.output[1:3]
    return model, feeds


@pytest.mark.parametrize("backend", ["CpuRef", "CpuAcc"])
@pytest.mark.parametrize("name", LOWERED)
def test_lowered_ops_give_onnx_runtimes_values(name: str, backend: str) -> None:
    skip_where_ort_crashes(name)
    model, feeds = case_model(name)
    session = InferenceSession(model, backends=backends_of(backend))
    ops = placed(session)
    assert ALL[name].op not in ops and ops[PLAIN[ALL[name].op]]
    assert set(session.report.counts()) == {backend}
    assert_matches_ort(session.run(None, feeds), ort_run(model, feeds))


@pytest.mark.parametrize("name", KEPT)
def test_other_forms_stay_as_they_are(name: str) -> None:
    model, feeds = case_model(name)
    session = InferenceSession(model, backends=["CpuRef"])
    assert placed(session)[ALL[name].op] == 1, KEPT[name]
    assert_matches_ort(session.run(None, feeds), ort_run(model, feeds))


def test_without_the_passes_the_op_is_kept() -> None:
    model, _ = case_model("Attention-lengths")
    assert placed(InferenceSession(model, backends=["CpuRef"], optimizer_options=AS_IS)) == \
        {"Attention": 1}


def test_a_free_batch_attention_is_lowered_and_runs_at_each_batch() -> None:
    """A raw (batch, 5) mask fed with the input, the batch free: one session, two batches."""
    weights = (RNG.standard_normal((8, 24)) / 2).astype(np.float32)
    node = helper.make_node("Attention", ["x", "w", "b", "mask"], ["y"], domain=MS, num_heads=2)
    graph = helper.make_graph(
        [node], "free", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, 8]),
                         helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weights, "w"),
         numpy_helper.from_array(RNG.standard_normal(24).astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)], ir_version=8)
    session = InferenceSession(model, backends=["CpuRef"])
    assert "Attention" not in placed(session)
    for batch in (1, 3):
        feeds = {"x": RNG.standard_normal((batch, 5, 8)).astype(np.float32),
                 "mask": (RNG.random((batch, 5)) > 0.3).astype(np.int32)}
        assert_matches_ort(session.run(None, feeds), ort_run(model, feeds))


@pytest.mark.parametrize("name", ["Attention-lengths", "Attention-causal"])
def test_a_nan_query_gives_nan_where_cprefs_own_kernel_does(name: str) -> None:
    """A NaN in one token's input on CpuAcc (the plain ops, one ScaledDotAttention) against
    CpuRef's Attention kernel: the same outputs NaN, the rest close."""
    pytest.importorskip("torch")
    model, feeds = case_model(name)
    feeds["in0"] = feeds["in0"].copy()
    feeds["in0"][0, 1, :2] = np.nan
    got = InferenceSession(model, backends=["CpuAcc", "CpuRef"]).run(None, feeds)
    want = InferenceSession(model, backends=["CpuRef"], optimizer_options=AS_IS).run(None, feeds)
    assert np.isnan(want[0]).any() and not np.isnan(want[0]).all()
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(np.isnan(have), np.isnan(expected))
        np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-5)


def fused_ops(path: Path, feeds: dict[str, np.ndarray]) -> tuple[InferenceSession,
                                                                  collections.Counter]:
    """A CpuAcc session of ``path`` traced whenever it can be, run once, and the layers of its
    traces (of each shape's build where it has free dimensions)."""
    from backplane.runtime.runtime import Runtime, RuntimeOptions

    options = RuntimeOptions(backend_options={"CpuAcc.compile": "onednn_graph"})
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], runtime=Runtime(options))
    session.run(None, feeds)
    network = session.runtime.network(session.network_id)
    graphs = [runner.graph for step in network.steps
              for runner in getattr(step.workload, "built", {}).values()]
    layers = [lay for graph in graphs for lay in graph.layers] or list(network.layers)
    return session, collections.Counter(inner.op_type for lay in layers
                                        for inner in lay.attrs.get("layers", [lay]))


def written(source: Path, how: str, path: Path) -> Path:
    """``source`` through ONNX Runtime's ``optimize_model`` ("opt") or as it saves it ("saved")."""
    from onnxruntime.transformers.optimizer import optimize_model

    from tests.models.test_ort_tools import ort_saved

    if how == "saved":
        return ort_saved(source, path)
    kind, heads, hidden = {"tiny_bert": ("bert", 2, 32), "tiny_gpt2": ("gpt2", 2, 32),
                           "encoder4_plain_dyn18": ("bert", 4, 64),
                           "gpt_causal_ts15": ("gpt2", 4, 32)}[source.stem]
    optimize_model(str(source), model_type=kind, num_heads=heads, hidden_size=hidden,
                   opt_level=0).save_model_to_file(str(path))
    return path


MODELS = {"tiny_bert": (DATA / "tiny_bert.onnx", DATA / "tiny_bert.npz"),
          "tiny_gpt2": (DATA / "tiny_gpt2.onnx", DATA / "tiny_gpt2.npz"),
          "encoder4_plain_dyn18": (DATA / "corpus" / "encoder4_plain_dyn18.onnx",
                                   DATA / "corpus" / "encoder4_plain_dyn18.s0.npz"),
          "gpt_causal_ts15": (DATA / "corpus" / "gpt_causal_ts15.onnx",
                              DATA / "corpus" / "gpt_causal_ts15.s0.npz")}


@pytest.mark.parametrize("how", ["opt", "saved"])
@pytest.mark.parametrize("name", MODELS)
def test_optimized_files_trace_as_the_plain_ones(name: str, how: str, tmp_path: Path) -> None:
    """Each file ONNX Runtime's tools write of bench/ort_optimized.py's models (tiny and small
    tier): CpuAcc's trace holds the attentions, products and norms the plain export's holds: Q,
    K and V one LinearSiblings (or one Linear then a Split), one ScaledDotAttention, each
    product's bias, residual and GELU in its Linear; no Attention, SkipLayerNormalization nor
    GELU written out left. The optimized tiny BERT held two Attention layers (SDPA inside) and
    four SkipLayerNormalizations (their products without a bias); the saved GPT-2 each GELU as
    eight elementwise ops, its 0.5 in the next product's alpha. Values: ONNX Runtime's."""
    pytest.importorskip("torch")
    source, data = MODELS[name]
    path = written(source, how, tmp_path / f"{how}.onnx")
    feeds = dict(np.load(data))
    session, ops = fused_ops(path, feeds)
    _, plain = fused_ops(source, feeds)
    for op in ("ScaledDotAttention", "LinearSiblings", "Linear", "LayerNormalization"):
        assert ops[op] == plain[op], (op, ops, plain)
    assert not (LOWERED_OPS | {"Tanh", "Erf", "FastGelu", "BiasGelu", "Gelu"}) & set(ops), ops
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_matches_ort(session.run(None, feeds), want)
    assert_matches_ort(InferenceSession(path, backends=["CpuRef"], optimizer_options=AS_IS)
                       .run(None, feeds), want)
