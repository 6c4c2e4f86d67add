"""CpuAcc's Resize on the taps path (``kernels/vision.resize``) leaves an axis that each output
reads at weight 1 from its own position as it is: a 2-d Resize's batch and channel axes (scales 1)
were two gathers, products and sums of their own, a U-Net's decoder's in every run. Values, NaN
and Inf stay where CpuRef puts them."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: F401  # CpuAcc's kernels

from backplane import InferenceSession
from backplane.backends.torch.kernels import vision
from tests.backends.torch.test_resize_interpolate import _model as resize_model

# (mode, coordinate transformation, input shape, scales): taps path cases (no torch kernel for
# the mode and transformation)
CASES = [
    ("linear", "asymmetric", (1, 8, 16, 16), (1, 1, 2, 2)),  # unet_resize_ts13's decoder's sizes
    ("cubic", "half_pixel", (2, 3, 5, 6), (1, 1, 1.5, 2)),
    ("nearest", "asymmetric", (1, 4, 6, 6), (1, 1, 1, 2)),  # a spatial axis left too
]


def _model(mode: str, transform: str, shape: tuple[int, ...], scales: tuple[float, ...]) -> bytes:
    return resize_model(mode, transform, "round_prefer_floor", shape, scales)  # ONNX's default


def _counted(monkeypatch) -> list[int]:
    """The axes ``vision._resized`` resizes, in the order of its calls."""
    axes: list[int] = []
    resized = vision._resized

    def counting(y, axis, taps):
        axes.append(axis)
        return resized(y, axis, taps)

    monkeypatch.setattr(vision, "_resized", counting)
    return axes


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def test_only_the_axes_that_change_are_resized(case, monkeypatch) -> None:
    model = _model(*case)
    x = np.random.default_rng(0).standard_normal(case[2]).astype(np.float32)
    axes = _counted(monkeypatch)
    (got,) = InferenceSession(model, backends=["CpuAcc"]).run(None, {"x": x})
    assert axes == [a for a, s in enumerate(case[3]) if s != 1]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def test_nan_and_inf_stay_where_cpuref_puts_them(case) -> None:
    model = _model(*case)
    x = np.random.default_rng(1).standard_normal(case[2]).astype(np.float32)
    x.reshape(-1)[[3, 17]] = [np.nan, np.inf]
    (got,) = InferenceSession(model, backends=["CpuAcc"]).run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
