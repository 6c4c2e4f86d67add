"""The U-Net's kernels at users' sizes (issue 27, ``unet_resize_dyn20``): an unpadded MaxPool of a
small window is the maximum of its strided views (``nn._strided_max``), in a trace too, where
torch's pool with indices stood (5-8 times slower on NCHW); a ConvTranspose whose result is whole
takes its bias in the call (no empty pad's copy, no add). Each against CpuRef's kernel, NaN
included, in both memory layouts."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels import conv as ref_conv  # noqa: E402
from backplane.backends.reference.kernels import pool as ref_pool  # noqa: E402
from backplane.backends.torch.kernels import network, nn  # noqa: E402

CL = torch.channels_last
POOLS = [  # (shape, kernel, strides, ceil_mode)
    ((1, 16, 32, 32), [2, 2], [2, 2], 0), ((2, 8, 15, 17), [3, 3], [2, 2], 0),
    ((1, 4, 9, 9), [3, 3], [1, 1], 0), ((1, 4, 9, 9), [3, 3], [2, 2], 1),
    ((1, 3, 8, 8), [1, 1], [2, 2], 0), ((1, 5, 20), [2], [2], 0), ((1, 2, 6, 6, 6), [2, 2, 2], [2, 2, 2], 0)]


def _with_nan(shape: tuple[int, ...], seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:: max(1, flat.size // 7)] = np.nan  # a few windows hold NaN, some at their border
    flat[3] = -np.inf
    return x


def _layouts(x: np.ndarray) -> list[torch.Tensor]:
    t = torch.from_numpy(x)
    return [t, t.contiguous(memory_format=CL)] if t.dim() == 4 else [t]


@pytest.mark.parametrize("shape,kernel,strides,ceil", POOLS)
def test_a_small_unpadded_max_pool_is_cpurefs_nan_included(shape, kernel, strides, ceil) -> None:
    x = _with_nan(shape, len(shape) + kernel[0])
    want = ref_pool.max_pool(x, kernel_shape=kernel, strides=strides, ceil_mode=ceil)[0]
    for t in _layouts(x):
        got = nn.max_pool(t, kernel_shape=kernel, strides=strides, ceil_mode=ceil)[0]
        np.testing.assert_array_equal(got.numpy(), want)
        assert not np.shares_memory(got.numpy(), x)  # the output is its own


def test_a_traced_max_pool_holds_no_pool_with_indices() -> None:
    x = torch.from_numpy(_with_nan((1, 16, 32, 32), 0)).contiguous(memory_format=CL)
    with torch.no_grad():
        traced = torch.jit.trace(
            lambda t: nn.max_pool(t, kernel_shape=[2, 2], strides=[2, 2])[0], (x,), check_trace=False)
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert not any("max_pool" in kind for kind in kinds), kinds
    want = ref_pool.max_pool(x.numpy(), kernel_shape=[2, 2], strides=[2, 2])[0]
    np.testing.assert_array_equal(traced(x).numpy(), want)


def test_a_padded_or_large_window_is_still_torchs_pool() -> None:
    x = torch.from_numpy(_with_nan((1, 4, 12, 12), 1))
    for attrs in ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, {"kernel_shape": [5, 5]},
                  {"kernel_shape": [2, 2], "dilations": [2, 2]}):
        want = ref_pool.max_pool(x.numpy(), **attrs)[0]
        np.testing.assert_array_equal(nn.max_pool(x, **attrs)[0].numpy(), want)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    {"kernel_shape": [3, 3], "strides": [1, 1], "dilations": [2, 2]},
    {"kernel_shape": [4, 4], "strides": [2, 2], "group": 2, "pads": [1, 0, 1, 0]}])
def test_conv_transpose_is_cpurefs_with_and_without_a_crop(attrs) -> None:
    rng = np.random.default_rng(2)
    group = attrs.get("group", 1)
    x = rng.standard_normal((1, 8, 9, 10)).astype(np.float32)
    x[0, 1, 4, 4] = np.nan
    w = rng.standard_normal((8, 6 // group, *attrs["kernel_shape"])).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    want = ref_conv.conv_transpose(x, w, b, **attrs)[0]
    for t in _layouts(x):
        got = network.conv_transpose(t, torch.from_numpy(w), torch.from_numpy(b), **attrs)[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_a_whole_conv_transpose_takes_its_bias_in_the_call() -> None:
    x = torch.randn(1, 8, 16, 16).contiguous(memory_format=CL)
    w, b = torch.randn(8, 8, 2, 2), torch.randn(8)
    with torch.no_grad():
        traced = torch.jit.trace(
            lambda t: network.conv_transpose(t, w, b, kernel_shape=[2, 2], strides=[2, 2])[0],
            (x,), check_trace=False)
    kinds = [node.kind() for node in traced.graph.nodes()]
    assert "aten::constant_pad_nd" not in kinds and "aten::add" not in kinds, kinds
    want = ref_conv.conv_transpose(x.numpy(), w.numpy(), b.numpy(), kernel_shape=[2, 2],
                                   strides=[2, 2])[0]
    np.testing.assert_allclose(traced(x).numpy(), want, rtol=1e-4, atol=1e-4)
