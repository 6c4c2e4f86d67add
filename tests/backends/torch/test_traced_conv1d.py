"""A trace's 1-d Conv of a few outputs (``traceable._conv``; CpuAcc's own takes one product of its
windows there, ``nn.PRODUCT_ROWS``) is one product of its windows, a strided view of its input
padded time-major (one copy, no im2col), by the weight ordered to match, its output a transposed
view: no copy of the product into (N, K, L). The values CpuAcc's own kernel and CpuRef compute, NaN
in, NaN out, over several calls of the frozen graph."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels import conv as reference  # noqa: E402
from backplane.backends.torch.fusion import onednn_graph  # noqa: E402
from backplane.backends.torch.fusion.static_sizes import fold_sizes  # noqa: E402
from backplane.backends.torch.fusion.traceable import TRACEABLE_KERNELS  # noqa: E402
from backplane.backends.torch.kernels.nn import conv as cpu_acc_conv  # noqa: E402

traced_conv = TRACEABLE_KERNELS["Conv"]
RNG = np.random.default_rng(4)
CASES = {  # x shape, weight shape, attributes: each 8 outputs or fewer, 4096 weights or more
    "vad_front": ((1, 1, 256), (64, 1, 64), {"strides": [32], "pads": [16, 16]}),
    "vad_encoder": ((1, 64, 8), (32, 64, 3), {"pads": [1, 1]}),
    "batch_2_no_bias": ((2, 64, 4), (32, 64, 3), {"pads": [1, 1]}),
    "dilated_uneven_pads": ((1, 64, 9), (32, 64, 3), {"dilations": [2], "pads": [2, 1]}),
}


def _frozen(function, sample):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings
        trace = onednn_graph._trace(function, sample, fusion=False)
        fold_sizes(trace.graph)
        return onednn_graph._freeze(trace, fusion=False)


def _kinds(module) -> set[str]:
    return {node.kind() for node in module.graph.nodes()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_few_outputs_are_one_product_of_the_columns(case: str) -> None:
    x_shape, w_shape, attrs = CASES[case]
    W = torch.from_numpy(RNG.standard_normal(w_shape).astype(np.float32) * 0.1)
    B = None if "no_bias" in case else torch.from_numpy(RNG.standard_normal(w_shape[0])
                                                        .astype(np.float32))
    module = _frozen(lambda x: traced_conv(x, W, B, **attrs)[0], [torch.randn(x_shape)])
    kinds = _kinds(module)
    assert "aten::im2col" not in kinds and ("aten::addmm" if B is not None else "aten::mm") in kinds
    (product,) = [n for n in module.graph.nodes() if n.kind() in ("aten::addmm", "aten::mm")]
    weight = product.inputsAt(2 if B is not None else 1).node()  # transposed once, contiguous
    assert weight.kind() == "prim::Constant" and weight.output().toIValue().is_contiguous()
    pads = attrs.get("pads", [0, 0])
    copies = [n.kind() for n in module.graph.nodes()
              if n.kind() in ("aten::pad", "aten::contiguous", "aten::linear", "aten::reshape")]
    # one copy of the input, padded time-major; uneven pads: padded first, as CpuAcc's, then
    # made time-major; a batch of two or dilated windows: copied into rows
    assert copies == (["aten::pad", "aten::contiguous"] if pads[0] != pads[1] else ["aten::pad"]) \
        + (["aten::reshape"] if x_shape[0] > 1 or "dilations" in attrs else [])
    with torch.no_grad():
        for _ in range(4):  # the frozen graph's first calls and its optimized ones
            x = torch.from_numpy(RNG.standard_normal(x_shape).astype(np.float32))
            x[0, 0, 2] = float("nan")  # the windows over it: NaN in every output channel
            got = module(x)
            want = cpu_acc_conv(x, W, B, **attrs)[0]
            (expected,) = reference.conv(x.numpy(), W.numpy(),
                                         None if B is None else B.numpy(), **attrs)
            assert got.shape == want.shape
            assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).any()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_a_long_output_and_the_fuser_s_trace_keep_cpu_acc_s_kernel() -> None:
    W, B = torch.randn(32, 64, 3), torch.randn(32)
    long = _frozen(lambda x: traced_conv(x, W, B, pads=[1, 1])[0], [torch.randn(1, 64, 40)])
    assert "aten::im2col" not in _kinds(long)  # 40 outputs: torch's conv1d, as CpuAcc's own
    x = torch.randn(1, 64, 8)
    torch.jit.enable_onednn_fusion(True)
    try:
        with torch.no_grad():
            traced = torch.jit.trace(lambda x: traced_conv(x, W, B, pads=[1, 1])[0], (x,))
    finally:
        torch.jit.enable_onednn_fusion(False)
    assert "aten::im2col" not in _kinds(traced)  # oneDNN Graph's fuser takes aten::linear
