"""A fused Linear's product on MKL's route (``linear._flat_linear``): the ``addmm`` (or ``mm``) of
the input's rows that torch's linear makes of a contiguous input, without linear's own ops
around it; torch's values, NaN where they are; in a trace no ``aten::linear`` and no ``aten::t``,
the outputs CpuRef's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import linear  # noqa: E402
from tests.backends.torch.test_linear_routes import (  # noqa: E402
    _feeds,
    _head,
    _matches_cpuref,
    _session,
)
from tests.conftest import inner_workloads  # noqa: E402


@pytest.mark.parametrize("shape", [(5, 16), (1, 5, 16), (2, 3, 5, 16), (1, 1, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_product_is_torchs_linear(shape: tuple[int, ...], bias: bool) -> None:
    w, b = torch.randn(24, 16), torch.randn(24) if bias else None
    x = torch.randn(shape)
    x.view(-1)[3] = float("nan")  # the first row's NaN stays in its row
    got, want = linear._flat_linear(w)(x, w, b), torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    rows = got.reshape(-1, 24)
    assert torch.isnan(rows[0]).all() and not torch.isnan(rows[1:]).any()


def test_an_input_that_is_not_contiguous_takes_torchs_linear() -> None:
    w, b = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(16, 5).t()  # (5, 16), its rows strided
    torch.testing.assert_close(linear._flat_linear(w)(x, w, b), torch.nn.functional.linear(x, w, b),
                               rtol=0, atol=0)


def test_a_trace_holds_the_product_without_linears_ops(monkeypatch) -> None:
    """A 64 x 48 weight (below ``ONEDNN_FIRST_FROM``): MKL's route, traced with the layers after
    it; its frozen graph has the product and the weight's transposed view as a constant."""
    monkeypatch.setattr(threads, "crowded", lambda: False)
    model = _head(8, 48, 64, tail=True)
    session = _session(model, **{"CpuAcc.compile": "onednn_graph", "CpuAcc.linear_route": "mkl"})
    (workload,) = inner_workloads(session, "Traced")
    graph = str(workload.module.graph)
    assert "aten::addmm" in graph and "aten::linear" not in graph and "aten::t(" not in graph
    _matches_cpuref(session, model, _feeds(8, 48))


def test_a_trace_for_onednn_graph_holds_torchs_linear() -> None:
    """oneDNN Graph's fuser takes ``aten::linear`` into its partitions, not an ``addmm`` of a
    frozen transposed weight."""
    w, b = torch.randn(24, 16), torch.randn(24)
    product, was = linear._flat_linear(w), torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        traced = torch.jit.trace(lambda x: product(x, w, b), (torch.randn(5, 16),))
    finally:
        torch.jit.enable_onednn_fusion(was)
    assert "aten::linear" in str(traced.graph) and "aten::addmm" not in str(traced.graph)
