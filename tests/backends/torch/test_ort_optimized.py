"""ONNX Runtime's optimized transformers on CpuAcc as fast as the plain ones (issue 29): the fusions
its optimizer and its saved models write (FusedMatMul, FusedGemm, FusedConv, SkipLayerNormalization,
BiasGelu, Gelu, FastGelu, Attention) run on CpuAcc inside one trace, no partition cut, and a
free-dimension model's products after them are fused (packed) in each shape's build as the plain
model's are. Outputs against ONNX Runtime's and CpuRef's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from backplane import InferenceSession, OptimizerOptions  # noqa: E402
from backplane.backends.torch.backend import FUSED_DOMAIN  # noqa: E402
from backplane.optimizer.ort_lowered import LOWERED  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.contrib_cases import CASES as CONTRIB_CASES  # noqa: E402
from tests.backends.contrib_cases import _model as one_node  # noqa: E402
from tests.backends.contrib_cases import ort_run as ort_run_model  # noqa: E402
from tests.models.test_ort_tools import DATA, contrib_ops, ort_run, ort_saved  # noqa: E402
from tests.models.test_models import assert_close as models_assert_close  # noqa: E402

TOLERANCE = 1e-5  # max |diff| relative to the output's max |value|


def traced_session(path: Path) -> InferenceSession:
    """CpuAcc then CpuRef, the subgraph traced whenever it can be (not measured against its
    layers: a test asserts what the trace holds)."""
    options = RuntimeOptions(backend_options={"CpuAcc.compile": "onednn_graph"})
    return InferenceSession(path, backends=["CpuAcc", "CpuRef"], runtime=Runtime(options))


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    models_assert_close(got, want, TOLERANCE)


def built_graphs(session: InferenceSession) -> list:
    """The graph of each shape's build of the session's Specialized layers."""
    loaded = session.runtime.network(session.network_id)
    return [runner.graph for step in loaded.steps
            for runner in getattr(step.workload, "built", {}).values()]


def run_layers(session: InferenceSession) -> list:
    """The layers the session's one network runs, top level."""
    return list(session.runtime.network(session.network_id).layers)


@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt2"])
def test_saved_optimized_models_run_in_one_trace_on_cpuacc(name: str, tmp_path: Path) -> None:
    path = ort_saved(DATA / f"{name}.onnx", tmp_path / "saved.onnx")
    fused = contrib_ops(path)
    assert "FusedMatMul" in fused  # ONNX Runtime's scaled Q Kt; FusedGemm, Gelu in tiny_bert
    feeds = dict(np.load(DATA / f"{name}.npz"))
    session = traced_session(path)
    assert set(session.report.counts()) == {"CpuAcc"}  # none fell to CpuRef: no partition cut
    assert len(session.report.partitions) == 1
    (traced,) = [lay for lay in run_layers(session) if lay.op_type == "Traced"]
    ops = [lay.op_type for lay in traced.attrs["layers"]]
    held = {lay.op_type for lay in traced.attrs["layers"] if lay.domain == "com.microsoft"}
    # a GELU after a product is its post-op (below); FusedMatMul(Q, K) with its scale, the mask,
    # the softmax and the product by V are one ScaledDotAttention, as the plain model's; each
    # SkipLayerNormalization its Adds and a LayerNormalization, FusedGemm a Gemm and its
    # activation (optimizer/ort_lowered.py)
    assert held == fused - {"Gelu", "FastGelu", "FusedMatMul"} - LOWERED
    assert ops.count("ScaledDotAttention") == 2
    got = session.run(None, feeds)
    assert_close(got, ort_run(path, feeds))
    assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))


def free_batch_encoder(path: Path, d: int = 32, ff: int = 64, length: int = 8) -> Path:
    """One encoder layer's feed-forward half as exporters write it, a free batch: a projection
    with its bias and a residual Add, LayerNormalization, Linear, GELU written out (Erf), Linear,
    a residual Add, LayerNormalization. ONNX Runtime's optimizer makes SkipLayerNormalization of
    each Add + LayerNormalization and BiasGelu of the second bias and the GELU."""
    rng = np.random.default_rng(29)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    inits = {"wa": w(d, d), "ba": w(d), "g1": 1 + w(d) / 4, "n1": w(d), "w1": w(d, ff),
             "b1": w(ff), "w2": w(ff, d), "b2": w(d), "g2": 1 + w(d) / 4, "n2": w(d),
             "root2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
             "half": np.array(0.5, np.float32)}
    node = helper.make_node
    nodes = [node("MatMul", ["x", "wa"], ["a0"]), node("Add", ["a0", "ba"], ["a1"]),
             node("Add", ["a1", "x"], ["r1"]),
             node("LayerNormalization", ["r1", "g1", "n1"], ["h"], axis=-1, epsilon=1e-5),
             node("MatMul", ["h", "w1"], ["f0"]), node("Add", ["f0", "b1"], ["f1"]),
             node("Div", ["f1", "root2"], ["e0"]), node("Erf", ["e0"], ["e1"]),
             node("Add", ["e1", "one"], ["e2"]), node("Mul", ["f1", "e2"], ["e3"]),
             node("Mul", ["e3", "half"], ["g"]),
             node("MatMul", ["g", "w2"], ["o0"]), node("Add", ["o0", "b2"], ["o1"]),
             node("Add", ["o1", "h"], ["r2"]),
             node("LayerNormalization", ["r2", "g2", "n2"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(
        nodes, "encoder_ffn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", length, d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", length, d])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), str(path))
    return path


def test_a_free_batch_optimized_encoder_fuses_its_products_in_each_build(tmp_path: Path) -> None:
    """The products after SkipLayerNormalization and BiasGelu have static input shapes in each
    shape's build (``onnx_contrib.OUTPUT_SHAPES``), so each is one Linear as in the plain model;
    without them they ran as plain products (aten::mm) in the optimized encoder4_plain_dyn18."""
    from onnxruntime.transformers.optimizer import optimize_model

    plain = free_batch_encoder(tmp_path / "plain.onnx")
    path = tmp_path / "opt.onnx"
    optimize_model(str(plain), model_type="bert", num_heads=2, hidden_size=32,
                   opt_level=0).save_model_to_file(str(path))
    assert contrib_ops(path) == {"SkipLayerNormalization", "BiasGelu"}
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    assert set(session.report.counts()) == {"CpuAcc"}
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 8, 32))
                 .astype(np.float32)}
        got = session.run(None, feeds)
        assert_close(got, ort_run(path, feeds))
        assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))
    for graph in built_graphs(session):
        layers = [lay for outer in graph.layers for lay in [outer, *outer.attrs.get("layers", [])]]
        linears = [lay for lay in layers if lay.op_type == "Linear" and lay.domain == FUSED_DOMAIN]
        assert not [lay for lay in layers if lay.op_type == "MatMul"]
        assert len(linears) == 3, [lay.op_type for lay in layers]


@pytest.mark.parametrize("how", ["optimize_model", "saved"])
def test_an_opset_15_gpt_optimized_by_onnx_runtime_loads(how: str, tmp_path: Path) -> None:
    """ONNX Runtime fuses the corpus GPT's written-out layer norms into LayerNormalization in its
    opset-15 file (its own op there; ONNX's from 17): the file failed at import ("the op does not
    exist at opset 15"); it runs on CpuAcc, one partition, as ONNX Runtime and CpuRef compute it."""
    from onnxruntime.transformers.optimizer import optimize_model

    source = DATA / "corpus" / "gpt_causal_ts15.onnx"
    path = tmp_path / "opt.onnx"
    if how == "saved":
        ort_saved(source, path)
    else:
        optimize_model(str(source), model_type="gpt2", num_heads=4, hidden_size=32,
                       opt_level=0).save_model_to_file(str(path))
    model = onnx.load(str(path))
    assert {o.domain: o.version for o in model.opset_import}[""] == 15
    assert "LayerNormalization" in {n.op_type for n in model.graph.node if not n.domain}
    feeds = dict(np.load(DATA / "corpus" / "gpt_causal_ts15.s0.npz"))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    assert set(session.report.counts()) == {"CpuAcc"} and len(session.report.partitions) == 1
    got = session.run(None, feeds)
    assert_close(got, ort_run(path, feeds))
    assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))
    # its free sequence: each shape's build gives LayerNormalization's output a static shape
    # (optimizer/shapes.py), so the products after it are Linears too
    (graph,) = built_graphs(session)
    layers = [lay for outer in graph.layers for lay in [outer, *outer.attrs.get("layers", [])]]
    assert not [lay for lay in layers if lay.op_type in ("MatMul", "FusedMatMul")
                and lay.inputs[1] in graph.constants]
    assert len([lay for lay in layers if lay.op_type == "Linear"]) >= 8


FUSED_CASES = [name for name in CONTRIB_CASES
               if name.startswith(("FusedMatMul", "FusedGemm", "FusedConv"))]


@pytest.mark.parametrize("name", FUSED_CASES)
def test_saved_fusions_one_node_on_cpuacc(name: str) -> None:
    """Each of test_contrib_ops' FusedMatMul, FusedGemm and FusedConv cases (every activation,
    a residual, broadcasting, transposes, alpha) runs on CpuAcc as ONNX Runtime and CpuRef do."""
    model, feeds = one_node(CONTRIB_CASES[name])
    as_is = OptimizerOptions(fold_constants=False)  # the op itself (else FusedGemm and FusedConv
    # are their plain ops: tests/optimizer/test_ort_lowered.py)
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"], optimizer_options=as_is)
    assert set(session.report.counts()) == {"CpuAcc"}
    assert [p.op_type for p in session.report.layers.values()] == [CONTRIB_CASES[name].op]
    got = session.run(None, feeds)
    assert_close(got, ort_run_model(model, feeds))
    assert_close(got, InferenceSession(model, backends=["CpuRef"], optimizer_options=as_is)
                 .run(None, feeds))


def test_unread_statistics_of_skip_layer_normalization_are_not_computed(tmp_path: Path) -> None:
    """A pre-norm decoder's SkipLayerNormalization as ONNX Runtime's optimizer writes it: its sum
    (the next residual) an output, its mean and inverse deviation left empty; CpuAcc's layer
    computes neither (``statistics`` 0: torch's one-pass layer_norm), in the trace, as ONNX Runtime
    and CpuRef. At opset 12, which optimizer/ort_lowered.py leaves alone (from 13 the op is its
    Adds and a LayerNormalization: test_ort_lowered.py)."""
    rng = np.random.default_rng(12)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / 4).astype(np.float32)

    node = helper.make_node
    nodes = [node("MatMul", ["x", "w1"], ["a"]),
             node("SkipLayerNormalization", ["a", "x", "g", "b", "bias"], ["y1", "", "", "s1"],
                  domain="com.microsoft", epsilon=1e-5),
             node("MatMul", ["y1", "w2"], ["c"]),
             node("SkipLayerNormalization", ["c", "s1", "g", "b"], ["y2", "", "", "s2"],
                  domain="com.microsoft", epsilon=1e-5)]
    inits = {"w1": w(16, 16), "w2": w(16, 16), "g": 1 + w(16), "b": w(16), "bias": w(16)}
    graph = helper.make_graph(
        nodes, "pre_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 16])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y2", "s2")],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / "pre_norm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12),
                                                      helper.make_opsetid("com.microsoft", 1)],
                                ir_version=8), str(path))
    session = traced_session(path)
    (traced,) = [lay for lay in run_layers(session) if lay.op_type == "Traced"]
    held = [lay for lay in traced.attrs["layers"] if lay.op_type == "SkipLayerNormalization"]
    assert len(held) == 2 and all(lay.attrs.get("statistics", 1) == 0 for lay in held)
    feeds = {"x": rng.standard_normal((1, 6, 16)).astype(np.float32)}
    got = session.run(None, feeds)
    assert_close(got, ort_run(path, feeds))
    assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))


@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt2"])
def test_a_gelu_after_a_product_is_the_linears_post_op(name: str, tmp_path: Path) -> None:
    """The optimizer's BiasGelu (BERT) and FastGelu (GPT-2) after a MatMul by a constant: one
    Linear, the GELU's bias its bias and the GELU its post-op, as the plain model's Linear takes
    the GELU written out; in the trace, as ONNX Runtime and CpuRef compute it."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type, gelu, form = {"tiny_bert": ("bert", "BiasGelu", "none"),
                              "tiny_gpt2": ("gpt2", "FastGelu", "tanh")}[name]
    path = tmp_path / "opt.onnx"
    optimize_model(str(DATA / f"{name}.onnx"), model_type=model_type, num_heads=2, hidden_size=32,
                   opt_level=0).save_model_to_file(str(path))
    assert gelu in contrib_ops(path)
    session = traced_session(path)
    (traced,) = [lay for lay in run_layers(session) if lay.op_type == "Traced"]
    ops = [lay.op_type for lay in traced.attrs["layers"]]
    assert gelu not in ops
    linears = [lay for lay in traced.attrs["layers"] if lay.op_type == "Linear"]
    assert len([lay for lay in linears if lay.attrs["unary"] == ("gelu", [], form)]) == 2
    feeds = dict(np.load(DATA / f"{name}.npz"))
    got = session.run(None, feeds)
    assert_close(got, ort_run(path, feeds))
    assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))
