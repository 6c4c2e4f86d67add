"""A Linear of at least ``native.linear.LARGE`` multiply-adds in a one-thread CpuAcc session is one
call of backplane's C (``native/linear.c``) over its weight packed at load: torch's values within
float32 summation order, bias and post-ops kept, the op in the trace; CpuAcc.native off, more
threads, or a small product keep torch's routes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.native import linear  # noqa: E402

ort = pytest.importorskip("onnxruntime")
FULL = Path.home() / ".cache" / "backplane" / "corpus-full"
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
RNG = np.random.default_rng(2728)
needs_library = pytest.mark.skipif(not linear.usable("auto"), reason="no C compiler here")


@needs_library
@pytest.mark.parametrize("rows,depth,cols", [(32, 256, 768), (7, 33, 17), (1, 1, 1), (13, 64, 48),
                                             (6, 1024, 256), (2, 5, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_c_product_is_torchs_linear(rows, depth, cols, with_bias):
    weight = torch.from_numpy(RNG.standard_normal((cols, depth)).astype(np.float32))
    bias = torch.from_numpy(RNG.standard_normal(cols).astype(np.float32)) if with_bias else None
    x = torch.from_numpy(RNG.standard_normal((1, rows, depth)).astype(np.float32))
    run = linear.product(weight, bias)
    got = run(x)
    want = torch.nn.functional.linear(x, weight, bias)
    assert got.shape == want.shape
    bound = 1e-6 * depth * float(x.abs().max() * weight.abs().max()) + 1e-6
    assert float((got - want).abs().max()) <= bound


@needs_library
def test_nan_and_inf_reach_their_outputs():
    weight = torch.ones(20, 8)
    x = torch.zeros(3, 8)
    x[0, 2], x[1, 5] = float("nan"), float("inf")
    got = linear.product(weight, None)(x)
    assert torch.isnan(got[0]).all() and torch.isinf(got[1]).all() and (got[2] == 0).all()


def _session(model: Path, native: str, threads: int):
    return InferenceSession(str(model), backends=[("CpuAcc", {"native": native,
                                                              "threads": threads}), "CpuRef"])


def _native_calls(session, feeds):
    from torch.profiler import ProfilerActivity, profile

    session.run(None, feeds)  # a free dimension's signature is built at its first run
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = session.run(None, feeds)
    return outputs, sum(e.count for e in prof.key_averages() if e.key == "backplane::native_linear")


@needs_library
@pytest.mark.skipif(not (FULL / "encoder4_plain_dyn18.onnx").exists(),
                    reason="the full tier is not built here (scripts/export_corpus.py --tier full)")
def test_the_full_tier_encoders_sixteen_products_run_in_c_at_one_thread():
    model = FULL / "encoder4_plain_dyn18.onnx"
    feeds = dict(np.load(FULL / "encoder4_plain_dyn18.s0.npz"))
    (native,), calls = _native_calls(_session(model, "auto", 1), feeds)
    (torch_only,), none = _native_calls(_session(model, "off", 1), feeds)
    (two,), at_two = _native_calls(_session(model, "auto", 2), feeds)
    assert (calls, none, at_two) == (16, 0, 0)
    (theirs,) = ort.InferenceSession(str(model)).run(None, feeds)
    scale = float(np.abs(theirs).max())
    for got in (native, torch_only, two):
        assert float(np.abs(got - theirs).max()) <= 1e-5 * scale


@needs_library
def test_a_small_transformer_keeps_torchs_products():
    """gpt_causal_ts15's products are 0.1-0.3e6 multiply-adds: the op's Python body would cost
    what the C saves."""
    model = CORPUS / "gpt_causal_ts15.onnx"
    feeds = dict(np.load(CORPUS / "gpt_causal_ts15.s0.npz"))
    _, calls = _native_calls(_session(model, "auto", 1), feeds)
    assert calls == 0
