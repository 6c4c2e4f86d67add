"""ONNX Runtime's Reshape -> Gemm -> Reshape (its MatMul + Add fusion on a 3-D activation, in the
models it saves) runs as the MatMul and Add it was (optimizer/ort_patterns.py), with the Gemm's
values, and only where that is the same computation."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession

DATA = Path(__file__).resolve().parent.parent / "data"
RNG = np.random.default_rng(11)
X = RNG.standard_normal((2, 5, 8)).astype(np.float32)


def sandwich(trans_b: int = 1, alpha: float = 1.0, bias_shape=(1, 6), bias_input: bool = False,
             read_twice: bool = False, free: bool = False) -> bytes:
    weight = RNG.standard_normal((6, 8) if trans_b else (8, 6)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w"),
             numpy_helper.from_array(np.array([10, 8], np.int64), "flat"),
             numpy_helper.from_array(np.array([2, 5, 6], np.int64), "back")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                           ["b", 5, 8] if free else [2, 5, 8])]
    if bias_input:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [6]))
    else:
        inits.append(numpy_helper.from_array(
            RNG.standard_normal(bias_shape).astype(np.float32), "bias"))
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("Gemm", ["x2", "w", "bias"], ["g"], transB=trans_b, alpha=alpha),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if read_twice:
        nodes.append(helper.make_node("Relu", ["x2"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "sandwich", inputs, outputs, inits)
    # IR 8: ONNX Runtime 1.30 (the GPU machine's) reads IR 13 at most
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()


def reference(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def placed_ops(session) -> collections.Counter:
    return collections.Counter(p.op_type for p in session.report.layers.values())


@pytest.mark.parametrize("trans_b,bias_shape", [(1, (1, 6)), (0, (6,)), (1, (6,))])
def test_sandwich_runs_as_matmul_and_add(trans_b, bias_shape) -> None:
    model = sandwich(trans_b=trans_b, bias_shape=bias_shape)
    session = InferenceSession(model, backends=["CpuRef"])
    assert placed_ops(session) == {"MatMul": 1, "Add": 1}
    (got,), (want,) = session.run(None, {"x": X}), reference(model, {"x": X})
    assert got.shape == (2, 5, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [dict(alpha=0.5), dict(bias_input=True), dict(read_twice=True),
                                  dict(free=True), dict(bias_shape=(10, 6))])
def test_other_sandwiches_stay_as_they_are(case) -> None:
    model = sandwich(**case)
    feeds = {"x": X} | ({"bias": np.ones(6, np.float32)} if case.get("bias_input") else {})
    session = InferenceSession(model, backends=["CpuRef"])  # a (10, 6) bias: one per row
    assert placed_ops(session)["Gemm"] == 1
    for got, want in zip(session.run(None, feeds), reference(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backends", [["CpuRef"], ["CpuAcc", "CpuRef"]], ids=["cpuref", "cpuacc"])
def test_onnx_runtime_saved_bert_has_its_products_back(backends, tmp_path) -> None:
    if "CpuAcc" in backends:
        pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "saved.onnx")
    ort.InferenceSession(str(DATA / "tiny_bert.onnx"), options, providers=["CPUExecutionProvider"])
    import onnx

    saved = onnx.load(options.optimized_model_filepath)
    written = collections.Counter(n.op_type for n in saved.graph.node)
    assert written["Gemm"] >= 8 and written["Reshape"] >= 2 * 8  # ONNX Runtime's sandwiches
    feeds = dict(np.load(DATA / "tiny_bert.npz"))
    session = InferenceSession(options.optimized_model_filepath, backends=backends)
    ops = placed_ops(session)
    # 12 sandwiches undone; the pooler's FusedGemm (Gemm, Tanh) a Gemm then a Tanh (ort_lowered)
    assert ops["Gemm"] == written["Gemm"] - 12 + written["FusedGemm"]
    assert ops["Reshape"] == written["Reshape"] - 24
    want = reference(options.optimized_model_filepath, feeds)
    for got, expected in zip(session.run(None, feeds), want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def saved_small_gpt(tmp_path: Path) -> Path:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "saved.onnx")
    ort.InferenceSession(str(DATA / "corpus" / "gpt_causal_ts15.onnx"), options,
                         providers=["CPUExecutionProvider"])
    return tmp_path / "saved.onnx"


def test_a_saved_gpts_gelus_get_their_half_back(tmp_path) -> None:
    """ONNX Runtime's saved GPT-2: x * (1 + tanh(...)) then FusedMatMul(alpha 0.5) becomes the
    GELU as exported (its Mul by 0.5) then a MatMul (ort_patterns.half_back_in_gelus)."""
    from backplane.frontends.onnx import import_onnx
    from backplane.optimizer.ort_patterns import half_back_in_gelus

    graph = import_onnx(saved_small_gpt(tmp_path))
    halved = [lay for lay in graph.layers if lay.op_type == "FusedMatMul"
              and lay.attrs.get("alpha") == 0.5]
    assert len(halved) == 2  # one a block
    names = {lay.name for lay in halved}
    half_back_in_gelus(graph)
    assert not [lay for lay in graph.layers if lay.op_type == "FusedMatMul"]
    made = {lay.outputs[0]: lay for lay in graph.layers}
    for product in [lay for lay in graph.layers if lay.name in names]:
        assert product.op_type == "MatMul" and not product.domain
        half = made[product.inputs[0]]
        assert half.op_type == "Mul" and float(graph.constants[half.inputs[1]]) == 0.5
        assert made[half.inputs[0]].op_type == "Mul"  # x * (1 + tanh(...))


def test_a_product_of_another_mul_keeps_its_alpha(tmp_path) -> None:
    from backplane.frontends.onnx import import_onnx
    from backplane.optimizer.ort_patterns import half_back_in_gelus

    weight = RNG.standard_normal((8, 6)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "x"], ["m"]),
             helper.make_node("FusedMatMul", ["m", "w"], ["y"], domain="com.microsoft",
                              alpha=0.5)]
    graph = helper.make_graph(nodes, "halved",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    imported = half_back_in_gelus(import_onnx(model))
    assert [lay.op_type for lay in imported.layers] == ["Mul", "FusedMatMul"]


def test_a_saved_encoders_split_parts_are_gathers_again(tmp_path) -> None:
    """ONNX Runtime's saved encoder takes Q, K and V from the packed product by Split then a
    Squeeze each, where the export had a Gather each: Gathers again (gathers_from_splits), the
    values ONNX Runtime's."""
    ort = pytest.importorskip("onnxruntime")
    from backplane.frontends.onnx import import_onnx
    from backplane.optimizer.ort_patterns import gathers_from_splits

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "saved.onnx")
    source = DATA / "corpus" / "encoder4_plain_dyn18.onnx"
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    graph = import_onnx(options.optimized_model_filepath)
    before = collections.Counter(lay.op_type for lay in graph.layers)
    assert before["Split"] == 4 and before["Gather"] == 0  # one a layer, of 3 parts
    ops = collections.Counter(lay.op_type for lay in gathers_from_splits(graph).layers)
    assert ops["Split"] == 0 and ops["Gather"] == 12 and ops["Squeeze"] == before["Squeeze"] - 12
    feeds = dict(np.load(DATA / "corpus" / "encoder4_plain_dyn18.s0.npz"))
    session = InferenceSession(options.optimized_model_filepath, backends=["CpuRef"])
    want = reference(options.optimized_model_filepath, feeds)
    for got, expected in zip(session.run(None, feeds), want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
