"""CpuAcc's Resize through torch's own upsampling kernels (``kernels/upsample.interpolated``) where
ONNX's mode and coordinate transformation are torch's: the values CpuRef and ONNX Runtime give,
NaN and Inf where CpuRef puts them (torch reads a border input at weight 0; those outputs are
mended by the taps path), and the taps path kept where torch computes otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from backplane import InferenceSession
from backplane.backends.torch.kernels import upsample

ort = pytest.importorskip("onnxruntime")

# (mode, coordinate transformation, nearest_mode, input shape, scales): torch's kernel takes them
TORCH_CASES = [
    ("linear", "half_pixel", "floor", (1, 16, 32, 32), (1, 1, 2, 2)),  # the U-Net's decoder
    ("linear", "pytorch_half_pixel", "floor", (1, 1024, 5, 7), (1, 1, 0.5, 1.7)),
    ("linear", "align_corners", "floor", (2, 512, 6), (1, 1, 3.0)),
    ("linear", "half_pixel", "floor", (1, 32, 4, 6, 4), (1, 1, 2, 1.5, 2)),
    ("nearest", "asymmetric", "floor", (1, 3, 5, 7), (1, 1, 2, 3)),
    ("nearest", "half_pixel", "round_prefer_ceil", (1, 2, 9, 9), (1, 1, 1 / 3, 2)),
    ("linear", "half_pixel", "floor", (1, 3, 8, 8), (1, 1, 2, 2)),  # few outputs, copies mended
]
"""Linear ones of three axes with outputs to mend have ``upsample._MEND_FROM`` outputs or more."""
# ... and where it does not: the taps path
TAPS_CASES = [
    ("linear", "asymmetric", "floor", (1, 2, 4, 4), (1, 1, 2, 2)),  # no torch form
    ("nearest", "half_pixel", "round_prefer_floor", (1, 2, 4, 4), (1, 1, 2, 2)),  # ONNX's default
    ("linear", "half_pixel", "floor", (1, 2, 9, 9), (1, 1, 1 / 3, 1 / 3)),  # every output mended
    ("nearest", "asymmetric", "floor", (2, 4, 4, 4), (1, 0.5, 2, 2)),  # channels resized
    ("linear", "half_pixel", "floor", (1, 3, 4, 4, 4), (1, 1, 2, 2, 2)),  # too few to mend
    ("linear", "half_pixel", "floor", (1, 16, 32, 32), (1, 1, 2, 1)),  # an axis of one size
]


def _model(mode: str, transform: str, nearest: str, shape: tuple[int, ...],
           scales: tuple[float, ...]) -> bytes:
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, nearest_mode=nearest,
                            coordinate_transformation_mode=transform)
    graph = helper.make_graph(
        [node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("scales", TensorProto.FLOAT, [len(scales)], list(scales))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)],
                             ir_version=8).SerializeToString()


def _takes_torch(mode, transform, nearest, shape, scales) -> bool:
    x = torch.zeros(shape)
    factors = [float(np.float32(s)) for s in scales]
    out = [int(np.floor(n * f)) for n, f in zip(shape, factors)]
    got = upsample.interpolated(x, list(range(len(shape))), list(shape), out, factors, transform,
                               mode, nearest, 0, -0.75, 0)
    return got is not None


def _runs(case: tuple, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    model = _model(*case)
    (acc,) = InferenceSession(model, backends=["CpuAcc"]).run(None, {"x": x})
    (ref,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    (want,) = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    return acc, ref, want


@pytest.mark.parametrize("case", TORCH_CASES + TAPS_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}")
def test_resize_matches_cpuref_and_onnxruntime(case) -> None:
    assert _takes_torch(*case) == (case in TORCH_CASES)
    x = np.random.default_rng(0).standard_normal(case[3]).astype(np.float32)
    acc, ref, want = _runs(case, x)
    assert acc.shape == ref.shape == want.shape
    np.testing.assert_allclose(acc, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}")
def test_nan_and_inf_stay_where_cpuref_puts_them(case) -> None:
    x = np.random.default_rng(1).standard_normal(case[3]).astype(np.float32)
    x.reshape(-1)[[1, 7, x.size - 1]] = [np.nan, np.inf, np.nan]  # borders and inside
    acc, ref, _ = _runs(case, x)
    np.testing.assert_array_equal(np.isnan(acc), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(acc), np.isposinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(acc[finite], ref[finite], rtol=1e-5, atol=1e-5)


def test_the_border_outputs_torch_reads_at_weight_0_are_mended() -> None:
    """Bilinear x2, half_pixel: torch's first output row reads input row 1 at weight 0, so a NaN
    there would reach it (0 * NaN); CpuRef's taps read row 0 alone."""
    rows = upsample._probe("linear", False, 8, 16, 2.0, "torch.float32", "half_pixel", "linear",
                         "floor", -0.75, 0)
    assert rows is not None and list(rows) == [0]


def test_an_inf_column_of_an_axis_not_resized_stays_inf() -> None:
    """H x2, W x1: torch's 2-d kernel weighs the unresized axis (its 1-d kernel, the probe, copies
    it), and an Inf column came out NaN where CpuRef keeps Inf (ONNX Runtime reads at weight 0
    too: its first column is NaN)."""
    case = ("linear", "half_pixel", "floor", (1, 16, 32, 32), (1, 1, 2, 1))
    x = np.random.default_rng(2).standard_normal(case[3]).astype(np.float32)
    x[:, :, :, 1] = np.inf
    acc, ref, _ = _runs(case, x)
    assert np.isposinf(ref[:, :, :, 1]).all()
    np.testing.assert_array_equal(acc, ref)


@pytest.mark.parametrize("shape", [(1, 16, 32, 32), (2, 8, 40, 24)])
def test_mended_borders_copy_an_input_and_their_crossings_too(shape) -> None:
    """Bilinear x2, half_pixel: each mended border output copies one input (``upsample._copies``), so
    it is mended by torch's 1-d kernel along the other axis and, where a mended row crosses a
    mended column, by the input itself: NaN and Inf in the second row and column (read at weight
    0 by the first output row and column, and by their crossing) reach what CpuRef reads them."""
    case = ("linear", "half_pixel", "floor", shape, (1, 1, 2, 2))
    assert upsample._copies(((0,), (0,)), ((shape[2], 2 * shape[2], 2.0),
                                         (shape[3], 2 * shape[3], 2.0)),
                          "half_pixel", "linear", "floor", -0.75, 0) is not None
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    x[:, 0, 1, 1] = np.nan  # the crossing's weight-0 read
    x[:, 1, 1, 5] = np.inf  # the first output row's
    x[:, 2, 7, 1] = -np.inf  # the first output column's
    x[:, 3, 1, :] = np.nan
    acc, ref, _ = _runs(case, x)
    np.testing.assert_array_equal(np.isnan(acc), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(acc), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(acc), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(acc[finite], ref[finite], rtol=1e-5, atol=1e-5)


DOUBLING_CASES = [
    ("linear", "half_pixel", "floor", (2, 3, 5, 7), (1, 1, 2, 2)),
    ("linear", "half_pixel", "floor", (1, 4, 6, 5), (1, 1, 4, 2)),
    ("linear", "half_pixel", "floor", (1, 3, 12, 16), (1, 1, 8, 2)),
    ("linear", "pytorch_half_pixel", "floor", (2, 3, 9), (1, 1, 2)),
]


@pytest.mark.parametrize("case", DOUBLING_CASES, ids=lambda c: f"{c[1]}-{c[3]}-{c[4]}")
def test_a_doubling_reads_a_replicated_border_instead_of_mending(case, monkeypatch) -> None:
    """Bilinear x2, x4 or x8, half-pixel: torch's kernel on the input padded by one replicated
    line each side (``upsample._replicated``), not mended after (``_copied`` fails here): NaN and
    infinities next to the borders (read at weight 0 unpadded) stay where CpuRef puts them, the
    values within 1e-5 of CpuRef's and ONNX Runtime's, channels-last as NCHW."""
    def mended(*_: object) -> None:
        raise AssertionError("mended after torch's kernel")

    monkeypatch.setattr(upsample, "_copied", mended)
    x = np.random.default_rng(4).standard_normal(case[3]).astype(np.float32)
    acc, ref, want = _runs(case, x)
    np.testing.assert_allclose(acc, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)
    x[..., 1] = np.nan  # the first output column's weight-0 read
    x[:, 1, ..., 0] = np.inf
    if x.ndim == 4:
        x[:, 2, -2, :] = -np.inf  # the last output row's
    acc, ref, _ = _runs(case, x)
    np.testing.assert_array_equal(np.isnan(acc), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(acc), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(acc), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(acc[finite], ref[finite], rtol=1e-5, atol=1e-5)
    if x.ndim == 4:
        X = torch.from_numpy(x)
        factors = [float(s) for s in case[4]]
        out = [int(n * f) for n, f in zip(x.shape, factors)]
        args = (list(range(4)), list(x.shape), out, factors, case[1], "linear", "floor", 0, -0.75, 0)
        plain = upsample.interpolated(X, *args)
        last = upsample.interpolated(X.contiguous(memory_format=torch.channels_last), *args)
        torch.testing.assert_close(last, plain, rtol=0, atol=0, equal_nan=True)
