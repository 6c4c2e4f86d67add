"""The copies and waits of GpuAcc's whole runs (torch/cuda_host.py): outputs of several types and
layouts written to the host through one kernel per type (``download``) or copied, the wait on
the stream the caller made current, one warm-up stream for every capture (no cuBLAS workspace
kept per graph), and a static partition's two captures sharing one memory pool. CUDA only:
skipped without a device."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
RNG = np.random.default_rng(28)
GPU = [("GpuAcc", {"against_cpu": "off"}), "CpuRef"]


def _model(batch: int | str = "N", size: int = 8, products: int = 1) -> object:
    """x (batch, size) -> y = relu(x @ w ...), its argmax (int64), y > 0 (bool), y as float16 and
    y transposed: five outputs of four types."""
    w = numpy_helper.from_array((RNG.standard_normal((size, size)) / size ** 0.5)
                                .astype(np.float32), "w")
    nodes, last = [], "x"
    for i in range(products):
        nodes.append(helper.make_node("MatMul", [last, "w"], [f"m{i}"]))
        last = f"m{i}"
    nodes += [helper.make_node("Relu", [last], ["y"]),
              helper.make_node("ArgMax", ["y"], ["arg"], axis=1, keepdims=0),
              helper.make_node("Greater", ["y", "zero"], ["pos"]),
              helper.make_node("Cast", ["y"], ["half"], to=TensorProto.FLOAT16),
              helper.make_node("Transpose", ["y"], ["yt"], perm=[1, 0])]
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, size]),
           helper.make_tensor_value_info("arg", TensorProto.INT64, [batch]),
           helper.make_tensor_value_info("pos", TensorProto.BOOL, [batch, size]),
           helper.make_tensor_value_info("half", TensorProto.FLOAT16, [batch, size]),
           helper.make_tensor_value_info("yt", TensorProto.FLOAT, [size, batch])]
    graph = helper.make_graph(nodes, "outputs", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [batch, size])], out, [w, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _graphs(session):  # noqa: ANN001, ANN202
    from backplane.backends.torch.cuda_host import HostRuns

    runs = session.runtime.network(session.network_id).host_runs
    assert isinstance(runs, HostRuns)  # the network runs whole
    return [g for g in runs.built.values() if g is not None]


def _check(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3,
                                   atol=1e-3)


def test_outputs_of_every_type_come_back_through_their_device_views() -> None:
    from backplane import InferenceSession

    model = _model()
    session, reference = InferenceSession(model, providers=GPU), \
        InferenceSession(model, providers=["CpuRef"])
    kept = []
    for batch in (2, 5, 2):
        x = RNG.standard_normal((batch, 8)).astype(np.float32)
        got = session.run(None, {"x": x})
        _check(got, reference.run(None, {"x": x}))
        kept.append(([g.copy() for g in got], got))
    for copies, got in kept:  # each run's outputs its own: later runs changed none
        for c, g in zip(copies, got):
            np.testing.assert_array_equal(c, g)
    graph = _graphs(session)[0]
    assert sum(view is not None for view in graph.mapped_out) == 5
    assert _downloads(graph) < 5  # the dense outputs by kernels, not a copy each


def _downloads(graph) -> int:  # noqa: ANN001
    """Copies to the host in one replay of ``graph`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.graph.replay()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "DtoH" in e.key)


def test_a_run_waits_for_the_stream_its_caller_made_current() -> None:
    """The replay runs on the caller's current stream: the run must wait for that one. With
    products long enough to be unfinished at once, a wait on another stream reads old values."""
    from backplane import InferenceSession

    model = _model(batch=512, size=512, products=6)
    session, reference = InferenceSession(model, providers=GPU), \
        InferenceSession(model, providers=["CpuRef"])
    first = RNG.standard_normal((512, 512)).astype(np.float32)
    session.run(None, {"x": first})  # built on the default stream
    other = torch.cuda.Stream()
    for _ in range(3):
        x = RNG.standard_normal((512, 512)).astype(np.float32)
        with torch.cuda.stream(other):
            got = session.run(None, {"x": x})
        _check(got[:1], reference.run(None, {"x": x})[:1])


def test_every_capture_warms_up_on_one_stream() -> None:
    """torch keeps a cuBLAS workspace for each stream a product ran on: a warm-up stream per
    capture kept one per signature (32 MiB each on an H100)."""
    from backplane import InferenceSession
    from backplane.backends.torch import cuda_host

    session = InferenceSession(_model(), providers=GPU)
    session.run(None, {"x": RNG.standard_normal((1, 8)).astype(np.float32)})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for batch in (2, 3, 4):
        session.run(None, {"x": RNG.standard_normal((batch, 8)).astype(np.float32)})
    torch.cuda.synchronize()
    assert len(_graphs(session)) == 4
    assert torch.cuda.memory_allocated() - before < 1 << 20
    assert len(cuda_host.WARM_UP_STREAMS) == 1


def test_a_static_partition_s_two_captures_share_a_pool_and_stay_right() -> None:
    """A static model's partition is captured at load (the network's CapturedGraph, run for
    device inputs) and again with the copies (the whole run) into the same memory pool: runs of
    either kind, interleaved, give CpuRef's values."""
    from backplane import InferenceSession

    model = _model(batch=3, size=64, products=3)
    session, reference = InferenceSession(model, providers=GPU), \
        InferenceSession(model, providers=["CpuRef"])
    for _ in range(3):
        x = RNG.standard_normal((3, 64)).astype(np.float32)
        want = reference.run(None, {"x": x})
        _check(session.run(None, {"x": x}), want)
        on_device = session.run(None, {"x": torch.from_numpy(x).cuda()})
        _check([np.asarray(o.cpu() if hasattr(o, "cpu") else o) for o in on_device], want)
    (graph,) = _graphs(session)
    runs = session.runtime.network(session.network_id).host_runs
    assert graph.graph.pool() == runs.source.graph.pool()
