"""A detector's NonMaxSuppression overlaps computed in its whole run's graph (``gpu_nms``): the
words are the host's bit rows, the selections on them CpuRef's, box for box; on CUDA the one
kernel's decision equals torch's kernels' and a detector's whole run matches CpuRef. The form
checks run on any machine (torch's kernels, as where jiterator cannot run); the CUDA ones skip
without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels.nms import non_max_suppression as cpuref_nms  # noqa: E402
from backplane.backends.torch import cuda_host, gpu_nms  # noqa: E402
from backplane.backends.torch.kernels import nms  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
MASK = (1 << 64) - 1


def _boxes(rng: np.random.Generator, batch: int, count: int, odd: bool) -> np.ndarray:
    """Boxes of a detector's scale, many overlapping, some repeated; with ``odd`` NaN, infinities
    and empty boxes too."""
    corner = rng.uniform(0, 40, (batch, count, 2)).astype(np.float32)
    size = rng.uniform(-4, 20, (batch, count, 2)).astype(np.float32)
    boxes = np.concatenate([corner, corner + size], -1)
    boxes[:, count // 2:count // 2 + 2] = boxes[:, :2]  # ties
    if odd:
        flat = boxes.reshape(-1)
        at = rng.choice(flat.size, 6, replace=False)
        flat[at] = [np.nan, np.inf, -np.inf, 0.0, np.nan, 5.0]
        boxes[:, -1, 2:] = boxes[:, -1, :2]  # an empty box
    return boxes


def _host_words(boxes: np.ndarray, centre: int, limit: float) -> list[list[int]]:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinite corners
        return nms._bit_rows(nms._suppressing(boxes, centre, limit, np))


@pytest.mark.parametrize("count", [1, 7, 32, 63, 64])
@pytest.mark.parametrize("centre", [0, 1])
@pytest.mark.parametrize("limit", [0.5, 0.0, -0.25, 0.9])
def test_the_words_are_the_host_s_bit_rows(count: int, centre: int, limit: float) -> None:
    rng = np.random.default_rng(count * 10 + centre)
    for odd in (False, True):
        boxes = _boxes(rng, 2, count, odd)
        words = gpu_nms.device_rows(torch.from_numpy(boxes), centre, limit)  # torch's kernels
        assert words.dtype == torch.int64 and tuple(words.shape) == (2, count)
        got = [[w & MASK for w in row] for row in words.tolist()]  # bit 63: a negative int
        assert got == _host_words(boxes, centre, limit)


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_the_selections_on_the_words_are_cpuref_s(threshold: float | None) -> None:
    rng = np.random.default_rng(5)
    for count, classes, limit in [(64, 1, 2**62), (32, 3, 20), (17, 2, 4), (64, 2, 64)]:
        boxes = _boxes(rng, 2, count, odd=False)
        scores = rng.uniform(0, 1, (2, classes, count)).astype(np.float32)
        scores[:, :, 3] = scores[:, :, 5]  # equal scores: the lower box first
        scores[0, 0, 9] = np.nan
        words = gpu_nms.device_rows(torch.from_numpy(boxes), 0, 0.45).numpy()
        kernel = gpu_nms.rows_kernel(lambda: words)
        extra = () if threshold is None else (np.float32([threshold]),)
        args = (boxes, scores, np.int64([limit]), np.float32([0.45]), *extra)
        (got,) = kernel(*args, center_point_box=0)
        (want,) = cpuref_nms(*args)
        (host,) = nms.host_non_max_suppression(*args)
        assert got.dtype == np.int64 and got.shape[1:] == (3,) and len(got) > 0
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, host)
    empty = np.zeros((1, 1, 0), np.float32)
    (none,) = gpu_nms.rows_kernel(lambda: np.zeros((1, 0), np.int64))(
        np.zeros((1, 0, 4), np.float32), empty, np.int64([5]))
    assert none.shape == (0, 3) and none.dtype == np.int64


@cuda
@pytest.mark.parametrize("centre", [0, 1])
def test_the_kernel_decides_as_torch_s_kernels(centre: int) -> None:
    rng = np.random.default_rng(11)
    for count, limit in [(64, 0.5), (33, 0.0), (8, -0.1), (64, 0.7)]:
        boxes = torch.from_numpy(_boxes(rng, 3, count, odd=True)).cuda()
        words = gpu_nms.device_rows(boxes, centre, limit)
        want = (nms._suppressing(boxes, centre, limit, torch).to(torch.int64)
                * gpu_nms._weights(count, boxes.device)).sum(-1)
        assert torch.equal(words, want)
        host = [[w & MASK for w in row] for row in words.tolist()]
        assert host == _host_words(boxes.cpu().numpy(), centre, limit)
    assert gpu_nms.gpu_jit._made.get(gpu_nms.OVERLAPS), "jiterator made no kernel: torch's ran"


@cuda
@pytest.mark.parametrize("model", ["detect_nms_dyn21", "detect_nms_ts14"])
def test_a_detector_s_whole_run_takes_the_words_from_its_graph(model: str,
                                                              monkeypatch) -> None:
    from backplane import InferenceSession

    path = str(CORPUS / f"{model}.onnx")
    feeds = dict(np.load(CORPUS / f"{model}.s0.npz"))
    want = InferenceSession(path, providers=["CpuRef"]).run(None, feeds)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(cuda_host, "NMS_ON_DEVICE", on)
        session = InferenceSession(path, providers=[("GpuAcc", {"against_cpu": "off"}),
                                                    "CpuAcc", "CpuRef"])
        runs = session.runtime.network(session.network_id).host_runs
        results[on] = [session.run(None, feeds), session.run(None, feeds)]
        (built,) = runs.built.values()
        assert isinstance(built, cuda_host.HostTail)
        assert len(built.graph.host_out) == built.width + on  # the words: one more output
        session.close()
    for got in (*results[True], *results[False]):
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    for g, w in zip(results[True][0], results[False][0]):
        np.testing.assert_array_equal(g, w)
