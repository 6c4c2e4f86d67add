"""A CpuAcc subgraph oneDNN Graph does not take runs as one Traced layer (fusion/traced.py): its
layers traced into one frozen TorchScript graph, at load for static inputs and per input signature
for free dimensions; never where a kernel reads a value computed from the inputs on the host."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.registry import registry  # noqa: E402
from backplane.backends.torch.fusion import traced  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402


def attention_block(batch: int | str = "N", length: int | str = "L", d: int = 16,
                    dtype: type = np.float32) -> bytes:
    """One self-attention block with a residual and a layer norm written out, as exporters write
    them: MatMul, Add, Reshape, Transpose, Softmax, ReduceMean, Sub, Pow, Sqrt, Div."""
    rng = np.random.default_rng(0)
    heads = 2
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def const(name: str, value: np.ndarray) -> onnx.TensorProto:
        value = np.asarray(value)  # float weights rounded to float16 in either type
        return numpy_helper.from_array(
            value.astype(np.float16).astype(dtype) if value.dtype.kind == "f" else value, name)

    inits = [const("wq", rng.standard_normal((d, d)).astype(np.float32) * 0.3),
             const("wk", rng.standard_normal((d, d)).astype(np.float32) * 0.3),
             const("wv", rng.standard_normal((d, d)).astype(np.float32) * 0.3),
             const("bq", rng.standard_normal(d).astype(np.float32)),
             const("split_heads", np.array([0, 0, heads, d // heads], np.int64)),
             const("merge_heads", np.array([0, 0, d], np.int64)),
             const("scale", np.array(1 / np.sqrt(d // heads), np.float32)),
             const("axes", np.array([-1], np.int64)), const("two", np.array(2, np.float32)),
             const("eps", np.array(1e-5, np.float32))]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q0"]), helper.make_node("Add", ["q0", "bq"], ["q1"]),
        helper.make_node("MatMul", ["x", "wk"], ["k0"]), helper.make_node("MatMul", ["x", "wv"], ["v0"]),
        *[helper.make_node("Reshape", [f"{t}", "split_heads"], [f"{t}r"]) for t in ("q1", "k0", "v0")],
        helper.make_node("Transpose", ["q1r"], ["qh"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k0r"], ["kh"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v0r"], ["vh"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["qh", "kh"], ["s0"]), helper.make_node("Mul", ["s0", "scale"], ["s1"]),
        helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vh"], ["o0"]),
        helper.make_node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["o1", "merge_heads"], ["o2"]),
        helper.make_node("Add", ["o2", "x"], ["r"]),
        helper.make_node("ReduceMean", ["r", "axes"], ["mu"]),
        helper.make_node("Sub", ["r", "mu"], ["c"]), helper.make_node("Pow", ["c", "two"], ["c2"]),
        helper.make_node("ReduceMean", ["c2", "axes"], ["var"]),
        helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["c", "sd"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention_block",
        [helper.make_tensor_value_info("x", elem, [batch, length, d])],
        [helper.make_tensor_value_info("y", elem, [batch, length, d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _session(model: bytes, **options) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _inner_layers(session: InferenceSession) -> list:
    """The CpuAcc layers that run: a static model's, or each built signature's of its Specialized."""
    loaded = session.runtime.network(session.network_id)
    found = []
    for step, layer in zip(loaded.steps, loaded.layers):
        work = getattr(step.workload, "work", step.workload)
        if layer.op_type == "Specialized":
            for runner in work.built.values():
                inner = _loaded_of(runner)
                found += [(lay, getattr(s.workload, "work", s.workload))
                          for lay, s in zip(inner.layers, inner.steps)]
        elif layer.backend == "CpuAcc" and layer.op_type not in ("MemImport", "MemCopy"):
            found.append((layer, work))
    return found


def _loaded_of(runner):
    """The LoadedNetwork a signature's build runs (held by its run function)."""
    from backplane.runtime.loaded_network import LoadedNetwork

    (loaded,) = [c.cell_contents for c in runner.__closure__
                 if isinstance(c.cell_contents, LoadedNetwork)]
    return loaded


def _x(shape, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 7, 16), (3, 12, 16)])
def test_free_dimensions_trace_per_signature_and_match_cpuref(shape) -> None:
    model = attention_block()
    session = _session(model, **{"CpuAcc.compile": "onednn_graph"})  # the trace whenever it traces
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": _x(shape)})
    for _ in range(2):
        (got,) = session.run(None, {"x": _x(shape)})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    routes = [(lay.op_type, getattr(work, "route", None)) for lay, work in _inner_layers(session)]
    assert routes == [("Traced", "traced")]


def test_static_inputs_trace_at_load_and_keep_nan() -> None:
    model = attention_block(2, 5)
    session = _session(model, **{"CpuAcc.compile": "onednn_graph"})
    x = _x((2, 5, 16))
    x[1, 2, 3] = np.nan
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    (got,) = session.run(None, {"x": x})
    assert [lay.op_type for lay, _ in _inner_layers(session)].count("Traced") == 1
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[1]).any() and not np.isnan(got[0]).any()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)


def test_layers_mode_never_traces() -> None:
    session = _session(attention_block(), **{"CpuAcc.compile": "layers"})
    session.run(None, {"x": _x((1, 4, 16))})
    ops = [lay.op_type for lay, _ in _inner_layers(session)]
    assert "Traced" not in ops and "ScaledDotAttention" in ops  # its layers one by one, fused


def test_host_reads_follow_computed_values_not_constants() -> None:
    x, constant = torch.ones(4), torch.tensor([2, 2])
    reads = traced.HostReads([x])
    with reads:
        [int(v) for v in (constant + 1).tolist()]  # a constant's values: a trace may keep them
        assert reads.found == []
        y = x * 2
        out = torch.empty(2)
        out.copy_(y[:2])  # in place: out now holds computed values
        out.tolist()
        bool(y.sum() > 0)
    assert reads.found == ["tolist", "__bool__"]


def test_a_host_read_the_tables_miss_keeps_the_layers(monkeypatch, caplog) -> None:
    """Reshape to a computed shape, with Reshape's shape input taken off the table of host inputs:
    the check run finds the kernel reading it, the trace is refused, and a second signature with
    another shape still gets the right answer."""
    monkeypatch.setitem(traced.HOST_INPUTS, "Reshape", ())
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["r", "s"], ["y0"]), helper.make_node("Neg", ["y0"], ["y"])]
    graph = helper.make_graph(nodes, "computed_shape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    from backplane.frontends.onnx import import_onnx
    from backplane.ir.graph import SubgraphView

    imported = import_onnx(model)
    view_layers = [lay for lay in imported.layers if lay.op_type != "Shape"]
    # the Shape's output as an input of the subgraph: a computed value, static in shape
    imported.inputs.append("s")
    view = SubgraphView.of(imported, view_layers)
    layer = traced.wrap(view, imported, view_layers)
    assert layer is not None  # the tables alone would let it be traced
    backend = registry.create("CpuAcc")
    sample = [torch.randn(2, 3), torch.tensor([3, 2])]
    with caplog.at_level("DEBUG", logger="backplane.torch"):
        assert traced.compile_traced(layer, backend, sample) is None
    assert "reads tolist of a computed value on the host" in caplog.text


def test_a_trace_holds_each_weight_once() -> None:
    """tiny_bert traced: the frozen graph's tensor constants add up to the model's weights (each
    held once: the trace keeps the tensors the layers read, it does not copy them again)."""
    from tests.models.test_models import DATA

    path = DATA / "tiny_bert.onnx"
    session = InferenceSession(str(path), backends=["CpuAcc", "CpuRef"],
                               provider_options=[{"CpuAcc.compile": "onednn_graph"}, {}])
    ((layer, work),) = [(lay, w) for lay, w in _inner_layers(session) if lay.op_type == "Traced"]
    assert work.route == "traced"
    held = sum(node.t("value").nbytes for node in work.module.graph.nodes()
               if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType")
    weights = sum(numpy_helper.to_array(t).nbytes for t in onnx.load(str(path)).graph.initializer)
    assert weights * 0.9 < held <= weights * 1.01 + 1024


def test_float16_is_computed_in_float32_and_rounded_once() -> None:
    """On a CPU without float16 arithmetic a float16 subgraph is traced computing in float32, its
    outputs rounded to float16: within a float16 step of the same block (the same float16 weights)
    computed in float32, and within a few of CpuRef's float16 run (rounded at every layer)."""
    if traced.native_half():
        pytest.skip("this CPU computes float16 itself: its float16 subgraphs stay as they are")
    half, single = attention_block(dtype=np.float16), attention_block()
    x = _x((2, 6, 16)).astype(np.float16)
    session = _session(half, **{"CpuAcc.compile": "onednn_graph"})
    (got,) = session.run(None, {"x": x})
    assert got.dtype == np.float16
    assert [(lay.op_type, work.route) for lay, work in _inner_layers(session)] == [("Traced", "traced")]
    (exact,) = InferenceSession(single, backends=["CpuRef"]).run(None, {"x": x.astype(np.float32)})
    (stepwise,) = InferenceSession(half, backends=["CpuRef"]).run(None, {"x": x})
    step = float(np.spacing(np.float16(np.abs(exact).max())))
    assert np.abs(got.astype(np.float32) - exact).max() <= step
    assert np.abs(got.astype(np.float32) - stepwise.astype(np.float32)).max() <= 8 * step
