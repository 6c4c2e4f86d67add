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
