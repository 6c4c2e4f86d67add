"""ScaledDotAttention's products as ``bmm`` / ``baddbmm`` (``fusion/attention.py``): in a trace,
no ``matmul`` (4-d: expand, reshape and view around its bmm) and no ``mul_`` by a float (a double
tensor cast at every run); the scale the product's alpha, an additive mask whose batch is all ones
its input; the values the explicit ops' (NaN where they give it)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.backend import FUSED_DOMAIN  # noqa: E402
from backplane.backends.torch.fusion.attention import attention_workload  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402

B, H, L, E = 2, 3, 5, 4


def _workload(scale, mask=None, fill=None):
    attrs = {"scale": scale, "mask": mask, "fill": fill, "transposed": False}
    inputs = ["q", "kt", "v"] + (["m"] if mask else [])
    return attention_workload(Layer("a", "ScaledDotAttention", inputs, ["o"], attrs,
                                    FUSED_DOMAIN, 1), None)


def _explicit(q, kt, v, scale, kind=None, mask=None, fill=None):
    scores = torch.matmul(q, kt)
    if scale is not None:
        scores = scores * scale[1] if scale[0] == "Mul" else scores / scale[1]
    if kind == "add":
        scores = scores + mask
    elif kind == "where":
        scores = scores.masked_fill(mask, fill)
    return torch.matmul(torch.softmax(scores, -1), v)


def _qkv():
    q, kt, v = torch.randn(B, H, L, E), torch.randn(B, H, E, L), torch.randn(B, H, L, E)
    q[1, 2, 3, 0] = math.nan  # that query's row NaN
    return q, kt, v


def _kinds(traced) -> set[str]:
    return {node.kind() for node in traced.graph.nodes()}


def test_a_scaled_causal_attention_traces_as_bmm_with_its_scale_as_alpha() -> None:
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    run = _workload(("Mul", 0.5), "where", -math.inf)
    q, kt, v = _qkv()
    traced = torch.jit.trace(lambda *x: run(*x, causal)[0], (q, kt, v))
    kinds = _kinds(traced)
    assert {"aten::baddbmm", "aten::bmm"} <= kinds
    assert not {"aten::matmul", "aten::mul_", "aten::mul", "aten::to"} & kinds
    q, kt, v = _qkv()
    want = _explicit(q, kt, v, ("Mul", 0.5), "where", causal, -math.inf)
    got = traced(q, kt, v)
    assert torch.equal(got.isnan(), want.isnan()) and got[1, 2, 3].isnan().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("shape, added", [((1, 1, 1, L), True), ((L, L), True),
                                          ((B, 1, 1, L), False)])
def test_an_additive_mask_is_the_products_input_where_it_broadcasts(shape, added) -> None:
    mask = torch.where(torch.rand(shape) < 0.3, -math.inf, 0.0)
    mask[..., 0] = 0.0  # every row keeps a key
    run = _workload(("Div", 2.0), "add")
    q, kt, v = _qkv()
    traced = torch.jit.trace(lambda *x: run(*x)[0], (q, kt, v, mask))
    kinds = _kinds(traced)
    assert ("aten::add_" in kinds) != added and "aten::baddbmm" in kinds
    assert not {"aten::matmul", "aten::div_", "aten::div"} & kinds
    want = _explicit(q, kt, v, ("Div", 2.0), "add", mask)
    got = traced(q, kt, v, mask)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("batch", [1, B])
def test_the_scores_stay_flat_where_one_condition_masks_every_head(batch) -> None:
    """A causal condition of one (L, S) for every head (a constant: reshaped outside the trace)
    masks the (-1, L, S) scores as they are, softmax on them too: the output's view the one view
    of the trace; a condition per batch views the scores 4-d as before, the same values."""
    condition = torch.triu(torch.ones(batch, 1, L, L, dtype=torch.bool), 1)
    condition[-1, 0, 1, 2] = True  # (the last batch's own where it has one)
    run = _workload(("Mul", 0.5), "where", -math.inf)
    q, kt, v = _qkv()
    traced = torch.jit.trace(lambda *x: run(*x, condition)[0], (q, kt, v))
    views = [node.kind() for node in traced.graph.nodes()].count("aten::view")
    assert views == (1 if batch == 1 else 3)
    q, kt, v = _qkv()
    want = _explicit(q, kt, v, ("Mul", 0.5), "where", condition, -math.inf)
    got = traced(q, kt, v)
    assert torch.equal(got.isnan(), want.isnan()) and got[1, 2, 3].isnan().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_row_masked_throughout_stays_nan() -> None:
    mask = torch.zeros(1, 1, L, L)
    mask[..., 2, :] = -math.inf
    q, kt, v = (torch.randn(B, H, L, E), torch.randn(B, H, E, L), torch.randn(B, H, L, E))
    (got,) = _workload(None, "add")(q, kt, v, mask)
    assert got[:, :, 2].isnan().all() and not got[:, :, :2].isnan().any()


@pytest.mark.parametrize("k, fill", [(1, -math.inf), (1, -3.4028234663852886e38), (0, -1e4),
                                     (3, -math.inf)])
def test_a_constant_causal_condition_is_tril_then_the_fill_added(k, fill) -> None:
    """Over ``TRIL_FROM`` scores or more a constant causal condition (``triu`` of ones from
    diagonal ``k``) is ``tril_`` and ``add_`` of a constant (ATen's ``masked_fill_`` is a scalar
    loop); NaN and infinities in masked scores give the fill, as ONNX's Where does; a condition of
    another shape keeps ``masked_fill_``. The values are the explicit ops'."""
    from backplane.backends.torch.fusion.attention import TRIL_FROM

    heads, length = 4, 32
    assert heads * length * length >= TRIL_FROM
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), k)
    other = causal.clone()
    other[5, 20] = False  # a key kept above the diagonal: not causal
    run = _workload(("Mul", 0.5), "where", fill)
    q, kt, v = torch.randn(1, heads, length, E), torch.randn(1, heads, E, length), \
        torch.randn(1, heads, length, E)
    kt[0, 1, 2, 9], kt[0, 3, 0, 30], q[0, 2, 4, 1] = math.nan, math.inf, math.nan
    for condition, tril in ((causal, True), (other, False)):
        traced = torch.jit.trace(lambda *x, c=condition: run(*x, c)[0], (q, kt, v))
        kinds = _kinds(traced)
        assert ("aten::tril_" in kinds) == tril and ("aten::masked_fill_" in kinds) != tril
        want = _explicit(q, kt, v, ("Mul", 0.5), "where", condition, fill)
        got = traced(q, kt, v)
        assert torch.equal(got.isnan(), want.isnan()) and got[0, 2, 4].isnan().all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
