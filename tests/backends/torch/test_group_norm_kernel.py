"""CpuAcc's InstanceNormalization and GroupNormalization as torch's ``group_norm`` without its
affine, then one ``addcmul`` (``kernels/network.group_normalization``): one normalization op in a
trace, not the five of the statistics written out, with CpuRef's values, a constant group's output
exactly its bias, and NaN kept to its group.

    python -m pytest tests/backends/torch/test_group_norm_kernel.py -q -p no:cacheprovider
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels import normalization as reference  # noqa: E402
from backplane.backends.torch.kernels import network  # noqa: E402


def _ops(function, *values):
    with torch.no_grad():
        graph = torch.jit.trace(function, values).graph
    return [node.kind() for node in graph.nodes() if node.kind() != "prim::Constant"]


def test_a_traced_instance_norm_is_one_group_norm() -> None:
    x, scale, bias = torch.randn(1, 16, 79), torch.randn(16), torch.randn(16)
    ops = _ops(lambda v: network.instance_normalization(v, scale, bias)[0], x)
    assert ops.count("aten::group_norm") == 1
    assert not {"aten::var_mean", "aten::sqrt", "aten::div", "aten::sub"} & set(ops), ops


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_a_traced_group_norm_is_one_group_norm(groups: int) -> None:
    x, scale, bias = torch.randn(2, 4, 3, 5), torch.randn(4), torch.randn(4)
    ops = _ops(lambda v: network.group_normalization(v, scale, bias, 1e-5, groups)[0], x)
    assert ops.count("aten::group_norm") == 1 and "aten::var_mean" not in ops, ops


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("shape", [(1, 16, 79), (2, 3, 4, 5), (1, 2, 1), (1, 4, 2, 3, 2)])
def test_instance_norm_matches_cpuref(shape: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    scale, bias = (rng.standard_normal(shape[1]).astype(dtype) for _ in range(2))
    got = network.instance_normalization(*map(torch.from_numpy, (x, scale, bias)), 1e-5)[0]
    (want,) = reference.instance_normalization(x, scale, bias, 1e-5)
    assert got.dtype == torch.from_numpy(want).dtype
    tolerance = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.numpy(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("opset", [18, 21])
def test_group_norm_matches_cpuref(opset: int) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 7)).astype(np.float32)
    params = 3 if opset == 18 else 6
    scale, bias = (rng.standard_normal(params).astype(np.float32) for _ in range(2))
    kernel = network.group_normalization_v18 if opset == 18 else network.group_normalization
    want_kernel = (reference.group_normalization_v18 if opset == 18
                   else reference.group_normalization)
    got = kernel(*map(torch.from_numpy, (x, scale, bias)), 1e-5, 3)[0]
    (want,) = want_kernel(x, scale, bias, 1e-5, 3)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_constant_group_is_its_bias_exactly() -> None:
    """torch's own affine (folded into the normalization) made 1.5 -> 1.5e-5, not 0."""
    x = torch.randn(1, 3, 7)
    x[0, 1] = 1.5
    bias = torch.tensor([0.25, -0.5, 2.0])
    y = network.instance_normalization(x, torch.tensor([3.0, 7.0, 1.0]), bias)[0]
    assert torch.equal(y[0, 1], torch.full((7,), -0.5))
    y = network.group_normalization(torch.full((1, 4, 3), 1.5), torch.ones(4), torch.zeros(4),
                                    1e-5, 2)[0]
    assert torch.equal(y, torch.zeros(1, 4, 3))


def test_nan_stays_in_its_group() -> None:
    x = torch.randn(1, 4, 6)
    x[0, 2, 3] = float("nan")
    scale, bias = torch.randn(4), torch.randn(4)
    y = network.instance_normalization(x, scale, bias)[0]
    assert bool(y[0, 2].isnan().all()) and not bool(y[0, [0, 1, 3]].isnan().any())
    want = reference.instance_normalization(x.numpy(), scale.numpy(), bias.numpy())[0]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    y = network.group_normalization(x, scale, bias, 1e-5, 2)[0]
    assert bool(y[0, 2:].isnan().all()) and not bool(y[0, :2].isnan().any())


@pytest.mark.parametrize("groups", [8, 2])
def test_a_channels_last_input_is_normalized_as_a_contiguous_one(groups: int) -> None:
    """torch's channels-last group_norm takes E[x^2] - E[x]^2: at mean 100 and deviation 0.1 its
    values were up to 0.33 from float64's."""
    x = torch.full((1, 8, 6, 5), 100.0) + torch.randn(1, 8, 6, 5, generator=torch.Generator()
                                                      .manual_seed(0)) * 0.1
    scale, bias = torch.ones(8), torch.zeros(8)
    want = torch.group_norm(x.double(), groups, None, None, 1e-5)
    got = network.group_normalization(x.contiguous(memory_format=torch.channels_last), scale,
                                      bias, 1e-5, groups)[0]
    assert float((got.double() - want).abs().max()) < 1e-3
