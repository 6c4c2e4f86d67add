"""A Traced layer's shape reads are constants of its frozen graph (``fusion/static_sizes.py``): the
size arithmetic a kernel does (a Conv1d's output length, a reshape of a constant weight by it) is
done once at the build, not at every run, each chain of views is one view, and the trace computes
what the layers compute."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion.static_sizes import (  # noqa: E402
    VIEWS,
    fold_sizes,
    fold_views,
)
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(5)
SHAPE_OPS = {"aten::size", "prim::NumToTensor", "aten::floor_divide", "aten::Int", "aten::dim",
             "aten::numel"}
WEIGHT = torch.randn(6, 2 * 4)


def _framed(x: torch.Tensor) -> torch.Tensor:
    """A Conv1d of kernel 4, stride 2 as CpuAcc's product writes it: the output length from the
    input's, windows by as_strided, the weight reshaped by sizes read from the input."""
    channels, length = x.shape[1], x.shape[2]
    out = (length - 4) // 2 + 1
    windows = x.as_strided((x.shape[0], out, channels, 4), (x.stride(0), 2, x.stride(1), 1))
    weight = WEIGHT.reshape(6, channels * 4)
    y = torch.nn.functional.linear(windows.reshape(x.shape[0], out, channels * 4), weight)
    return y.reshape(x.numel() // (channels * length), -1) * x.dim()


def _kinds(graph) -> set[str]:
    return {node.kind() for node in graph.nodes()}


def test_shape_reads_and_their_arithmetic_fold() -> None:
    sample = torch.randn(1, 2, 11)
    traced = torch.jit.trace(_framed, (sample,))
    assert {"aten::size", "aten::floor_divide"} <= _kinds(traced.graph)  # as traced
    replaced = fold_sizes(traced.graph)
    assert replaced >= 4 and not SHAPE_OPS & _kinds(traced.graph)
    # the weight's reshape folded too: no op of the graph reads the weight any more
    assert sum(node.kind() == "aten::reshape" for node in traced.graph.nodes()) == 2
    other = torch.randn(1, 2, 11)
    other[0, 1, 5] = float("nan")
    got, want = traced(other), _framed(other)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).any()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_a_size_given_at_run_time_is_kept() -> None:
    """A dimension the graph computes (not a constant of it) is left as the trace has it."""
    unit = torch.jit.CompilationUnit("def f(x: Tensor, d: int) -> int:\n    return x.size(d)\n")
    graph = unit.f.graph
    next(graph.inputs()).setType(torch._C.TensorType.create_from_tensor(torch.zeros(2, 3)))
    assert fold_sizes(graph) == 0 and "aten::size" in _kinds(graph)


def _vad(length: int = 96, hidden: int = 8) -> onnx.ModelProto:
    """x (1, length) -> Unsqueeze -> Conv1d (8 channels, kernel 16, stride 8, pads 4) -> Relu ->
    Conv1d (4, kernel 3, pads 1) -> ReduceMean over time -> Unsqueeze -> LSTM, one step -> Y_h:
    the corpus VAD's pattern (oneDNN Graph takes no LSTM: a Traced layer)."""
    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((RNG.standard_normal(shape) * 0.2).astype(np.float32), name)

    inits = [weight("w1", 8, 1, 16), weight("b1", 8), weight("w2", 4, 8, 3), weight("b2", 4),
             weight("W", 1, 4 * hidden, 4), weight("R", 1, 4 * hidden, hidden),
             weight("B", 1, 8 * hidden), numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([0], np.int64), "zero")]
    nodes = [helper.make_node("Unsqueeze", ["x", "one"], ["u"]),
             helper.make_node("Conv", ["u", "w1", "b1"], ["c1"], kernel_shape=[16], strides=[8],
                              pads=[4, 4]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("ReduceMean", ["r2"], ["m"], axes=[2], keepdims=0),
             helper.make_node("Unsqueeze", ["m", "zero"], ["steps"]),
             helper.make_node("LSTM", ["steps", "W", "R", "B"], ["", "y"], hidden_size=hidden)]
    return make_model(nodes, [float_input("x", [1, length])], [float_input("y", [1, 1, hidden])],
                      inits, opset=17)


def test_a_traced_conv1d_front_end_reads_no_size(monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    model = _vad()
    session = InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.compile": "onednn_graph", "CpuAcc.route_cache": False})))
    loaded = session.runtime.network(session.network_id)
    (workload,) = [getattr(step.workload, "work", step.workload)
                   for step, layer in zip(loaded.steps, loaded.layers) if layer.op_type == "Traced"]
    assert not SHAPE_OPS & _kinds(workload.module.graph)
    x = RNG.standard_normal((1, 96)).astype(np.float32)
    x[0, 50] = np.nan  # the windows over it NaN, through both convolutions
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _views(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The VAD's views: a state row through an Unsqueeze and a Squeeze (back as it was), the other
    row (at another offset), a transposed reshape (one view), one that copies, and an output that
    is the input as it was."""
    first = state.select(0, 0).reshape(1, 1, 8).select(0, 0)
    second = state.select(0, 1).reshape(1, 1, 8).select(0, 0)
    turned = x.t().reshape(8, 1)
    copied = x.unsqueeze(0).expand(2, 1, 8).reshape(2, 8)
    return first * second + x.unsqueeze(0).reshape(1, 8), turned * 2, copied + 1, \
        x.unsqueeze(0).reshape(1, 8)


def test_chains_of_views_fold_to_one() -> None:
    sample = (torch.randn(1, 8), torch.randn(2, 1, 8))
    traced = torch.jit.trace(_views, sample)
    before = sum(node.kind() in VIEWS for node in traced.graph.nodes())
    assert fold_views(traced.graph) >= 4
    kinds = [node.kind() for node in traced.graph.nodes()]
    # 14 -> 6: the copy's two stay; the second row (at another offset) is its first select
    assert (before, sum(kind in VIEWS for kind in kinds)) == (14, 6)
    assert kinds.count("aten::as_strided") == 3  # the first row, the turned one, the output
    assert kinds.count("aten::select") == 1  # fails before: the second row kept its three views
    for _ in range(3):  # other values, NaN in one: the folded graph computes what the views did
        x, state = torch.randn(1, 8), torch.randn(2, 1, 8)
        state[1, 0, 3] = float("nan")
        got, want = traced(x, state), _views(x, state)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        assert got[3] is not x and got[3].data_ptr() == x.data_ptr()  # a view of its own
