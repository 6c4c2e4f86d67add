"""A small contiguous float32 GELU (erf form) on CpuAcc runs ATen's own kernel on its transpose where
that kernel keeps +Inf here (kernels/common.py: torch hands a contiguous tensor to oneDNN's eltwise
primitive, made again at each call): the values, NaN and infinities of x * Phi(x), a contiguous
result, the form a trace holds, and a corpus encoder against ONNX Runtime."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.kernels import common  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
SHAPES = ((1, 16, 64), (16, 64), (2, 3, 5, 7), (2, 4095), (1, 64, 1024))  # the last: oneDNN's


def _with_specials(shape: tuple[int, ...], seed: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values times 4 with +Inf, -Inf and NaN at a seventh of the places, +Inf last."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(shape) * 4).to(dtype)
    flat = x.view(-1)
    where = rng.choice(flat.numel(), size=min(flat.numel(), max(3, flat.numel() // 7)),
                       replace=False)
    flat[where[0::3]] = math.inf
    flat[where[1::3]] = -math.inf
    flat[where[2::3]] = math.nan
    flat[-1] = math.inf  # the tail lane
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_small_gelu_keeps_the_values_nan_and_inf(shape: tuple[int, ...], threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = _with_specials(shape, sum(shape))
        kept = x.clone()
        y = common.gelu(x)
        want = x.double() * 0.5 * (1 + torch.special.erf(x.double() / math.sqrt(2)))
        want[torch.isposinf(x)] = math.inf  # inf * 1
        assert y.shape == x.shape and y.is_contiguous()
        np.testing.assert_array_equal(x.numpy(), kept.numpy())  # the input untouched
        assert torch.equal(torch.isposinf(y), torch.isposinf(x))
        assert torch.equal(torch.isnan(y), torch.isnan(want))  # -Inf: -inf * 0
        finite = torch.isfinite(want)
        np.testing.assert_allclose(y[finite].double().numpy(), want[finite].numpy(),
                                   rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_a_small_gelus_trace_is_atens_kernel_on_the_transpose() -> None:
    """Where ATen's kernel keeps +Inf here: transpose, gelu, transpose and no mend; elsewhere
    torch's GELU of the tensor as it is. A GELU of GELU_ATEN_BELOW values or more is torch's."""
    def kinds(n: int) -> list[str]:
        traced = torch.jit.trace(lambda t: common.gelu(t * 1.0), (torch.ones(16, n),))
        return [node.kind() for node in traced.graph.nodes()]

    small, large = kinds(64), kinds(common.GELU_ATEN_BELOW // 16)
    assert "aten::gelu" in small and "aten::gelu" in large
    assert "aten::full" not in small and "aten::all" not in small  # the probe is not traced
    assert ("aten::transpose" in small) is common.gelu_keeps_inf(torch.float32, True)
    assert "aten::transpose" not in large


def test_the_corpus_encoder_against_onnx_runtime() -> None:
    """encoder_padmask_ts17 (nn.TransformerEncoder, GELU after its 16 x 64 products) on CpuAcc
    against ONNX Runtime at both stored sizes."""
    ort = pytest.importorskip("onnxruntime")
    import backplane

    path = CORPUS / "encoder_padmask_ts17.onnx"
    session = backplane.InferenceSession(str(path), providers=["CpuAcc", "CpuRef"])
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for size in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"encoder_padmask_ts17.{size}.npz"))
        names = [i.name for i in reference.get_inputs()]
        feeds = {k: v for k, v in feeds.items() if k in names}
        got, want = session.run(None, feeds), reference.run(None, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
