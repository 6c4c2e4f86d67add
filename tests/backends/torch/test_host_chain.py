"""A detector's post-process after its NonMaxSuppression (the gathers of the selected rows) runs as
one CpuAcc HostChain layer of NumPy kernels (fusion/host_chain.py): the same values as CpuRef and
ONNX Runtime, NaN kept, outputs the caller's; the corpus's two detectors take it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import host_chain  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

from tests.backends.torch.test_traced import _inner_layers  # noqa: E402

BOXES, CLASSES = 24, 3


def detector(batch: int | str = 1) -> bytes:
    """Boxes and scores from a few traceable layers, NonMaxSuppression, then the selected rows'
    boxes (flat index batch * N + box through a Reshape of the boxes) and scores gathered, as
    the TorchScript exporter writes a YOLO post-process."""
    f32 = TensorProto.FLOAT
    inits = [numpy_helper.from_array(v, n) for n, v in {
        "scale": np.float32([[[1.5, 1.5, 2.0, 2.0]]]), "shift": np.float32([[[0.0, 0.0, 4, 4]]]),
        "limit": np.int64([6]), "iou": np.float32([0.3]), "floor": np.float32([0.2]),
        "zero": np.int64(0), "one": np.int64(1), "two": np.int64(2),
        "count": np.int64(BOXES), "flat": np.int64([-1, 4]), "all": np.int64([-1])}.items()]
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "shift"], ["boxes"]),
        helper.make_node("Sigmoid", ["logits"], ["probs"]),
        helper.make_node("Mul", ["probs", "probs"], ["scores"]),
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit", "iou", "floor"],
                         ["selected"]),
        helper.make_node("Gather", ["selected", "zero"], ["batch_index"], axis=1),
        helper.make_node("Gather", ["selected", "one"], ["class_index"], axis=1),
        helper.make_node("Gather", ["selected", "two"], ["box_index"], axis=1),
        helper.make_node("Mul", ["batch_index", "count"], ["row"]),
        helper.make_node("Add", ["row", "box_index"], ["flat_index"]),
        helper.make_node("Reshape", ["boxes", "flat"], ["flat_boxes"]),
        helper.make_node("Gather", ["flat_boxes", "flat_index"], ["det_boxes"], axis=0),
        helper.make_node("Mul", ["row", "three"], ["row3"]),
        helper.make_node("Mul", ["class_index", "count"], ["column"]),
        helper.make_node("Add", ["row3", "column"], ["base"]),
        helper.make_node("Add", ["base", "box_index"], ["score_index"]),
        helper.make_node("Reshape", ["scores", "all"], ["flat_scores"]),
        helper.make_node("Gather", ["flat_scores", "score_index"], ["det_scores"], axis=0),
    ]
    inits.append(numpy_helper.from_array(np.int64(CLASSES), "three"))
    graph = helper.make_graph(
        nodes, "detector",
        [helper.make_tensor_value_info("x", f32, [batch, BOXES, 4]),
         helper.make_tensor_value_info("logits", f32, [batch, CLASSES, BOXES])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, ["K", 3]),
         helper.make_tensor_value_info("det_boxes", f32, ["K", 4]),
         helper.make_tensor_value_info("det_scores", f32, ["K"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                             ir_version=8).SerializeToString()


def _feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 16, (batch, BOXES, 2))
    x = np.concatenate([corner, corner + rng.uniform(1, 6, (batch, BOXES, 2))], -1)
    return {"x": x.astype(np.float32),
            "logits": rng.standard_normal((batch, CLASSES, BOXES)).astype(np.float32)}


def _session(model: bytes) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.compile": "onednn_graph"})))  # the trace before it whatever


@pytest.mark.parametrize(("batch", "declared"), [(1, 1), (2, "N")])
def test_post_nms_layers_are_one_chain_matching_cpuref_and_ort(batch, declared) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = detector(declared)
    session = _session(model)
    reference = InferenceSession(model, backends=["CpuRef"])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    theirs = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    for seed in range(3):  # another count of selected rows each time
        feeds = _feeds(batch, seed)
        got = session.run(None, feeds)
        for want in (reference.run(None, feeds), theirs.run(None, feeds)):
            for g, w in zip(got, want):  # torch's Sigmoid may differ from NumPy's by an ulp
                assert g.dtype == w.dtype
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)
    ops = [lay.op_type for lay, _ in _inner_layers(session)]
    assert ops.count("HostChain") == 1 and "Gather" not in ops and "Reshape" not in ops, ops
    assert "NonMaxSuppression" not in ops, ops  # the chain's first step: one crossing to NumPy
    (chain,) = [lay for lay, _ in _inner_layers(session) if lay.op_type == "HostChain"]
    inner = [lay.op_type for lay in chain.attrs["layers"]]
    assert inner[0] == "NonMaxSuppression" and len(inner) == 14, inner  # and every layer after


def test_nan_scores_and_outputs_the_callers() -> None:
    model = detector()
    session = _session(model)
    feeds = _feeds(1, 5)
    feeds["logits"][0, 1, 3] = np.nan  # sorts last, not above the threshold: never selected
    feeds["x"][0, 7, 0] = np.nan  # a NaN box: kept where its score is, its NaN gathered
    feeds["logits"][0, :, 7] = 4.0
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    first = session.run(None, feeds)
    for g, w in zip(first, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)  # NaN where CpuRef has it
    assert np.isnan(first[1]).any()
    kept = [value.copy() for value in first]
    for value in first:
        value[...] = 0  # the caller's to change: the next run's outputs are its own
    for g, k in zip(session.run(None, feeds), kept):
        np.testing.assert_array_equal(g, k)


def test_a_layer_reading_what_depends_on_the_chain_is_left_out() -> None:
    """A chain takes only what reads it or constants and small tensors made before its start:
    a layer after it reading an output of a layer left out (a TopK of the selected rows) would
    make a cycle through the chain, and stays out."""
    from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

    i64, f32 = np.dtype(np.int64), np.dtype(np.float32)
    layers = [Layer("nms", "NonMaxSuppression", ["b", "s"], ["sel"], {}, "", 13),
              Layer("g", "Gather", ["sel", "c0"], ["col"], {"axis": 1}, "", 13),
              Layer("t", "TopK", ["col", "k"], ["top", "at"], {}, "", 13),
              Layer("m", "Mul", ["col", "top"], ["mixed"], {}, "", 13),
              Layer("a", "Add", ["col", "c1"], ["plus"], {}, "", 13)]
    tensors = {"b": TensorInfo((1, 8, 4), f32), "s": TensorInfo((1, 2, 8), f32),
               "sel": TensorInfo(("K", 3), i64), "col": TensorInfo(("K",), i64),
               "top": TensorInfo((2,), i64), "at": TensorInfo((2,), i64),
               "mixed": TensorInfo(("K",), i64), "plus": TensorInfo(("K",), i64),
               "k": TensorInfo((1,), i64), "c0": TensorInfo((), i64), "c1": TensorInfo((), i64)}
    graph = Graph("g", layers, ["b", "s"], ["mixed", "plus", "at"], tensors,
                  {"c0": np.int64(0), "c1": np.int64(1), "k": np.int64([2])}, {"": 13})
    chain = host_chain._chain(layers[0], layers, graph)
    assert [lay.name for lay in chain] == ["g", "a"]
    views = host_chain.chained(SubgraphView.of(graph, layers), _untouched(graph, layers))
    assert [sub.replacement[0].op_type for sub in views.substitutions] == ["HostChain"]
    (sub,) = views.substitutions
    assert [lay.name for lay in sub.substitutable.layers] == ["nms", "g", "a"]  # its start first
    assert {lay.name for part in views.untouched for lay in part.layers} == {"t", "m"}


def _untouched(graph, layers):
    from backplane.backends.api.optimization import OptimizationViews
    from backplane.ir.graph import SubgraphView

    return OptimizationViews(untouched=[SubgraphView.of(graph, layers)])


@pytest.mark.parametrize(("op", "data_shape", "index_shape", "attrs"), [
    ("Gather", (6, 4), (5,), {"axis": 0}), ("Gather", (3, 6), (), {"axis": 1}),
    ("Gather", (2, 6, 3), (2, 2), {"axis": 1}), ("GatherND", (6, 4), (5, 1), {}),
    ("GatherND", (6, 4, 3), (2, 5, 2), {}), ("GatherND", (2, 6, 4), (2, 3, 1), {"batch_dims": 1})])
def test_host_kernels_are_cpurefs(op, data_shape, index_shape, attrs) -> None:
    """The chain's own kernels (``HOST_KERNELS``) give CpuRef's values, negative indices too."""
    from backplane.backends.api.kernels import select_kernel
    from backplane.backends.reference.kernels import KERNELS

    rng = np.random.default_rng(2)
    data = rng.standard_normal(data_shape).astype(np.float32)
    data.reshape(-1)[1] = np.nan
    if op == "Gather":
        size = data_shape[attrs["axis"]]
        indices = rng.integers(-size, size, index_shape).astype(np.int64)
    else:  # column j indexes axis batch_dims + j
        first = attrs.get("batch_dims", 0)
        sizes = np.array(data_shape[first:first + index_shape[-1]])
        indices = (rng.uniform(-1, 1, index_shape) * sizes).astype(np.int64)
    mine = select_kernel(host_chain.HOST_KERNELS, op, 13)(data, indices, **attrs)[0]
    want = select_kernel(KERNELS, op, 13)(data, indices, **attrs)[0]
    assert mine.shape == want.shape
    np.testing.assert_array_equal(mine, want)


I64_MAX = np.iinfo(np.int64).max

FIXED = [  # op, data shape, constant inputs after the data, attributes
    ("Gather", (7, 3), [np.int64(2)], {"axis": 1}), ("Gather", (7, 3), [np.int64(-1)], {"axis": -1}),
    ("Gather", (4, 5, 2), [np.int32(-4)], {"axis": 0}),
    ("Reshape", (2, 6, 4), [np.int64([-1, 4])], {}), ("Reshape", (2, 6, 4), [np.int64([3, -1])], {}),
    ("Unsqueeze", (6,), [np.int64([-1])], {}), ("Unsqueeze", (2, 3), [np.int64([0, -1])], {}),
    ("Slice", (9, 4), [np.int64([2]), np.int64([3]), np.int64([1])], {}),
    ("Slice", (9, 4), [np.int64([-20, 1]), np.int64([I64_MAX, -1]), np.int64([0, -1]),
                       np.int64([2, 1])], {}),
    ("Slice", (9, 4), [np.int64([12]), np.int64([20])], {})]  # empty: past the end


@pytest.mark.parametrize(("op", "shape", "given", "attrs"), FIXED)
def test_fixed_kernels_give_cpurefs_values(op, shape, given, attrs) -> None:
    """A layer whose indices, shape or axes are constants has its kernel fixed at load: CpuRef's
    values (negative indices and axes, clamped slices, -1 in a shape)."""
    from backplane.backends.api.kernels import bind_kernel, select_kernel
    from backplane.backends.reference.kernels import KERNELS
    from backplane.ir.graph import Layer

    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    data.reshape(-1)[1] = np.nan
    names = [f"c{k}" for k in range(len(given))]
    layer = Layer("l", op, ["x", *names], ["y"], attrs, "", 13)
    fixed = host_chain.fixed_kernel(layer, dict(zip(names, given)), {"x": len(shape)})
    assert fixed is not None
    want = bind_kernel(select_kernel(KERNELS, op, 13), attrs, 1)(data, *given)[0]
    got = fixed(data, *given)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_kernels_not_fixed_where_they_would_differ() -> None:
    """A negative Slice step, a 0 in a Reshape's shape (the input's size there), a Gather whose
    result leaves the chain (a view would be the input's memory) or indices read at the run keep
    CpuRef's kernel; a constant index out of range fails as CpuRef's does."""
    from backplane.ir.graph import Layer

    constants = {"s": np.int64([0]), "e": np.int64([-I64_MAX]), "a": np.int64([0]),
                 "st": np.int64([-1]), "shape": np.int64([0, -1]), "i": np.int64(1),
                 "far": np.int64(5)}
    ranks = {"x": 2}
    never = [Layer("l", "Slice", ["x", "s", "e", "a", "st"], ["y"], {}, "", 13),
             Layer("l", "Reshape", ["x", "shape"], ["y"], {}, "", 13),
             Layer("l", "Gather", ["x", "idx"], ["y"], {"axis": 1}, "", 13)]
    assert [host_chain.fixed_kernel(lay, constants, ranks) for lay in never] == [None] * 3
    leaving = Layer("l", "Gather", ["x", "i"], ["y"], {"axis": 1}, "", 13)
    assert host_chain.fixed_kernel(leaving, constants, ranks, {"y"}) is None
    far = host_chain.fixed_kernel(Layer("l", "Gather", ["x", "far"], ["y"], {"axis": 1}, "", 13),
                                  constants, ranks)
    with pytest.raises(IndexError):
        far(np.zeros((3, 4), np.float32), constants["far"])


def test_the_corpus_detectors_chains_fix_their_constant_layers() -> None:
    """detect_nms_ts14's chain: its Gathers of the selected rows' columns and its Reshapes are
    fixed at load (basic indexing, one reshape); its outputs as ONNX Runtime's."""
    from pathlib import Path

    ort = pytest.importorskip("onnxruntime")
    corpus = Path(__file__).parents[2] / "data" / "corpus"
    model = str(corpus / "detect_nms_ts14.onnx")
    feeds = dict(np.load(corpus / "detect_nms_ts14.s0.npz"))
    session = _session(open(model, "rb").read())
    got = session.run(None, feeds)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    (chain,) = [lay for lay, _ in _inner_layers(session) if lay.op_type == "HostChain"]
    constants = {n: np.asarray(v) for n, v in chain.attrs["constants"].items()}
    fixed = [lay.op_type for lay in chain.attrs["layers"]
             if host_chain.fixed_kernel(lay, constants, chain.attrs["ranks"],
                                        set(chain.attrs["outputs"]))]
    assert fixed.count("Reshape") == 2 and fixed.count("Gather") == 5, fixed
