"""GELU keeps +Inf (x * Phi(x) is +Inf there, as CpuRef and ONNX Runtime give) on CpuAcc, with its
two-kernel mend skipped only where this CPU's GELU keeps +Inf by itself (kernels/common.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from backplane.backends.torch.kernels import common  # noqa: E402
from tests.backends.torch.test_gelu_small import _with_specials  # noqa: E402

SIZES = (1, 5, 16, 17, 33, 1000, 20000)  # 20000: past GELU's single-thread size on ATen's path


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_gelu_keeps_inf_and_nan(layout: str, dtype: torch.dtype, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in SIZES:
            x = _with_specials((n,), n, dtype)
            if layout == "strided":
                x = torch.stack([x, x], 1)[:, 0]
            y = common.gelu(x)
            want = x.double() * 0.5 * (1 + torch.special.erf(x.double() / math.sqrt(2)))
            want[torch.isposinf(x)] = math.inf  # inf * 1
            assert torch.equal(torch.isposinf(y), torch.isposinf(x)), (n, layout)
            assert torch.equal(torch.isnan(y), torch.isnan(want)), (n, layout)  # -Inf: -inf * 0
            finite = torch.isfinite(want)
            np.testing.assert_allclose(y[finite].double().numpy(), want[finite].numpy(), rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_the_mend_is_skipped_only_where_torch_keeps_inf() -> None:
    """Where the probe says this CPU's contiguous GELU keeps +Inf, torch's own GELU does at every
    size and position tried; a trace then holds GELU alone, and the probe is not in it."""
    common._GELU_KEEPS_INF.clear()
    traced = torch.jit.trace(lambda t: common.gelu(t * 1.0), (torch.ones(40),))
    kinds = [node.kind() for node in traced.graph.nodes()]
    keeps = common._GELU_KEEPS_INF[(torch.float32, False)]
    assert "aten::full" not in kinds and "aten::all" not in kinds
    assert ("aten::isposinf" in kinds) is not keeps
    if keeps:
        for n in SIZES:
            x = _with_specials((n,), n + 1)
            assert torch.equal(torch.isposinf(F.gelu(x)), torch.isposinf(x)), n
    x = _with_specials((40,), 3)
    assert torch.equal(torch.isposinf(traced(x)), torch.isposinf(x))
