"""Why a ReLU traced for oneDNN Graph is ELU with alpha 0 (``kernels.common.relu``), and its MaxPool
torch's maxima (``nn._strided_max``): every cheaper spelling the fuser takes into a convolution's
partition, or as a pool, turns NaN into the bound (x86's max returns its second operand, the bound,
where the first is NaN). ELU(0) keeps it, at an exp per value (about 0.38 ms per million outputs, 1
thread; ``unet_resize_dyn20``: 2.9 million ReLU outputs a run). Should a torch's oneDNN keep NaN in
one of these, its case here fails: that spelling may then replace the ELU."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from backplane.backends.torch.fusion.compiled import fusion_switch  # noqa: E402
from backplane.backends.torch.kernels import nn  # noqa: E402

SPELLINGS = {
    "relu": torch.relu,
    "leaky_relu 0": lambda y: F.leaky_relu(y, 0.0),
    "leaky_relu -0": lambda y: F.leaky_relu(y, -0.0),
    "clamp_min 0": lambda y: torch.clamp(y, min=0.0),
    "hardtanh 0..max": lambda y: F.hardtanh(y, 0.0, 3.4e38),
    "max_pool": lambda y: F.max_pool2d(y, 2, 2),
}


def _kept(y: torch.Tensor) -> torch.Tensor:
    """NaN where CpuRef's ReLU or max pool gives NaN: torch's eager relu keeps it, as the project's
    pool does (``nn.max_pool``)."""
    return torch.relu(y)


def _fused_nans(activation, nan_true=_kept) -> tuple[int, int, bool]:
    """(NaNs out of the compiled conv -> activation, NaNs where CpuRef has them, whether the fuser
    made a partition), on a channels-last input with NaN in two pixels."""
    weight, bias = torch.randn(8, 4, 3, 3), torch.randn(8)

    class Block(torch.nn.Module):
        def forward(self, x):
            return activation(F.conv2d(x, weight, bias, 1, 1))

    x = torch.randn(1, 4, 16, 16).contiguous(memory_format=torch.channels_last)
    x[0, 1, 4, 4] = x[0, 2, 9, 11] = float("nan")
    with fusion_switch(True), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation
        module = torch.jit.freeze(torch.jit.trace(Block().eval(), (x,)))
        for _ in range(2):  # the profiled run, then the one that compiles the partitions
            module(x)
        got = module(x)
        fused = "oneDNNFusionGroup" in str(torch.jit.last_executed_optimized_graph())
        want = nan_true(F.conv2d(x, weight, bias, 1, 1))
    return int(torch.isnan(got).sum()), int(torch.isnan(want).sum()), fused


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_the_fused_spellings_lose_nan(name: str) -> None:
    pool = name == "max_pool"
    got, want, fused = _fused_nans(SPELLINGS[name], (lambda y: nn.max_pool(
        y, kernel_shape=[2, 2], strides=[2, 2])[0]) if pool else _kept)
    assert fused and want > 0
    assert got < want, f"oneDNN Graph's fused {name} keeps NaN now: it may replace the ELU"


def test_elu_with_alpha_0_keeps_nan_fused() -> None:
    got, want, fused = _fused_nans(lambda y: F.elu(y, 0.0))
    assert fused and got == want > 0
