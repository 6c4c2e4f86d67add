"""CpuAcc's 1-d convolution of few outputs as one matrix product of its windows
(``kernels.nn._conv1d_as_product``): where it is taken, and that it computes what CpuRef computes,
padding, strides, dilations, a batch and NaN included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.kernels import nn  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(3)


def _conv1d(x_shape: list[int], w_shape: tuple[int, int, int], **attrs) -> onnx.ModelProto:
    """x -> Conv (1-d, with bias) -> Relu, its output shape left to the loader."""
    inits = [numpy_helper.from_array((RNG.standard_normal(w_shape) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(RNG.standard_normal(w_shape[0]).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", **attrs),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [float_input("x", x_shape)], [float_input("y", None)], inits)


CASES = [  # (input, weight, Conv attributes): a VAD's encoder and front end, then the edges
    ([1, 258, 5], (128, 258, 3), {"pads": [1, 1]}),
    ([1, 1, 576], (258, 1, 256), {"pads": [64, 64], "strides": [128]}),
    ([2, 64, 9], (128, 64, 3), {"strides": [2], "dilations": [2]}),
    ([1, 96, 7], (64, 96, 2), {"pads": [0, 1]}),
    ([1, 48, 4], (96, 48, 3), {"auto_pad": "SAME_UPPER"}),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_a_few_outputs_run_as_one_product_equal_to_cpuref(x_shape, w_shape, attrs) -> None:
    model = _conv1d(x_shape, w_shape, **attrs)
    x = RNG.standard_normal(x_shape).astype(np.float32)
    x[0, 0, 2] = np.nan  # the outputs whose windows read it are NaN, the others not
    session = InferenceSession(model, backends=["CpuAcc"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = session.run(None, {"x": x})[0]
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_convolution" not in ops and "aten::linear" in ops, sorted(ops)
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_shape, w_shape, groups", [
    ([1, 16, 100], (32, 16, 3), 1),  # 98 outputs: torch's conv1d is as fast or faster
    ([1, 16, 5], (32, 16, 3), 1),  # 1536 weights: a few us either way
    ([1, 64, 5], (128, 32, 3), 2),  # grouped
])
def test_more_outputs_fewer_weights_or_groups_keep_torch_s_conv1d(x_shape, w_shape, groups) -> None:
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (y,) = nn.conv(x, w, None, group=groups)
    assert "aten::_convolution" in {event.key for event in prof.key_averages()}
    torch.testing.assert_close(y, torch.nn.functional.conv1d(x, w, None, groups=groups))


def test_the_product_reads_a_strided_input_view() -> None:
    x = torch.randn(1, 12, 258).transpose(1, 2)  # (1, 258, 12) seen through strides
    w, b = torch.randn(128, 258, 3), torch.randn(128)
    (y,) = nn.conv(x[:, :, :5], w, b, pads=[1, 1])
    torch.testing.assert_close(y, torch.nn.functional.conv1d(x[:, :, :5], w, b, padding=1),
                               rtol=1e-4, atol=1e-4)
