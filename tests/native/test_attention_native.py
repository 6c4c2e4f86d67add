"""backplane's C attention (``native/attention.c``, ``native/attention.py``) against torch's ops
computed the way ONNX writes the layer (Q K^T times the scale, the mask added or a condition's
fill put in, softmax, times V), in float64: every mask kind, shapes whose rows and keys are not
whole blocks or vectors, head sizes with a scalar tail, batches that broadcast, the layouts the
traces hand it, NaN and infinities where ONNX gives them. Each build this CPU runs (the session's
``-march=native``, AVX2's, plain x86-64's) is held to the same references; and a corpus model
through CpuAcc runs the op in its trace, as ONNX Runtime computes it.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_attention_native.py
"""

from __future__ import annotations

import math
import platform
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.native import attention, build  # noqa: E402
from tests.native import flavours  # noqa: E402

needs_compiler = pytest.mark.skipif(not build.available("attention"),
                                    reason="no native library (no C compiler)")
pytestmark = needs_compiler
X86 = platform.machine() in ("x86_64", "AMD64")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"
LOWEST = float(np.finfo(np.float32).min)


def _cpu_has(*flags: str) -> bool:
    return all(flag in build._cpu_flags() for flag in flags)


BUILDS = {"native": True, "haswell": X86 and _cpu_has("avx2", "fma"), "x86-64": X86}
"""-march values -> whether this CPU runs what they build (haswell: 8-float vectors, FMA;
x86-64: GCC's generic vectors over SSE2)."""
RUNNABLE = [pytest.param(m, marks=pytest.mark.skipif(not ok, reason=f"this CPU lacks {m}"))
            for m, ok in BUILDS.items()]


@pytest.fixture(scope="module")
def functions(tmp_path_factory):
    """-march value -> that build's ``backplane_attention``, typed as the session's."""
    folder, made = tmp_path_factory.mktemp("attention"), {}

    def get(march: str):
        if march == "native":
            return attention._function()
        if march not in made:
            made[march] = attention.typed(flavours.built("attention", march, folder))
        return made[march]
    return get


def _reference(q, k, v, mask=None, cond=None, invert=False, diagonal=None, fill=0.0, alpha=1.0):
    """ONNX's ops in float64: MatMul, Mul, Add or Where, Softmax, MatMul."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.matmul(q, k.transpose(-1, -2)) * alpha
    if mask is not None:
        scores = scores + mask.double()
    if cond is not None:
        scores = torch.where(cond != invert, torch.tensor(fill, dtype=torch.float64), scores)
    if diagonal is not None:
        L, S = scores.shape[-2:]
        hidden = torch.ones(L, S, dtype=torch.bool).triu(diagonal)
        scores = torch.where(hidden, torch.tensor(fill, dtype=torch.float64), scores)
    return torch.matmul(torch.softmax(scores, -1), v)


def _run(function, q, k, v, mask=None, cond=None, invert=False, diagonal=None, fill=0.0,
         alpha=1.0):
    plan = attention.plan_of(q, k, v, mask, cond, int(invert),
                             attention.NO_DIAGONAL if diagonal is None else diagonal, fill, alpha)
    assert plan is not None
    return attention.call(function, plan, q, k, v, mask, cond)


def _heads(batch, heads, rows, size, generator, scale=1.0):
    """(batch, heads, rows, size) as a view of a (batch, rows, heads * size) product, the layout
    the exporters' Reshape and Transpose give the attention."""
    x = torch.randn(batch, rows, heads * size, generator=generator) * scale
    return x.view(batch, rows, heads, size).transpose(1, 2)


SHAPES = [(1, 4, 128, 128, 16, 16), (1, 4, 48, 48, 8, 8), (2, 3, 13, 29, 8, 12),
          (1, 2, 1, 1, 4, 4), (1, 4, 64, 64, 64, 64), (3, 1, 9, 17, 5, 33), (1, 2, 8, 8, 24, 24)]
"""(batch, heads, L, S, E, Ev): the full tier's tagger and the small tier's (head size 8: half an
AVX-512 vector), rows and keys not whole blocks or vectors with head sizes below a vector and
tails (12, 33), one query and one key, the GPT's and encoder's, 24 (a vector and a half)."""


@pytest.mark.parametrize("march", RUNNABLE)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_each_mask_kind_is_onnx_s_ops_within_rounding(functions, march, shape):
    B, H, L, S, E, Ev = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v = _heads(B, H, L, E, g), _heads(B, H, S, E, g), _heads(B, H, S, Ev, g)
    padding = torch.zeros(B, 1, 1, S)
    padding[..., S // 2:] = -10000.0  # a padding mask: (batch, 1, 1, S) over every head and row
    condition = torch.rand(B, H, L, S, generator=g) < 0.3
    condition[..., 0] = False  # no row masked throughout (its fill's uniform row is tested below)
    cases = [dict(), dict(mask=padding), dict(mask=torch.randn(L, S, generator=g)),
             dict(cond=condition, fill=-1e9), dict(cond=~condition, invert=True, fill=LOWEST),
             dict(diagonal=1, fill=LOWEST), dict(diagonal=1, fill=-math.inf),
             dict(diagonal=3, fill=-1e4), dict(diagonal=0, fill=-5.0)]
    function = functions(march)
    for case in cases:
        got = _run(function, q, k, v, alpha=0.3, **case)
        want = _reference(q, k, v, alpha=0.3, **case)
        assert got.shape == want.shape, case
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=2e-6), \
            (case.keys(), (got.double() - want).abs().max())


@pytest.mark.parametrize("march", RUNNABLE)
def test_nan_and_infinities_go_where_onnx_puts_them(functions, march):
    g = torch.Generator().manual_seed(7)
    q, k, v = _heads(1, 2, 16, 8, g), _heads(1, 2, 16, 8, g), _heads(1, 2, 16, 8, g)
    function = functions(march)
    q2 = q.clone()
    q2[0, 1, 5, 3] = math.nan  # one query's NaN: that row of that head, no other
    got = _run(function, q2, k, v, mask=torch.zeros(16, 16))
    want = _reference(q2, k, v, mask=torch.zeros(16, 16))
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 8
    v2 = v.clone()
    v2[0, 0, 15, 2] = math.inf  # the last key's value: hidden by the causal mask from rows < 15,
    got = _run(function, q, k, v2, diagonal=1, fill=LOWEST)  # whose weight is 0, and 0 * inf NaN
    want = _reference(q, k, v2, diagonal=1, fill=LOWEST)
    assert torch.equal(got.isnan(), want.isnan()) and got[0, 0, :15, 2].isnan().all()
    every = torch.ones(16, 16, dtype=torch.bool)  # every key masked by -inf: NaN, as ONNX's softmax
    assert _run(function, q, k, v, cond=every, fill=-math.inf).isnan().all()
    uniform = _run(function, q, k, v, cond=every, fill=LOWEST)  # a finite fill: a uniform row
    assert torch.allclose(uniform, v.mean(-2, keepdim=True).expand_as(uniform), atol=1e-6)
    k2 = k.clone()
    k2[0, 1, 4, 0] = math.nan  # a key's NaN reaches the rows that attend it, not the others
    got = _run(function, q, k2, v, diagonal=1, fill=LOWEST)
    want = _reference(q, k2, v, diagonal=1, fill=LOWEST)
    assert torch.equal(got.isnan(), want.isnan()) and not got[0, 1, :4].isnan().any()


def test_the_op_s_kernel_is_the_c_and_gives_the_python_kernel_s_values_bit_for_bit():
    assert attention.in_c()  # torch 2.13 has the stable ABI: no Python in the op's call
    g = torch.Generator().manual_seed(5)
    q, k, v = _heads(1, 4, 33, 16, g), _heads(1, 4, 33, 16, g), _heads(1, 4, 33, 16, g)
    mask, cond = torch.randn(1, 1, 1, 33, generator=g), torch.rand(33, 33, generator=g) < 0.2
    in_c, in_python = torch.ops.backplane.native_attention_c, torch.ops.backplane.native_attention
    none = attention._NONE
    for args in [(mask, none, 0, attention.NO_DIAGONAL, 0.0), (none, cond, 1, attention.NO_DIAGONAL,
                 LOWEST), (none, none, 0, 1, -math.inf), (none, none, 0, attention.NO_DIAGONAL, 0.0)]:
        got, want = in_c(q, k, v, *args, 0.25), in_python(q, k, v, *args, 0.25)
        assert got.stride() == want.stride() and torch.equal(got, want)
    flat = [x.reshape(4, 33, 16) for x in (q, k, v)]  # a batch of one axis: (L, H, Ev) memory
    got = in_c(*flat, none, none, 0, attention.NO_DIAGONAL, 0.0, 0.5)
    assert got.transpose(0, 1).is_contiguous()
    assert torch.equal(got, in_python(*flat, none, none, 0, attention.NO_DIAGONAL, 0.0, 0.5))
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last axis strided: Python's
    got = in_c(strided, k, v, mask, none, 0, attention.NO_DIAGONAL, 0.0, 0.25)  # route, torch's ops
    assert torch.allclose(got.double(), _reference(q, k, v, mask=mask, alpha=0.25), atol=2e-6)
    wide = torch.randn(2, 1, 33, 33, generator=g)  # a mask whose batch is not q's: torch's error
    with pytest.raises(RuntimeError):
        in_c(q, k, v, wide, none, 0, attention.NO_DIAGONAL, 0.0, 0.25)


def test_the_output_is_the_merged_heads_layout_the_exporters_read():
    g = torch.Generator().manual_seed(3)
    q, k, v = _heads(2, 4, 10, 8, g), _heads(2, 4, 10, 8, g), _heads(2, 4, 10, 8, g)
    out = attention.scaled(q, k, v, alpha=0.5)
    assert out.transpose(1, 2).is_contiguous()  # (B, L, H, Ev) memory: Reshape is a view
    assert torch.allclose(out.double(), _reference(q, k, v, alpha=0.5), atol=2e-6)
    flat = [x.reshape(8, 10, 8) for x in (q, k, v)]  # MultiheadAttention's (B H, L, E)
    out = attention.scaled(*flat, alpha=0.5)
    assert out.transpose(0, 1).is_contiguous()  # (L, B H, Ev) memory
    assert torch.allclose(out.double(), _reference(*flat, alpha=0.5), atol=2e-6)


def test_operands_it_does_not_take_run_through_torch_s_ops():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 8, generator=g).transpose(-1, -2)  # (2, 8, 6): last axis strided
    k, v = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 3, generator=g)
    assert attention.plan_of(q, k, v, None, None, 0, attention.NO_DIAGONAL, 0.0, 1.0) is None
    got = attention.scaled(q, k, v, alpha=2.0)
    assert torch.allclose(got.double(), _reference(q, k, v, alpha=2.0), atol=2e-6)
    half = [x.half() for x in (q.contiguous(), k, v)]
    assert attention.plan_of(*half, None, None, 0, attention.NO_DIAGONAL, 0.0, 1.0) is None


def test_every_route_and_the_fake_kernel_give_the_same_layout():
    """Torch's route (operands the C does not take) and the Meta kernel inductor traces with lay
    the output out as the C's does: a trace's views after the op (the exporters' Transpose then
    Reshape as ``view``) hold whichever route ran (the slow inductor test compiled the tagger's
    trace against a contiguous fake and failed: 'Cannot view a tensor ...')."""
    g = torch.Generator().manual_seed(5)
    q, k, v = _heads(1, 4, 8, 8, g), _heads(1, 4, 8, 8, g), _heads(1, 4, 8, 8, g)
    by_c = attention.scaled(q, k, v, alpha=0.5)
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last axis strided
    assert attention.plan_of(strided, k, v, None, None, 0, attention.NO_DIAGONAL, 0.0, 1.0) is None
    by_torch = attention.scaled(strided, k, v, alpha=0.5)
    fake = attention.scaled(*(x.to("meta") for x in (q, k, v)), alpha=0.5)
    assert by_c.stride() == by_torch.stride() == fake.stride() and fake.shape == by_c.shape
    assert by_torch.transpose(1, 2).reshape(1, 8, 32).data_ptr() == by_torch.data_ptr()  # a view
    assert torch.allclose(by_torch.double(), _reference(q, k, v, alpha=0.5), atol=2e-6)


@pytest.mark.parametrize("model", ["char_tagger_ts14", "gpt_causal_ts15"])
def test_a_corpus_transformer_runs_it_in_its_trace_as_onnx_runtime_computes(model):
    ort = pytest.importorskip("onnxruntime")
    from backplane import InferenceSession, SessionOptions
    from backplane.backends.torch.fusion import onednn_graph

    path = CORPUS / f"{model}.onnx"
    feeds = dict(np.load(CORPUS / f"{model}.s0.npz"))
    frozen = []
    freeze = onednn_graph._freeze

    def kept(trace, *args, **kwargs):
        module = freeze(trace, *args, **kwargs)
        frozen.append(module)
        return module
    onednn_graph._freeze = kept
    try:
        session = InferenceSession(str(path), SessionOptions(intra_op_num_threads=1),
                                   providers=[("CpuAcc", {"CpuAcc.background": False}), "CpuRef"])
        got = session.run(None, feeds)
    finally:
        onednn_graph._freeze = freeze
    kinds = {node.kind() for module in frozen for node in module.graph.nodes()}
    assert "backplane::native_attention_c" in kinds  # the op whose kernel is the C
    assert "aten::softmax" not in kinds and "aten::baddbmm" not in kinds
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        assert np.allclose(g, w, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(w).max())))


def test_torch_s_ops_take_a_large_attention_of_a_session_of_two_threads():
    """The C runs on the calling thread: above ``THREADS_FROM`` a session of two threads or more
    keeps torch's ops (the full tier's tagger, 4 x 128 x 128 x 16, ran 0.99 ms a run with the C at
    2 threads against 0.89 without); one thread, or less work, takes the C."""
    from backplane.backends.torch.fusion import attention as fused

    large = torch.empty(1, 4, 128, 16), torch.empty(1, 4, 128, 16)
    small = torch.empty(1, 4, 32, 16), torch.empty(1, 4, 32, 16)
    assert fused._threads_win(*large, 2) and not fused._threads_win(*large, 1)
    assert not fused._threads_win(*small, 2)
