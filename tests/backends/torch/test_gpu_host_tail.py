"""A detector's run on GpuAcc as one CUDA graph and its host chain (``cuda_host.HostTail``): the
build of a CudaGraph layer and the NonMaxSuppression's HostChain after it runs whole from host
memory, its outputs CpuRef's, each run's its own. The form checks run on any machine; the runs
skip without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch import cuda_host  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class _Graph:
    """A HostGraph's stand-in: its outputs' host buffers, overwritten at each call."""

    reads = [0]

    def __init__(self) -> None:
        self.out = [np.zeros(3, np.float32), np.zeros(2, np.int64)]
        self.closed = False

    def __call__(self, args):
        self.out[0][:] = args[0]
        self.out[1][:] = [7, 8]
        return self.out

    def close(self) -> None:
        self.closed = True


def test_the_tail_reads_the_graph_s_buffers_and_orders_the_outputs() -> None:
    graph = _Graph()
    seen = []

    def chain(boxes, kept):
        seen.append((boxes.dtype, kept.dtype))
        return (boxes[1:] * 2, kept)  # a result may be a view of a buffer

    tail = cuda_host.HostTail(graph, chain, [0, 1], [3, 0, 2], 2)  # the chain's 2nd, graph's 1st
    got = tail([np.float32([1, 2, 3])])
    assert seen == [(torch.float32, torch.int64)] and tail.reads == [0]
    np.testing.assert_array_equal(got[0], [7, 8])
    np.testing.assert_array_equal(got[1], [1, 2, 3])
    np.testing.assert_array_equal(got[2], [4, 6])
    tail.close()
    assert graph.closed


@cuda
@pytest.mark.parametrize("model", ["detect_nms_dyn21", "detect_nms_ts14"])
def test_a_detector_runs_whole_with_its_host_chain_and_matches_cpuref(model: str) -> None:
    from backplane import InferenceSession

    path = str(CORPUS / f"{model}.onnx")
    feeds = dict(np.load(CORPUS / f"{model}.s0.npz"))
    want = InferenceSession(path, providers=["CpuRef"]).run(None, feeds)
    session = InferenceSession(path, providers=[("GpuAcc", {"against_cpu": "off"}), "CpuAcc",
                                                "CpuRef"])
    runs = session.runtime.network(session.network_id).host_runs
    assert isinstance(runs, cuda_host.HostRuns)
    first = session.run(None, feeds)
    (built,) = runs.built.values()
    assert isinstance(built, cuda_host.HostTail)
    second = session.run(None, feeds)
    for got in (first, second):  # the first run's outputs kept: the second overwrote no buffer
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    session.close()
    assert runs.kept.closed and not runs.built
