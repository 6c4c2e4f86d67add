"""Whole runs for every network a backend offers one for (``loaded_network.whole_run``, GpuAcc's
``cuda_host.HostRuns``), and GpuAcc's small layers (``gpu_small``), checked on any machine: the
hook takes the run and its graphs are closed with the session, explicitly or when it is
collected; ``io_map`` leaves outputs kept on the device alone; the Conv1d and one-row Gemm forms
against torch's conv1d and product. On CUDA: a one-partition GpuAcc model runs whole and matches
CpuRef, the one-step LSTM runs torch's fused cell, graphs closed during a capture wait for it."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane.backends.torch.cuda_host import Built, io_map
from backplane.ir.graph import Graph, Layer, TensorInfo

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
RNG = np.random.default_rng(9)


def _mlp() -> object:
    w = numpy_helper.from_array(RNG.standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class _Graph:
    """Stands for a HostGraph in ``Built``: counts its closes."""

    closes = 0

    def close(self) -> None:
        _Graph.closes += 1


class _Runs:
    """A whole run as a backend offers it: through the network, counted, its graphs in ``kept``."""

    def __init__(self, through: object) -> None:
        self.through, self.calls, self.kept = through, 0, Built()
        self.kept.graphs[("signature",)] = _Graph()

    def __call__(self, values: list) -> list:
        self.calls += 1
        return self.through(values)  # type: ignore[operator]


@pytest.fixture
def offered(monkeypatch: pytest.MonkeyPatch) -> list[_Runs]:
    """CpuAcc offering a whole run of every network it loads (GpuAcc's hook, without a GPU)."""
    from backplane.backends.torch.backend import CpuAcc

    made: list[_Runs] = []

    def host_run(self: object, network: object) -> _Runs:
        made.append(_Runs(network.execute))  # type: ignore[attr-defined]
        return made[-1]

    monkeypatch.setattr(CpuAcc, "host_run", host_run, raising=False)
    _Graph.closes = 0
    return made


def test_a_backend_s_whole_run_is_the_network_s_run_and_closes_with_it(offered) -> None:
    from backplane import InferenceSession

    model = _mlp()
    session = InferenceSession(model, providers=["CpuAcc", "CpuRef"])
    reference = InferenceSession(model, providers=["CpuRef"])
    (runs,) = offered
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    x[0, 1] = np.nan
    for _ in range(3):
        got = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, reference.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert runs.calls == 3 and np.isnan(got[0]).all() == np.isnan(x[0] @ np.ones((8, 4))).all()
    session.close()
    assert runs.kept.closed and not runs.kept.graphs and _Graph.closes == 1
    assert runs(  # closed: a run still goes through the network (it is the caller's to refuse)
        [x])[0].shape == (2, 4)


def test_a_dropped_session_s_graphs_close_when_it_is_collected(offered) -> None:
    from backplane import InferenceSession

    session = InferenceSession(_mlp(), providers=["CpuAcc", "CpuRef"])
    session.run(None, {"x": np.ones((2, 8), np.float32)})
    kept = offered[0].kept
    del session, offered[:]
    gc.collect()
    assert kept.closed and _Graph.closes == 1  # no cycle from the finalizer back to the network


def test_no_whole_run_under_the_debug_trace(offered, monkeypatch: pytest.MonkeyPatch) -> None:
    from backplane import InferenceSession, debug

    monkeypatch.setattr(debug, "level", lambda: 2)
    session = InferenceSession(_mlp(), providers=["CpuAcc", "CpuRef"])
    assert not offered and session.runtime.network(session.network_id).host_runs is None


def _handed(keep_on_device: bool) -> Graph:
    """x handed to one GpuAcc partition; its output handed back to the host, or left on the
    device (an If's branch whose result GpuAcc layers read)."""
    def layer(name: str, op: str, inputs: list[str], outputs: list[str], backend: str) -> Layer:
        made = Layer(name, op, inputs, outputs, {}, "backplane.torch" if backend == "GpuAcc"
                     else "", 1)
        made.backend = backend
        return made

    layers = [layer("in", "MemImport", ["x"], ["x@G"], "builtin"),
              layer("part", "CudaGraph", ["x@G"], ["y"], "GpuAcc")]
    if not keep_on_device:
        layers.append(layer("out", "MemCopy", ["y"], ["y@host"], "builtin"))
    names = {n for lay in layers for n in (*lay.inputs, *lay.outputs)}
    return Graph("g", layers, ["x"], ["y" if keep_on_device else "y@host"],
                 {n: TensorInfo((1,), np.dtype(np.float32)) for n in names})


def test_io_map_leaves_an_output_kept_on_the_device_to_the_network() -> None:
    assert io_map(_handed(False), ["x"]) is not None
    assert io_map(_handed(True), ["x"]) is None


@pytest.mark.parametrize("case", [  # in, out, length, kernel, stride, dilation, pads, batch
    (1, 258, 576, 256, 128, 1, (64, 64), 1),  # the full-tier VAD's front end
    (258, 128, 4, 3, 1, 1, (1, 1), 1),  # its encoder
    (258, 128, 4, 3, 1, 1, (1, 1), 2),
    (30, 50, 20, 3, 2, 2, (0, 1), 3),
    (40, 60, 9, 2, 1, 3, (2, 0), 1)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_product_is_torch_s_conv1d(case: tuple, relu: bool, bias: bool) -> None:
    import torch.nn.functional as F

    from backplane.backends.torch.gpu_small import conv1d_product

    c_in, c_out, length, k, stride, dilation, pads, batch = case
    x, w, b = (torch.from_numpy(RNG.standard_normal(shape).astype(np.float32))
               for shape in ((batch, c_in, length), (c_out, c_in, k), (c_out,)))
    x[0, 0, 0] = float("nan")  # NaN in, NaN out where a window reads it, through the Relu too
    got = conv1d_product(x, w, b if bias else None, (k, stride, dilation, *pads), relu)
    want = F.conv1d(F.pad(x.double(), pads), w.double(), b.double() if bias else None,
                    stride=stride, dilation=dilation).float()
    want = torch.relu(want) if relu else want
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3, equal_nan=True)


def _lstm_model(hidden: int = 16, inputs: int = 8, batch: int = 1) -> object:
    """x (1, batch, inputs) -> LSTM (one step, biases, initial states) -> Y_h, Y_c, and Y + 1
    (Y read inside the graph)."""
    w, r, b = (RNG.standard_normal(s).astype(np.float32) * 0.3
               for s in ((1, 4 * hidden, inputs), (1, 4 * hidden, hidden), (1, 8 * hidden)))
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (r, "R"), (b, "B"))]
    inits.append(numpy_helper.from_array(np.ones((1,), np.float32), "one"))
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "yh", "yc"],
                              hidden_size=hidden),
             helper.make_node("Add", ["y", "one"], ["y1"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "lstm", [
        helper.make_tensor_value_info("x", f, [1, batch, inputs]),
        helper.make_tensor_value_info("h0", f, [1, batch, hidden]),
        helper.make_tensor_value_info("c0", f, [1, batch, hidden])], [
        helper.make_tensor_value_info(n, f, None) for n in ("yh", "yc", "y1")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


@cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_one_step_lstm_on_the_gpu_is_cpuref_s(batch: int) -> None:
    from backplane import InferenceSession

    model = _lstm_model(batch=batch)
    session = InferenceSession(model, providers=[("GpuAcc", {"against_cpu": "off"}), "CpuRef"])
    reference = InferenceSession(model, providers=["CpuRef"])
    feeds = {"x": RNG.standard_normal((1, batch, 8)).astype(np.float32),
             "h0": RNG.standard_normal((1, batch, 16)).astype(np.float32),
             "c0": RNG.standard_normal((1, batch, 16)).astype(np.float32)}
    feeds["c0"][0, 0, 2] = np.nan
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = session.run(None, feeds)  # the first run: the whole run's warm-up calls the steps
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_thnn_fused_lstm_cell" in ops and "aten::lstm_cell" not in ops, sorted(ops)
    for _ in range(2):
        got = session.run(None, feeds)
        for g, w in zip(got, reference.run(None, feeds)):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)


@cuda
def test_a_one_partition_gpu_network_runs_whole_and_closes_with_its_session() -> None:
    from backplane import InferenceSession
    from backplane.backends.torch.cuda_host import HostGraph, HostRuns

    model = _mlp()
    session = InferenceSession(model, providers=[("GpuAcc", {"against_cpu": "off"}), "CpuRef"])
    reference = InferenceSession(model, providers=["CpuRef"])
    runs = session.runtime.network(session.network_id).host_runs
    assert isinstance(runs, HostRuns)
    outputs = []
    for _ in range(3):
        x = RNG.standard_normal((2, 8)).astype(np.float32)
        outputs.append((session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0]))
    for got, want in outputs:  # each run's output its own: the later runs changed none
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    (graph,) = runs.built.values()
    assert isinstance(graph, HostGraph) and len(graph.blocks) == 2  # the inputs in one copy
    session.close()
    assert runs.kept.closed and not runs.built and graph.graph is None


@cuda
def test_graphs_closed_during_a_capture_wait_for_its_end() -> None:
    """A network collected in the middle of another's capture (its finalizer) closes its graphs
    after it: destroying a graph during a capture aborts the process."""
    from backplane.backends.torch.cuda_host import release

    _Graph.closes = 0
    kept = Built()
    kept.graphs[("signature",)] = _Graph()
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        (x + 1).sum()
        kept.close()
        assert _Graph.closes == 0 and kept.closed
    release([])
    assert _Graph.closes == 1


@pytest.mark.parametrize("trans_b, c_shape", [(True, (1,)), (False, (1, 3)), (False, None),
                                              (True, (3,))])
def test_row_gemm_is_the_product(trans_b: bool, c_shape: tuple | None) -> None:
    from backplane.backends.torch.gpu_small import row_gemm

    columns = 1 if c_shape == (1,) else 3
    a = torch.from_numpy(RNG.standard_normal((1, 128)).astype(np.float32))
    b = torch.from_numpy(RNG.standard_normal((columns, 128) if trans_b else (128, columns))
                         .astype(np.float32))
    c = None if c_shape is None else torch.from_numpy(RNG.standard_normal(c_shape)
                                                      .astype(np.float32))
    a[0, 5] = float("nan") if columns == 3 else a[0, 5]
    got = row_gemm(a, b, c, trans_b)
    want = a.double() @ (b.double().t() if trans_b else b.double())
    want = (want if c is None else want + c.double()).float()
    assert got.shape == want.shape == (1, columns)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, equal_nan=True)
    assert bool(got.isnan().all()) == (columns == 3)
