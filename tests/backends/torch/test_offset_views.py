"""A trace's chains of views at an offset of a product's result (attention's heads taken out of
stacked projections) folded into one ``as_strided`` each (``index_glue.fold_offset_views``),
the same values; a chain from an input (whose offset a run may change) kept; the corpus encoder's
trace fewer ops, its outputs ONNX Runtime's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.index_glue import fold_index_glue  # noqa: E402
from backplane.backends.torch.fusion.static_sizes import fold_views  # noqa: E402
from tests.models.test_models import DATA, ort_outputs  # noqa: E402

VIEWS = {"aten::select", "aten::reshape", "aten::permute"}


def _heads(x, w):
    """K transposed and V of 4 heads out of x's stacked (q, k, v) projection, as the corpus
    encoder's trace takes them (nn.MultiheadAttention's packed in_proj, sequence first)."""
    qkv = torch.nn.functional.linear(x, w)  # (L, 1, 3 E)
    v5 = qkv.reshape(8, 1, 3, 32).unsqueeze(0).transpose(0, -2).squeeze(-2)  # (3, L, 1, E)
    k = v5.select(0, 1).reshape(8, 4, 8).permute(1, 0, 2).permute(0, 2, 1)
    v = v5.select(0, 2).reshape(8, 4, 8).permute(1, 0, 2)
    return k * 2, v * 2


def _ops(graph) -> list[str]:
    return [node.kind() for node in graph.nodes() if node.kind() != "prim::Constant"]


def test_heads_from_a_product_are_one_view_each() -> None:
    x, w = torch.randn(8, 1, 32), torch.randn(96, 32)
    traced = torch.jit.trace(_heads, (x, w))
    fold_views(traced.graph)  # what static_sizes leaves: the selects at an offset cut there
    assert VIEWS & set(_ops(traced.graph))
    assert fold_index_glue(traced.graph) >= 2
    torch._C._jit_pass_dce(traced.graph)
    assert not VIEWS & set(_ops(traced.graph))
    assert _ops(traced.graph).count("aten::as_strided") == 2
    for _ in range(3):
        x = torch.randn(8, 1, 32)
        for got, want in zip(traced(x, w), _heads(x, w)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_heads_from_the_scripted_onednn_product_are_one_view_each() -> None:
    """A trace holds oneDNN's product as a call of a scripted function until it is frozen."""
    from backplane.backends.torch.fusion.linear import _scripted_onednn

    product, w = _scripted_onednn(), torch.randn(96, 32)

    def heads(x):
        qkv = product(x, w, None)  # (L, 1, 3 E)
        return qkv.reshape(8, 1, 3, 32).select(2, 1).reshape(8, 4, 8).permute(1, 0, 2) * 2

    x = torch.randn(8, 1, 32)
    traced = torch.jit.trace(heads, (x,))
    assert "prim::CallFunction" in _ops(traced.graph)
    fold_views(traced.graph)  # (and the views' arguments made constants), as ``traced`` runs it
    assert fold_index_glue(traced.graph) >= 1
    torch._C._jit_pass_dce(traced.graph)
    assert not VIEWS & set(_ops(traced.graph))
    x = torch.randn(8, 1, 32)
    torch.testing.assert_close(traced(x), heads(x), rtol=0, atol=0)


def _split_heads(x, w, direct=False):
    """Q, K and V split out of one product's result (``LinearSiblings``, GPT-2's Split), each
    taken into 4 heads; with ``direct`` K is read as it is too."""
    q, k, v = torch.nn.functional.linear(x, w).split([32, 32, 32], -1)  # (L, 32) each
    heads = [part.reshape(8, 4, 8).permute(1, 0, 2) * 2 for part in (q, k, v)]
    return (*heads, k * 3) if direct else tuple(heads)


@pytest.mark.parametrize("direct", [False, True])
def test_heads_split_from_a_product_are_one_view_each(direct) -> None:
    """Without the split where only views read its parts; kept for a part another op reads,
    the parts only views read one view each still."""
    x, w = torch.randn(8, 32), torch.randn(96, 32)
    traced = torch.jit.trace(lambda x, w: _split_heads(x, w, direct), (x, w))
    fold_views(traced.graph)  # (and the views' arguments made constants), as ``traced`` runs it
    assert "aten::split_with_sizes" in _ops(traced.graph)
    # K's heads one view of the split's K (fold_views) where K is read as it is too
    assert fold_index_glue(traced.graph) == (2 if direct else 3)
    ops = _ops(traced.graph)
    assert ops.count("aten::as_strided") == 3 and not VIEWS & set(ops)
    assert ("aten::split_with_sizes" in ops) == direct
    for _ in range(3):
        x = torch.randn(8, 32)
        for got, want in zip(traced(x, w), _split_heads(x, w, direct)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_corpus_taggers_trace_has_no_split() -> None:
    """char_tagger_ts14's LinearSiblings (Q, K and V of one product) and heads: no split a run,
    its outputs ONNX Runtime's."""
    from torch.profiler import ProfilerActivity, profile

    from backplane.backends.torch import background

    path = DATA / "corpus" / "char_tagger_ts14.onnx"
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    feeds = dict(np.load(DATA / "corpus" / "char_tagger_ts14.s0.npz"))
    background.settle(lambda: session.run(None, feeds), 60)
    session.run(None, feeds)  # (the trace is made at the first run, its own ops in it)
    with profile(activities=[ProfilerActivity.CPU]) as ran:
        got = session.run(None, feeds)
    names = {event.name for event in ran.events()}
    assert names & {"aten::mm", "aten::_addmm_activation"}  # the trace ran (its products)
    assert not {"aten::split_with_sizes", "aten::split"} & names
    for value, want in zip(got, ort_outputs(path, feeds)):
        np.testing.assert_allclose(value, want, rtol=0, atol=1e-5)


def test_a_chain_from_an_input_is_kept() -> None:
    def heads(qkv):
        return qkv.select(0, 1).reshape(8, 4, 8).permute(1, 0, 2) * 2

    qkv = torch.randn(3, 8, 32)
    traced = torch.jit.trace(heads, (qkv,))
    assert fold_index_glue(traced.graph) == 0
    torch.testing.assert_close(traced(qkv[1:]), heads(qkv[1:]), rtol=0, atol=0)  # another offset


def test_the_corpus_encoders_heads_match_onnx_runtime() -> None:
    path = DATA / "corpus" / "encoder_padmask_dyn17.onnx"
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    for size in ("s0", "s1"):
        feeds = dict(np.load(DATA / "corpus" / f"encoder_padmask_dyn17.{size}.npz"))
        for got, want in zip(session.run(None, feeds), ort_outputs(path, feeds)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
