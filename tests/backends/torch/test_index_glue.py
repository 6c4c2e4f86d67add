"""A trace's index glue folded (``fusion/index_glue.py``): the wrap of negative indices where the
indices are a sort's or a TopK's (never negative) and the casts to the dtype a value has; the wrap
kept where indices come from outside, or where its result is written in place; the corpus
detector's trace without either, its outputs CpuRef's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion.index_glue import fold_index_glue  # noqa: E402
from backplane.backends.torch.kernels import indexing  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402


CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
GLUE = {"aten::where", "aten::lt", "aten::to"}


def kinds(graph) -> set[str]:
    return {node.kind() for node in graph.nodes()}


def _top_gather(x, d):
    _, top = indexing.top_k(x, [4], axis=-1)
    return indexing.gather_elements(d, top, axis=1)[0]


def test_a_topks_indices_are_gathered_without_a_wrap() -> None:
    x, d = torch.randn(2, 8), torch.randn(2, 8)
    traced = torch.jit.trace(_top_gather, (x, d))
    assert GLUE <= kinds(traced.graph)  # the kernels' glue, traced as they run
    assert fold_index_glue(traced.graph) == 2  # the cast to int64 and the where
    assert not GLUE & kinds(traced.graph)
    for _ in range(3):
        x, d = torch.randn(2, 8), torch.randn(2, 8)
        torch.testing.assert_close(traced(x, d), _top_gather(x, d), rtol=0, atol=0)


def test_indices_from_outside_keep_their_wrap() -> None:
    def gather(d, i):
        return indexing.gather_elements(d, i, axis=1)[0]

    i = torch.tensor([[0, 3], [1, 2]])
    traced = torch.jit.trace(gather, (torch.randn(2, 8), i))
    assert fold_index_glue(traced.graph) == 1  # the idle cast alone
    assert {"aten::where", "aten::lt"} <= kinds(traced.graph)
    d = torch.randn(2, 8)
    torch.testing.assert_close(traced(d, -i - 1), torch.gather(d, 1, 7 - i), rtol=0, atol=0)


def test_a_wrap_written_in_place_is_kept() -> None:
    def shifted(x):
        _, top = torch.sort(x, -1)
        wrapped = torch.where(top < 0, top + 8, top)
        return wrapped.add_(1), top  # the wrap's result is its own tensor: top stays as it was

    traced = torch.jit.trace(shifted, (torch.randn(2, 8),))
    fold_index_glue(traced.graph)
    assert "aten::where" in kinds(traced.graph)
    x = torch.randn(2, 8)
    got, top = traced(x)
    torch.testing.assert_close(got, top + 1, rtol=0, atol=0)


def test_a_cast_to_another_dtype_is_kept() -> None:
    traced = torch.jit.trace(lambda i: i.long() * 2, (torch.tensor([1, 2], dtype=torch.int32),))
    assert fold_index_glue(traced.graph) == 0 and "aten::to" in kinds(traced.graph)


def test_the_corpus_detectors_trace_holds_no_index_glue(monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    before = {id(o) for o in _traced_runs()}
    path = CORPUS / "detect_nms_ts14.onnx"
    feeds = dict(np.load(CORPUS / "detect_nms_ts14.s0.npz"))
    session = InferenceSession(str(path), backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, "CpuAcc.compile": "onednn_graph"})))
    got = session.run(None, feeds)
    modules = [o.module for o in _traced_runs() if id(o) not in before]
    assert modules, "no traced workload in the detector's session"
    assert "aten::gather" in set().union(*(kinds(m.graph) for m in modules))
    assert not GLUE & set().union(*(kinds(m.graph) for m in modules))
    want = InferenceSession(str(path), backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def _traced_runs() -> list:
    """Every traced run alive (``traced._traced_run``'s: a Specialized layer keeps its
    signature's builds inside its own)."""
    import gc

    return [o for o in gc.get_objects() if callable(o) and hasattr(o, "relayouts")
            and hasattr(o, "module")]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_a_gather_by_indices_given_to_the_trace_is_one_advanced_index(axis) -> None:
    """traceable's Gather: (*data.shape[:axis], *indices.shape, *data.shape[axis + 1:]), negative
    indices counted from the end, an index out of range an error."""
    from backplane.backends.torch.fusion.traceable import TRACEABLE_KERNELS

    gather = TRACEABLE_KERNELS["Gather"]
    data = torch.randn(4, 5, 6)
    indices = torch.tensor([[0, -1], [2, -3]], dtype=torch.int32)
    traced = torch.jit.trace(lambda d, i: gather(d, i, axis)[0], (data, indices))
    assert "aten::index" in kinds(traced.graph) and not GLUE & kinds(traced.graph)
    size = data.shape[axis]
    want = np.take(data.numpy(), (indices.numpy() + size) % size, axis=axis)
    np.testing.assert_array_equal(traced(data, indices).numpy(), want)
    with pytest.raises(Exception, match="out of bounds"):
        traced(data, torch.tensor([[0, size], [1, 1]], dtype=torch.int32))


@pytest.mark.parametrize("data_shape, index_shape, expands", [((2, 8), (2, 4), 0),
                                                               ((1, 8), (3, 4), 1),
                                                               ((3, 8), (1, 4), 1)])
def test_gather_elements_expands_only_what_broadcasts(data_shape, index_shape, expands) -> None:
    data = torch.randn(data_shape)
    indices = torch.randint(-8, 8, index_shape)
    traced = torch.jit.trace(lambda d, i: indexing.gather_elements(d, i, axis=1)[0],
                             (data, indices))
    assert [n.kind() for n in traced.graph.nodes()].count("aten::expand") == expands
    rows = max(data_shape[0], index_shape[0])
    full = np.broadcast_to(data.numpy(), (rows, 8))
    wrapped = np.broadcast_to(indices.numpy() % 8, (rows, 4))
    np.testing.assert_array_equal(traced(data, indices).numpy(),
                                  np.take_along_axis(full, wrapped, axis=1))
