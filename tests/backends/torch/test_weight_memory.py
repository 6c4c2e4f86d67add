"""CpuAcc's weights in memory: after a load, each weight is held once by the model's constants and at
most once more in the layout the chosen route reads (packed by oneDNN, channels-last, transposed),
never as a copy that nothing reads; the constants CpuAcc reads are torch views of the graph's arrays;
nothing writes into them; the report counts a compiled partition's constants and intermediates.

Checked by memory addresses and byte counts of the tensors each workload says it keeps
(``weights``), not by the process's resident memory, which other processes' noise would move."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_fusion import assert_matches_cpuref, inner_workloads  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"
RNG = np.random.default_rng(0)


def _const(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.3).astype(np.float32), name)


def _session(model: onnx.ModelProto, **options: str) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _in_constants(tensor, arrays) -> bool:
    """Whether a dense tensor's memory lies inside one of ``arrays``."""
    if tensor.is_mkldnn:
        return False
    start = tensor.data_ptr()
    return any(a.ctypes.data <= start < a.ctypes.data + a.nbytes for a in arrays)


def _own_copies(workload, layer_arrays) -> list:
    """The tensors a route keeps that are not the model's memory (its own layout of a weight)."""
    return [t for t in workload.weights if not _in_constants(t, layer_arrays)]


def matmul_model() -> onnx.ModelProto:
    """x -> MatMul(W (16, 8), stored (K, N) as exporters write it) -> Add(b) -> Relu."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    return make_model(nodes, [float_input("x", [1, 4, 16])], [float_input("y", [1, 4, 8])],
                      [_const("w", 16, 8), _const("b", 8)])


def gemm_model() -> onnx.ModelProto:
    """x -> Gemm(W (8, 16), transB=1: already (N, K), as torch's Linear exports it) -> Relu."""
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="gemm", transB=1),
             helper.make_node("Relu", ["g"], ["y"], name="relu")]
    return make_model(nodes, [float_input("x", [2, 16])], [float_input("y", [2, 8])],
                      [_const("w", 8, 16), _const("b", 8)])


@pytest.mark.parametrize("route", ["mkl", "onednn"])
@pytest.mark.parametrize("build", [matmul_model, gemm_model])
def test_a_linear_keeps_one_layout_of_its_weight_and_the_layer_no_copy(build, route: str) -> None:
    model = build()
    session = _session(model, **{"CpuAcc.linear_route": route})
    graph = session.optimized.graph
    (layer,) = [lay for lay in graph.layers if lay.op_type == "Linear"]
    constants = list(graph.constants.values())
    # the fused layer holds the model's weight (a transposed view for MatMul), not a copy of it
    assert np.shares_memory(layer.attrs["weight"], graph.constants["w"])
    (workload,) = inner_workloads(session, "Linear")
    own = _own_copies(workload, constants)
    if route == "onednn":  # the packed weight alone; the bias is the model's
        assert [t.is_mkldnn for t in own] == [True]
    elif build is gemm_model:  # (N, K) already: F.linear reads the constant itself
        assert own == []
    else:  # MatMul's (K, N) transposed once, contiguous: F.linear's layout
        assert [tuple(t.shape) for t in own] == [(8, 16)] and own[0].is_contiguous()
    assert_matches_cpuref(session, model)


def conv_model(kernel: int, group: int = 1) -> onnx.ModelProto:
    """x (1, 8, 6, 6) -> Conv(kernel x kernel, padded to keep the size) -> Relu."""
    pad = kernel // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", group=group,
                              pads=[pad] * 4),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [float_input("x", [1, 8, 6, 6])], [float_input("y", [1, 8, 6, 6])],
                      [_const("w", 8, 8 // group, kernel, kernel), _const("b", 8)])


@pytest.mark.parametrize("case,route,copies", [
    ((1, 1), "torch", 0),    # a 1x1 kernel is channels-last as it is: the constant itself
    ((1, 1), "gemm", 0),     # its (K, C) matrix is a view of the constant
    ((3, 8), "torch", 0),    # a depthwise kernel too
    ((3, 1), "torch", 1),    # a 3x3 kernel copied once to channels-last
    ((3, 1), "onednn", 1),   # reordered once by oneDNN
])
def test_a_conv_keeps_at_most_the_layout_its_route_reads(case, route: str, copies: int) -> None:
    kernel, group = case
    model = conv_model(kernel, group)
    session = _session(model, **{"CpuAcc.conv_route": route, "CpuAcc.compile": "layers"})
    (workload,) = inner_workloads(session, "FusedConv")
    assert workload.route == route
    constants = list(session.optimized.graph.constants.values())
    assert len(_own_copies(workload, constants)) == copies
    assert_matches_cpuref(session, model)


def test_the_constants_cpuacc_reads_are_views_of_the_graphs() -> None:
    """tiny_bert's embeddings (read by Gather on CpuAcc) are bound without a copy: the ONNX
    frontend's constants are writable arrays of their own, which torch.from_numpy views (layer by
    layer: traced, tests/backends/torch/test_traced.py checks the trace's constants)."""
    session = InferenceSession(str(DATA / "tiny_bert.onnx"), backends=["CpuAcc", "CpuRef"],
                               provider_options=[{"CpuAcc.compile": "layers"}, {}])
    loaded = session.runtime.network(session.network_id)
    graph = session.optimized.graph
    bound = {key[:-len("@torch-cpu")]: loaded._template[slot]
             for key, slot in loaded._slots.items() if key.endswith("@torch-cpu")}
    assert bound, "tiny_bert's CpuAcc layers read constants"
    for name, tensor in bound.items():
        assert tensor.data_ptr() == graph.constants[name].ctypes.data, name


@pytest.mark.parametrize("model", ["tiny_bert", "tiny_mobilenet_v3"])
def test_no_backend_writes_into_the_models_constants(model: str) -> None:
    """Constants are shared with CpuAcc's workloads now: after a load and a run, every one the
    model file holds is still, bit for bit, what the file holds."""
    path = DATA / f"{model}.onnx"
    session = InferenceSession(str(path), backends=["CpuAcc", "CpuRef"])
    feeds = dict(np.load(DATA / f"{model}.npz"))
    inputs = {i.name: feeds[i.name] for i in session.get_inputs() if i.name in feeds}
    if len(inputs) == len(session.get_inputs()):
        session.run(None, inputs)
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    checked = 0
    for name, value in session.optimized.graph.constants.items():
        if name in stored and value.dtype.kind == "f":
            assert value.tobytes() == stored[name].tobytes(), name
            checked += 1
    assert checked


def two_convs() -> onnx.ModelProto:
    """x (1, 4, 8, 8) -> Conv 3x3 (8) -> Relu -> Conv 3x3 (8) -> Relu: one OneDnnGraph on CpuAcc."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
             helper.make_node("Relu", ["c2"], ["y"], name="relu2")]
    return make_model(nodes, [float_input("x", [1, 4, 8, 8])], [float_input("y", [1, 8, 8, 8])],
                      [_const("w1", 8, 4, 3, 3), _const("b1", 8), _const("w2", 8, 8, 3, 3),
                       _const("b2", 8)])


@pytest.mark.parametrize("compile_", ["layers", "onednn_graph"])
def test_the_report_counts_a_partitions_own_intermediates_and_constants(compile_: str) -> None:
    model = two_convs()
    session = _session(model, **{"CpuAcc.compile": compile_})
    assert [lay.op_type for lay in session.optimized.graph.layers
            if lay.op_type != "MemImport"] == ["OneDnnGraph"]
    report = session.report
    activation = 1 * 8 * 8 * 8 * 4  # r1 inside, then y, both alive while conv2 writes y
    assert report.peak_bytes == {"CpuAcc": 2 * activation}
    weights = sum(t.nbytes for t in (numpy_helper.to_array(i) for i in model.graph.initializer))
    assert report.constant_bytes == {"CpuAcc": weights}
    cpuref = InferenceSession(model, backends=["CpuRef"]).report
    assert cpuref.constant_bytes == {"CpuRef": weights}
