"""ONNX NonMaxSuppression in one C call (``backplane/native/nms.py``) against CpuRef's kernel, row
for row, over hypothesis's boxes (overlapping ones, flipped corners, the centre encoding, equal
and NaN scores, NaN boxes, thresholds given or not, NaN and extreme IoU limits, limits 0 to past
the boxes); the corpus's detectors with the kernel in their HostChain (pinned by
``CpuAcc.native``) against CpuRef and ONNX Runtime; "off" and no compiler keep NumPy's.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_nms.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.reference.kernels import nms as reference  # noqa: E402
from backplane.native import build  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402
from backplane.native import nms as in_c  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

needs_library = pytest.mark.skipif(not build.available("nms"),
                                   reason="no native nms library (no C compiler)")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"


@pytest.fixture
def calls(monkeypatch):
    """The native kernel's C calls, counted (the real kernel runs): both ``non_max_suppression``
    and a kernel ``bound`` at load make them (through ``_function`` and ``_packed``)."""
    made: list[int] = []
    try:
        kernel, packed = in_c._function(), in_c._packed()
    except build.NativeUnavailable:
        return made

    def counted(*args):
        made.append(1)
        return kernel(*args)

    def counted_packed(*args):
        made.append(1)
        return packed(*args)

    monkeypatch.setattr(in_c, "_FUNCTIONS", [counted])
    monkeypatch.setattr(in_c, "_PACKED", [counted_packed])
    return made


def _both(boxes, scores, *extra, center=0):
    want = reference.non_max_suppression(boxes, scores, *extra, center_point_box=center)[0]
    got = in_c.non_max_suppression(boxes, scores, *extra, center_point_box=center)[0]
    assert got.dtype == np.int64 and got.flags.c_contiguous
    names = ["limit", "iou", "threshold"][:len(extra)]
    given = {n: v for n, v in zip(names, extra) if v is not None}
    layer = Layer("nms", "NonMaxSuppression", ["boxes", "scores", *(n if n in given else ""
                                                                    for n in names)],
                  ["selected"], {"center_point_box": center}, "", 11)
    bound = in_c.bound(layer, given)  # the limits read at load, as a HostChain's
    np.testing.assert_array_equal(bound(boxes, scores, *extra, center_point_box=center)[0], got)
    return got, want


@st.composite
def _cases(draw):
    batch, classes = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    count = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    corner = rng.uniform(0, 24, (batch, count, 2))
    size = rng.uniform(0.5, 14, (batch, count, 2))
    boxes = np.concatenate([corner, corner + size], axis=-1).astype(np.float32)
    if draw(st.booleans()):  # opposite corners in either order
        boxes = boxes[..., [2, 1, 0, 3]].copy()
    scores = rng.choice(np.float32([0.1, 0.25, 0.5, 0.5, 0.75, 0.9]) if draw(st.booleans())
                        else rng.uniform(0, 1, 64).astype(np.float32), (batch, classes, count))
    if draw(st.booleans()):
        scores[rng.uniform(size=scores.shape) < 0.15] = np.nan
    if draw(st.booleans()):
        boxes[rng.uniform(size=boxes.shape) < 0.05] = np.nan
    limit = np.array([draw(st.sampled_from([0, 1, 3, 10, 100, 2**63 - 1]))], np.int64)
    iou = np.array([draw(st.sampled_from([0.0, 0.2, 0.5, 0.7, 1.0, np.nan]))], np.float32)
    threshold = draw(st.sampled_from([None, 0.0, 0.3, 0.6]))
    threshold = None if threshold is None else np.array([threshold], np.float32)
    return boxes, scores.astype(np.float32), limit, iou, threshold, draw(st.integers(0, 1))


@needs_library
@settings(max_examples=150, deadline=None)
@given(_cases())
def test_against_cpuref(case):
    boxes, scores, limit, iou, threshold, center = case
    got, want = _both(boxes, scores, limit, iou, threshold, center=center)
    np.testing.assert_array_equal(got, want)


@needs_library
def test_overlapping_boxes_ties_and_nan():
    """A crowded case with every rule at once: most boxes overlap, equal scores keep the lower
    index, NaN scores come last without a threshold, a NaN box suppresses nothing."""
    rng = np.random.default_rng(3)
    corner = rng.uniform(0, 20, (1, 30, 2))
    boxes = np.concatenate([corner, corner + 8], axis=-1).astype(np.float32)
    scores = rng.choice(np.float32([0.2, 0.4, 0.4, 0.8]), (1, 2, 30))
    scores[0, 0, [4, 9]] = np.nan
    boxes[0, 7, 1] = np.nan
    got, want = _both(boxes, scores, np.array([30], np.int64), np.array([0.3], np.float32))
    assert len(want) > 4 and (want[:, 2] == 7).any()
    np.testing.assert_array_equal(got, want)


@needs_library
@pytest.mark.parametrize("count", [256, 257, 400])
def test_past_the_small_buffers(count):
    """Up to 256 boxes the C keeps its buffers on the stack and sorts by insertion, past them it
    allocates and sorts with qsort: both CpuRef's order (ties by box, NaN last) and rows."""
    rng = np.random.default_rng(count)
    corner = rng.uniform(0, 60, (1, count, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(2, 9, (1, count, 2))], -1)
    scores = rng.choice(np.float32([0.1, 0.3, 0.3, 0.6, 0.9]), (1, 2, count))
    scores[0, 1, rng.integers(0, count, 12)] = np.nan
    args = (np.array([count], np.int64), np.array([0.4], np.float32))
    got, want = _both(boxes.astype(np.float32), scores, *args)
    assert len(want) > 20
    np.testing.assert_array_equal(got, want)


@needs_library
def test_a_second_thread_at_once():
    """A bound kernel's call while another holds its argument arrays (a second thread at the
    same time) writes arrays of its own: the same rows."""
    rng = np.random.default_rng(5)
    corner = rng.uniform(0, 20, (1, 32, 2))
    boxes = np.concatenate([corner, corner + 6], -1).astype(np.float32)
    scores = rng.uniform(0, 1, (1, 3, 32)).astype(np.float32)
    layer = Layer("nms", "NonMaxSuppression", ["boxes", "scores", "limit", "iou"], ["selected"],
                  {}, "", 11)
    given = {"limit": np.array([10], np.int64), "iou": np.array([0.45], np.float32)}
    bound = in_c.bound(layer, given)
    want = reference.non_max_suppression(boxes, scores, *given.values())[0]
    with bound.lock:
        np.testing.assert_array_equal(bound(boxes, scores)[0], want)
    np.testing.assert_array_equal(bound(boxes, scores)[0], want)


def _one_node(batch: int, classes: int, count: int, threshold: bool) -> bytes:
    from onnx import TensorProto, helper

    names = ["boxes", "scores", "limit", "iou"] + (["threshold"] if threshold else [])
    shapes = {"boxes": (TensorProto.FLOAT, [batch, count, 4]),
              "scores": (TensorProto.FLOAT, [batch, classes, count]),
              "limit": (TensorProto.INT64, [1]), "iou": (TensorProto.FLOAT, [1]),
              "threshold": (TensorProto.FLOAT, [1])}
    graph = helper.make_graph(
        [helper.make_node("NonMaxSuppression", names, ["selected"])], "nms",
        [helper.make_tensor_value_info(n, *shapes[n]) for n in names],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)],
                             ir_version=8).SerializeToString()


@needs_library
@pytest.mark.parametrize("seed", range(24))
def test_ties_in_onnx_runtimes_order(seed):
    """Scores of five values only (most of a class's candidates tie): the C keeps ONNX
    Runtime's rows, in its order, on both of its sorts (insertion to 256 boxes, qsort past)."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(seed)
    batch, classes = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    count = int(rng.choice([5, 40, 64, 300]))
    corner = rng.uniform(0, 30, (batch, count, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(1, 10, (batch, count, 2))], -1)
    feeds = {"boxes": boxes.astype(np.float32),
             "scores": rng.choice(np.float32([0.1, 0.3, 0.3, 0.5, 0.9]), (batch, classes, count)),
             "limit": np.array([rng.choice([3, 10, 1000])], np.int64),
             "iou": np.array([rng.choice([0.0, 0.3, 0.5, 0.9])], np.float32)}
    if seed % 2:
        feeds["threshold"] = np.array([0.2], np.float32)
    peer = ort.InferenceSession(_one_node(batch, classes, count, seed % 2 == 1),
                                providers=["CPUExecutionProvider"])
    want = peer.run(None, feeds)[0]
    got, _ = _both(*feeds.values())
    np.testing.assert_array_equal(got, want)


@needs_library
def test_no_limit_and_other_types():
    boxes = np.zeros((1, 4, 4), np.float32)
    scores = np.ones((1, 1, 4), np.float32)
    assert in_c.non_max_suppression(boxes, scores)[0].shape == (0, 3)  # no limit given: none
    got, want = _both(boxes.astype(np.float64), scores.astype(np.float64),
                      np.array([2], np.int64))  # float64: NumPy's path, the same rows
    np.testing.assert_array_equal(got, want)


def _session(path, mode):
    options = {"CpuAcc.native": mode, "CpuAcc.threads": 1}
    return InferenceSession(str(path), backends=["CpuAcc", "CpuRef"],  # GpuAcc first where a GPU is
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


DETECTORS = ("detect_nms_dyn21", "detect_nms_ts14")


@needs_library
@pytest.mark.parametrize("name", DETECTORS)
def test_detectors_against_cpuref_and_ort(name, calls):
    """The detector's NonMaxSuppression one native call a run; its selections CpuRef's and ONNX
    Runtime's, its boxes and scores within float32 rounding of theirs."""
    ort = pytest.importorskip("onnxruntime")
    path = CORPUS / f"{name}.onnx"
    session, ref = _session(path, "auto"), InferenceSession(str(path), providers=["CpuRef"])
    peer = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sample in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"{name}.{sample}.npz"))
        session.run(None, feeds)
        calls.clear()
        got = session.run(None, feeds)
        assert len(calls) == 1
        for want in (ref.run(None, feeds), peer.run(None, feeds)):
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                if a.dtype == np.int64:
                    np.testing.assert_array_equal(a, b)
                else:
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", DETECTORS)
def test_off_and_no_compiler_keep_numpy(name, calls, monkeypatch):
    """``CpuAcc.native`` "off", and "auto" where no library can be built, make no native call and
    select what CpuRef does."""
    path = CORPUS / f"{name}.onnx"
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    want = InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds)
    off = _session(path, "off")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(in_c, "_FUNCTIONS", [])
    monkeypatch.setattr(in_c, "_PACKED", [])
    missing = _session(path, "auto")
    for session in (off, missing):
        for _ in range(2):
            got = session.run(None, feeds)
        for a, b in zip(got, want):
            if a.dtype == np.int64:
                np.testing.assert_array_equal(a, b)
    assert not calls
