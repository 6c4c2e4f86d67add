"""CpuAcc's NonMaxSuppression (its greedy walk on the host, its overlaps in NumPy for CPU tensors)
against CpuRef's, box for box: many boxes and classes, both box encodings, thresholds given or not,
and NaN scores, which both sort last. Its NumPy form (a detector's HostChain's first step) gives
the same rows in every case."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels import nms as reference  # noqa: E402
from backplane.backends.torch.kernels import indexing, nms  # noqa: E402


def _boxes(rng: np.random.Generator, batch: int, count: int) -> np.ndarray:
    corner = rng.uniform(0, 32, (batch, count, 2))
    size = rng.uniform(0.5, 12, (batch, count, 2))
    return np.concatenate([corner, corner + size], axis=-1).astype(np.float32)


def _both(boxes: np.ndarray, scores: np.ndarray, *extra: np.ndarray | None, center: int = 0,
          ) -> tuple[np.ndarray, np.ndarray]:
    expected = reference.non_max_suppression(boxes, scores, *extra, center_point_box=center)[0]
    given = [None if e is None else torch.from_numpy(e) for e in extra]
    got = indexing.non_max_suppression(torch.from_numpy(boxes), torch.from_numpy(scores), *given,
                                       center_point_box=center)[0]
    assert got.dtype == torch.int64
    on_host = nms.host_non_max_suppression(boxes, scores, *extra, center_point_box=center)[0]
    assert on_host.dtype == np.int64 and on_host.shape == tuple(got.shape)
    np.testing.assert_array_equal(on_host, got.numpy())
    return expected, got.numpy()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("center", [0, 1])
def test_many_boxes_match_cpuref(seed: int, center: int) -> None:
    rng = np.random.default_rng(seed)
    boxes, scores = _boxes(rng, 2, 40), rng.uniform(0, 1, (2, 3, 40)).astype(np.float32)
    scores[0, 1, 5:9] = scores[0, 1, 4]  # equal scores: the lower box index first
    limit = np.array([int(rng.integers(1, 50))], np.int64)
    iou = np.array([rng.uniform(0.1, 0.7)], np.float32)
    threshold = np.array([rng.uniform(0.0, 0.5)], np.float32) if seed % 2 else None
    expected, got = _both(boxes, scores, limit, iou, threshold, center=center)
    assert len(expected) > 0
    np.testing.assert_array_equal(got, expected)


def test_nan_scores_sort_last_as_on_cpuref() -> None:
    rng = np.random.default_rng(7)
    boxes = _boxes(rng, 1, 12)
    scores = rng.uniform(0, 1, (1, 2, 12)).astype(np.float32)
    scores[0, 0, [2, 7]] = np.nan
    expected, got = _both(boxes, scores, np.array([12], np.int64), np.array([0.3], np.float32))
    assert (expected[:, 2] == 2).any()  # the NaN boxes are kept, after the others
    np.testing.assert_array_equal(got, expected)


def test_no_limit_no_boxes() -> None:
    rng = np.random.default_rng(3)
    expected, got = _both(_boxes(rng, 1, 5), rng.uniform(0, 1, (1, 1, 5)).astype(np.float32))
    assert expected.shape == got.shape == (0, 3)


@pytest.mark.parametrize("count", [63, 64, 65, 200])
def test_overlap_rows_past_one_word_match_cpuref(count: int) -> None:
    """The walk's overlap rows are Python ints: one uint64 up to 64 boxes, several words past."""
    rng = np.random.default_rng(count)
    boxes = _boxes(rng, 2, count)
    scores = rng.uniform(0, 1, (2, 2, count)).astype(np.float32)
    expected, got = _both(boxes, scores, np.array([count], np.int64), np.array([0.2], np.float32),
                          np.array([0.3], np.float32))
    assert len(expected) > 2
    np.testing.assert_array_equal(got, expected)


def test_score_threshold_with_nan_and_ties_matches_cpuref() -> None:
    """Below the threshold or NaN ends a class's walk: the scores after are not above it."""
    rng = np.random.default_rng(11)
    boxes = _boxes(rng, 1, 20)
    scores = rng.uniform(0, 1, (1, 2, 20)).astype(np.float32)
    scores[0, 0, [1, 4]] = np.nan
    scores[0, 1, 3:8] = 0.5  # ties at the threshold's side
    for threshold in (0.5, 0.49, 0.0):
        expected, got = _both(boxes, scores, np.array([20], np.int64), np.array([0.4], np.float32),
                              np.array([threshold], np.float32))
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("count", [5, 8, 16, 32, 40])
def test_rows_of_one_two_four_and_eight_bytes_match_cpuref(count: int) -> None:
    """A row of 8, 16, 32 or 64 overlap bits is read as one word of its own width; others padded."""
    rng = np.random.default_rng(100 + count)
    boxes = _boxes(rng, 2, count)
    scores = rng.uniform(0, 1, (2, 3, count)).astype(np.float32)
    expected, got = _both(boxes, scores, np.array([count], np.int64), np.array([0.1], np.float32))
    assert len(expected) > 2 * 3
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("center", [0, 1])
def test_nan_flipped_and_empty_boxes_match_cpuref(center: int) -> None:
    """NaN coordinates overlap nothing; corners in either order; a box of no area overlaps nothing."""
    rng = np.random.default_rng(21)
    boxes = _boxes(rng, 1, 24)
    boxes[0, 3:6] = boxes[0, 3:6][:, [2, 3, 0, 1]]  # the opposite corners first
    boxes[0, 7, 1] = np.nan
    boxes[0, 9, 2:] = boxes[0, 9, :2]  # a point
    boxes[0, 10:12] = boxes[0, 0]  # copies of box 0: suppressed by it
    scores = rng.uniform(0, 1, (1, 2, 24)).astype(np.float32)
    expected, got = _both(boxes, scores, np.array([24], np.int64), np.array([0.25], np.float32),
                          center=center)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("threshold", [-0.25, 0.0, 0.3, 1.0])
def test_iou_thresholds_at_and_below_zero_and_at_one_match_cpuref(threshold: float) -> None:
    """Boxes that do not overlap have an IoU of 0: one below a negative threshold suppresses them
    too (only each class's best box is left), at 0 it does not; crossed and apart boxes, both
    encodings."""
    rng = np.random.default_rng(7)
    boxes, scores = _boxes(rng, 2, 30), rng.uniform(0, 1, (2, 3, 30)).astype(np.float32)
    boxes[:, ::3] = boxes[:, ::3][..., [2, 3, 0, 1]]  # corners given the other way round
    for center in (0, 1):
        expected, got = _both(boxes, scores, np.array([30], np.int64),
                              np.array([threshold], np.float32), center=center)
        np.testing.assert_array_equal(got, expected)
        if threshold < 0:
            assert expected.shape == (6, 3)


def test_a_nan_iou_threshold_keeps_one_box_per_class_as_cpuref() -> None:
    """No IoU is at or under a NaN threshold: each class's best box suppresses all the others."""
    rng = np.random.default_rng(5)
    boxes, scores = _boxes(rng, 2, 10), rng.uniform(0, 1, (2, 3, 10)).astype(np.float32)
    expected, got = _both(boxes, scores, np.array([10], np.int64), np.array([np.nan], np.float32))
    assert expected.shape == (6, 3)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("center", [0, 1])
def test_overlaps_in_torch_equal_numpys(center: int) -> None:
    """The overlaps of boxes off the host (a GPU's, bfloat16) are torch's calls: the same values."""
    from backplane.backends.torch.kernels import nms

    rng = np.random.default_rng(8 + center)
    boxes = _boxes(rng, 2, 30)
    boxes[1, 4, 0] = np.nan
    for limit in (0.2, 0.6):
        in_numpy = nms._suppressing(boxes, center, limit, np)
        in_torch = nms._suppressing(torch.from_numpy(boxes), center, limit, torch)
        assert in_numpy.any() and not in_numpy.all()
        np.testing.assert_array_equal(in_torch.numpy(), in_numpy)


def test_many_boxes_with_a_threshold_walk_their_candidates_alone(monkeypatch) -> None:
    """Past 64 boxes with a score threshold, each batch item's overlaps are its candidates' (the
    boxes above the threshold in some class), not every pair's (8400 boxes: 560 MB an array);
    the rows are CpuRef's, ties and NaN scores among them, in both forms."""
    rng = np.random.default_rng(11)
    boxes = _boxes(rng, 2, 2000)
    scores = rng.uniform(0, 1, (2, 4, 2000)).astype(np.float32) ** 8  # few above 0.5
    scores[0, 1, 5:9] = 0.75  # equal scores: the lower box index first
    scores[1, 2, 17] = np.nan  # never above a threshold
    seen: list[tuple[int, ...]] = []
    suppressing = nms._suppressing
    monkeypatch.setattr(nms, "_suppressing",
                        lambda b, *a: seen.append(b.shape) or suppressing(b, *a))
    given = (np.array([50], np.int64), np.array([0.2], np.float32), np.array([0.5], np.float32))
    expected, got = _both(boxes, scores, *given)
    np.testing.assert_array_equal(got, expected)
    candidates = [int((scores[b] > 0.5).any(0).sum()) for b in range(2)]
    assert expected.shape[0] > 20 and seen and all(shape[0] == 1 for shape in seen)
    assert sorted({shape[1] for shape in seen}) == sorted(set(candidates)), (seen, candidates)
    seen.clear()  # boxes off the host (a GPU's, bfloat16): torch's overlaps, of the same few
    iou = float(given[1][0])
    in_torch = nms._on_host(torch.from_numpy(boxes), scores, 0, iou, 50, 0.5, torch)
    np.testing.assert_array_equal(in_torch, expected)
    assert sorted({shape[1] for shape in seen}) == sorted(set(candidates)), (seen, candidates)
