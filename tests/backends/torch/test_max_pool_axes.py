"""An unpadded small MaxPool's window maximum taken one spatial axis after the other
(``nn._strided_max``): k - 1 torch.maximum calls per axis of k where every offset of the window
took one (k * k - 1), the same values as CpuRef's pool, NaN and -Inf included."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels import pool as ref_pool  # noqa: E402
from backplane.backends.torch.kernels import nn  # noqa: E402

CL = torch.channels_last


def _maxima(x: torch.Tensor, kernel: list[int], strides: list[int]) -> tuple[torch.Tensor, int]:
    """The pool's output and how many torch.maximum calls made it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (y,) = nn.max_pool(x, kernel_shape=kernel, strides=strides)
    return y, sum(e.count for e in prof.key_averages() if e.key == "aten::maximum")


@pytest.mark.parametrize("shape, kernel, strides, calls", [
    ((1, 16, 64, 64), [2, 2], [2, 2], 2),  # the U-Net's (unet_resize_dyn20): 3 calls before
    ((2, 8, 31, 33), [3, 3], [2, 2], 4),  # a ResNet stem's window: 8 before
    ((1, 4, 12, 12), [3, 1], [1, 1], 2),
    ((1, 2, 8, 8, 8), [2, 2, 2], [2, 2, 2], 3),  # 7 before
])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_window_is_reduced_axis_by_axis(shape, kernel, strides, calls, channels_last) -> None:
    rng = np.random.default_rng(len(shape) + kernel[0])
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:: max(1, flat.size // 9)] = np.nan
    flat[5] = -np.inf
    t = torch.from_numpy(x)
    if channels_last and t.dim() == 4:
        t = t.contiguous(memory_format=CL)
    y, made = _maxima(t, kernel, strides)
    assert made == calls
    want = ref_pool.max_pool(x, kernel_shape=kernel, strides=strides)[0]
    np.testing.assert_array_equal(y.numpy(), want)
    assert np.isnan(want).any()
    if channels_last and t.dim() == 4:
        assert y.is_contiguous(memory_format=CL)  # the next convolution reads it without a copy
