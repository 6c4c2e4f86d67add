"""One explicit case per bug that the differential tests (``test_differential.py``) found in the torch
kernels: each was a layer CpuAcc claimed and then failed on, or answered otherwise than CpuRef (the
float64 HardSwish / HardSigmoid ones were seen on GpuAcc, whose CUDA kernels compute them in float;
here they check the float64 path CpuAcc shares).

Each case runs the layer on CpuRef and on CpuAcc (inputs through CpuAcc's tensor-handle factory, or
as the non-contiguous tensors a layer before would hand over) and asserts CpuAcc claims it and
matches, or refuses it with a reason (the layer then falls back to CpuRef).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.backend import CpuRef  # noqa: E402
from backplane.backends.torch.backend import CpuAcc  # noqa: E402
from backplane.ir.graph import UNKNOWN, Layer, TensorInfo  # noqa: E402

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)


def _layer(op: str, n_inputs: int, attrs: dict[str, Any] | None = None, opset: int = 21,
           n_outputs: int = 1, absent: Sequence[int] = ()) -> Layer:
    inputs = ["" if i in absent else f"x{i}" for i in range(n_inputs)]
    return Layer(op.lower(), op, inputs, [f"y{j}" for j in range(n_outputs)], dict(attrs or {}),
                 "", opset)


def _infos(values: Sequence[Any]) -> list[TensorInfo]:
    return [UNKNOWN if v is None else TensorInfo(tuple(np.shape(v)), np.asarray(v).dtype)
            for v in values]


def reference(layer: Layer, inputs: Sequence[Any]) -> list[np.ndarray]:
    infos = _infos(inputs)
    assert CpuRef().is_layer_supported(layer, infos, [UNKNOWN] * len(layer.outputs))
    workload = CpuRef().create_workload_factory().create_workload(layer, infos, [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [np.asarray(r) for r in workload(*[None if v is None else np.array(v)
                                                  for v in inputs])[:len(layer.outputs)]]


def acc(layer: Layer, inputs: Sequence[Any], tensors: Sequence[Any] | None = None,
        out_infos: Sequence[TensorInfo] | None = None) -> list[np.ndarray]:
    """CpuAcc's outputs for ``inputs`` (given to it as ``tensors`` if those are given), asserting
    that it claims the layer."""
    backend = CpuAcc()
    factory = backend.tensor_handle_factories()[0]
    in_infos = _infos(inputs)
    outs = list(out_infos) if out_infos is not None else _infos(reference(layer, inputs))
    support = backend.is_layer_supported(layer, in_infos, outs)
    assert support, f"CpuAcc refuses: {support.reason}"
    if tensors is None:
        tensors = [None if v is None else factory.copy_in(np.array(v)) for v in inputs]
    workload = backend.create_workload_factory().create_workload(layer, in_infos, outs)
    results = workload(*tensors)
    assert len(results) >= len(layer.outputs)
    return [factory.copy_out(r) for r in results[:len(layer.outputs)]]


def assert_same(layer: Layer, inputs: Sequence[Any], tensors: Sequence[Any] | None = None,
                rtol: float = 0.0, atol: float = 0.0) -> list[np.ndarray]:
    want = reference(layer, inputs)
    got = acc(layer, inputs, tensors)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                   atol=atol, equal_nan=True)
    return got


def refusal(layer: Layer, inputs: Sequence[Any], out_infos: Sequence[TensorInfo] | None = None) -> str:
    support = CpuAcc().is_layer_supported(layer, _infos(inputs),
                                          out_infos if out_infos is not None else
                                          [UNKNOWN] * len(layer.outputs))
    assert not support, f"CpuAcc claims {layer.op_type}"
    assert support.reason
    return support.reason


# -- Gather: a 0-d index of a 1-D tensor (seen in the wild) ----------------------------------------
@pytest.mark.parametrize("index", [0, 2, -1, -3])
def test_gather_of_a_0d_index_from_a_1d_tensor_is_0d(index: int) -> None:
    data = np.array([10.0, 20.0, 30.0], np.float32)
    (y,) = assert_same(_layer("Gather", 2), [data, np.array(index, np.int64)])
    assert y.shape == () and y == data[index]


def test_gather_of_a_0d_index_keeps_the_other_axes() -> None:
    data = np.arange(12, dtype=np.int64).reshape(3, 4)
    (y,) = assert_same(_layer("Gather", 2, {"axis": 1}), [data, np.array(-1, np.int32)])
    np.testing.assert_array_equal(y, [3, 7, 11])


# -- Div: integer division by zero -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_integer_division_by_zero_gives_cpurefs_zero_instead_of_raising(dtype: Any) -> None:
    a = np.array([7, 5, 0, 9], dtype)
    b = np.array([0, 2, 0, 3], dtype)
    (y,) = assert_same(_layer("Div", 2), [a, b])
    np.testing.assert_array_equal(y, np.array([0, 2, 0, 3], dtype))


def test_integer_division_truncates_and_broadcasts_with_a_zero_divisor() -> None:
    a = np.array([[-7, 7], [5, -5]], np.int32)
    b = np.array([0, 2], np.int32)
    (y,) = assert_same(_layer("Div", 2), [a, b])
    np.testing.assert_array_equal(y, [[0, 3], [0, -2]])


# -- Clip before opset 11 on float16: the default bounds overflow float16 --------------------------
@pytest.mark.parametrize("attrs", [{}, {"min": -1e5}, {"max": 1e5}, {"min": -1.5, "max": 2.25},
                                   {"min": 7e4}])
def test_clip_v6_on_float16(attrs: dict[str, float]) -> None:
    x = np.array([-70.0, -1.0, 0.5, 3.0, np.inf, -np.inf, np.nan], np.float16)
    assert_same(_layer("Clip", 1, attrs, opset=6), [x])


# -- Softplus: exp overflowed for large inputs -----------------------------------------------------
@pytest.mark.parametrize("dtype, big", [(np.float32, 100.0), (np.float32, 1e4), (np.float16, 12.0),
                                        (np.float16, 1e4), (np.float64, 800.0)])
def test_softplus_of_a_large_input_is_the_input(dtype: Any, big: float) -> None:
    x = np.array([big, -big, 0.0, 1.0], dtype)
    (y,) = assert_same(_layer("Softplus", 1), [x], rtol=1e-3, atol=1e-6)
    assert np.isfinite(y[0]) and y[0] == dtype(big)


# -- Sign of NaN -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_sign_of_nan_is_nan(dtype: Any) -> None:
    x = np.array([np.nan, -2.0, 0.0, 3.0, -np.inf], dtype)
    (y,) = assert_same(_layer("Sign", 1), [x])
    assert np.isnan(y[0])


# -- BatchNormalization, opset 15: scale, bias and statistics of other types than X ----------------
@pytest.mark.parametrize("x_type, param_type, stat_type", [
    (np.float16, np.float32, np.float32), (np.float32, np.float64, np.float16),
    (np.float64, np.float32, np.float64)])
def test_batch_normalization_with_mixed_types(x_type: Any, param_type: Any, stat_type: Any) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(x_type)
    scale, bias = (rng.standard_normal(3).astype(param_type) for _ in range(2))
    mean, var = rng.standard_normal(3).astype(stat_type), rng.uniform(0.5, 2, 3).astype(stat_type)
    (y,) = assert_same(_layer("BatchNormalization", 5, opset=15), [x, scale, bias, mean, var],
                       rtol=5e-3, atol=5e-3)
    assert y.dtype == x_type


# -- Split (opset 18) into num_outputs with empty parts --------------------------------------------
@pytest.mark.parametrize("size, count, sizes", [(4, 3, [2, 2, 0]), (0, 2, [0, 0]), (5, 3, [2, 2, 1]),
                                                (1, 2, [1, 0])])
def test_split_into_num_outputs_makes_every_output(size: int, count: int, sizes: list[int]) -> None:
    x = np.arange(size * 2, dtype=np.float32).reshape(size, 2)
    layer = _layer("Split", 1, {"num_outputs": count}, opset=18, n_outputs=count)
    parts = assert_same(layer, [x])
    assert [p.shape[0] for p in parts] == sizes


# -- Slice with a step of INT64_MAX / INT64_MIN ----------------------------------------------------
@pytest.mark.parametrize("start, end, step, want", [
    (0, 4, INT64_MAX, [0]), (1, INT64_MAX, INT64_MAX, [1]), (-1, INT64_MIN, INT64_MIN, [3]),
    (INT64_MAX, INT64_MIN, -(2**62), [3])])
def test_slice_with_a_huge_step(start: int, end: int, step: int, want: list[int]) -> None:
    data = np.array([[0, 1, 2, 3]] * 2, np.int64)
    args = [data, *(np.array([v], np.int64) for v in (start, end, 1, step))]
    (y,) = assert_same(_layer("Slice", 5), args)
    np.testing.assert_array_equal(y, [want] * 2)


def test_slice_with_a_huge_step_of_a_strided_view() -> None:
    """The step times the view's stride overflowed torch's stride arithmetic (a negative stride)."""
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    wide = torch.zeros(2, 8)
    wide[:, ::2] = torch.from_numpy(data)
    view = wide[:, ::2]
    args = [data, *(np.array([v], np.int64) for v in (0, 4, 1, INT64_MAX))]
    tensors = [view, *(torch.from_numpy(a) for a in args[1:])]
    (y,) = assert_same(_layer("Slice", 5), args, tensors)
    np.testing.assert_array_equal(y, [[0], [4]])


# -- AveragePool over 3 spatial axes on float16 ----------------------------------------------------
@pytest.mark.parametrize("attrs", [{"kernel_shape": [2, 2, 2]},
                                   {"kernel_shape": [3, 1, 2], "pads": [1, 0, 1, 1, 0, 1],
                                    "count_include_pad": 1, "ceil_mode": 1, "strides": [2, 1, 2]}])
def test_average_pool_3d_on_float16(attrs: dict[str, Any]) -> None:
    x = np.random.default_rng(1).uniform(-4, 4, (1, 2, 3, 4, 5)).astype(np.float16)
    assert_same(_layer("AveragePool", 1, attrs, opset=19), [x], rtol=2e-3, atol=2e-3)


# -- windows larger than the padded input ----------------------------------------------------------
@pytest.mark.parametrize("op, attrs, shapes", [
    # ceil_mode: one partial window over an input smaller than the kernel (CpuRef: its mean / max)
    ("AveragePool", {"kernel_shape": [3], "strides": [3], "ceil_mode": 1}, [(1, 2, 1)]),
    ("MaxPool", {"kernel_shape": [1, 3], "strides": [1, 3], "ceil_mode": 1}, [(2, 1, 2, 2)]),
    # an empty batch: CpuRef gives the empty result
    ("Conv", {"auto_pad": "VALID", "group": 2}, [(0, 2, 2), (2, 1, 3)])])
def test_a_window_larger_than_the_padded_input_is_refused(op: str, attrs: dict[str, Any],
                                                          shapes: list[tuple[int, ...]]) -> None:
    """torch raises on such a window ("Kernel size can't be greater than actual input size"):
    refused, the layer falls back to CpuRef."""
    inputs = [np.random.default_rng(2).uniform(-1, 1, s).astype(np.float32) for s in shapes]
    layer = _layer(op, len(inputs), attrs, opset=19)
    want = reference(layer, inputs)
    assert "larger than its padded input" in refusal(layer, inputs, _infos(want))


def test_a_window_that_fits_is_still_claimed() -> None:
    x = np.ones((1, 1, 2), np.float32)
    layer = _layer("MaxPool", 1, {"kernel_shape": [3], "pads": [1, 0]})
    assert_same(layer, [x])


# -- types torch has no dtype for, when the output's type is not known -----------------------------
@pytest.mark.parametrize("to", [8, 16])  # string, bfloat16
def test_cast_to_a_type_torch_lacks_is_refused_from_the_attribute(to: int) -> None:
    layer = _layer("Cast", 1, {"to": to})
    assert "Cast to" in refusal(layer, [np.zeros(2, np.float32)])


def test_gelu_with_an_unknown_approximation_is_refused() -> None:
    layer = _layer("Gelu", 1, {"approximate": "sigmoid"})
    assert "approximate" in refusal(layer, [np.zeros(2, np.float32)])


# -- pools padded here (asymmetric, or over half the window) with ceil_mode ------------------------
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2], "strides": [2], "pads": [0, 1]},
    {"kernel_shape": [3], "strides": [3], "pads": [2, 2]},
    {"kernel_shape": [3], "strides": [2], "pads": [1, 2]}])
def test_ceil_mode_pool_padded_by_the_kernel_starts_no_window_in_the_end_padding(
        op: str, attrs: dict[str, Any]) -> None:
    """torch took the padding added before it for input, and let one more window start in it."""
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 4) - 1.5
    attrs = {**attrs, "ceil_mode": 1, **({"count_include_pad": 1} if op == "AveragePool" else {})}
    (y,) = assert_same(_layer(op, 1, attrs, opset=19), [x], rtol=1e-6)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_pads_as_wide_as_the_window_are_refused(op: str) -> None:
    """A window can lie in the padding alone: CpuRef gives it an output (-inf, or 0 / the count),
    torch's ceil_mode rule drops it; ONNX Runtime refuses such pads."""
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 4)
    layer = _layer(op, 1, {"kernel_shape": [2], "strides": [3], "pads": [2, 2], "ceil_mode": 1,
                           **({"count_include_pad": 1} if op == "AveragePool" else {})}, opset=19)
    want = reference(layer, [x])
    assert want[0].shape == (1, 1, 3)
    assert "as wide as the window" in refusal(layer, [x], _infos(want))


def test_max_pool_indices_with_padding_over_half_the_window_are_refused() -> None:
    """CpuAcc pads such an input itself, so torch's indices would count the padding."""
    x = np.arange(3, dtype=np.float32).reshape(1, 1, 3)
    layer = _layer("MaxPool", 1, {"kernel_shape": [3], "pads": [2, 2], "strides": [2]},
                   n_outputs=2)
    want = reference(layer, [x])
    np.testing.assert_array_equal(want[1], [[[0, 2, 2]]])
    assert "indices" in refusal(layer, [x], _infos(want))
    layer = _layer("MaxPool", 1, {"kernel_shape": [3], "pads": [1, 1], "strides": [2]},
                   n_outputs=2)
    assert_same(layer, [x])  # torch pads this one itself: claimed, and its indices are right


# -- MaxPool's indices of a window with several NaNs -----------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_max_pool_index_of_a_window_of_nans_is_the_first_nan(dtype: Any) -> None:
    x = np.array([np.nan, np.nan, 1.0, np.nan, 2.0, 2.0, -np.inf, -np.inf], dtype).reshape(1, 1, 8)
    layer = _layer("MaxPool", 1, {"kernel_shape": [2], "strides": [2]}, n_outputs=2)
    y, indices = assert_same(layer, [x])
    np.testing.assert_array_equal(indices, [[[0, 3, 4, 6]]])


# -- Pow of a 0-d base by an exponent of a narrower float type -------------------------------------
@pytest.mark.parametrize("base, exponent, want", [(4.0, 8.0, 65536.0), (3.0, 7.0, 2187.0),
                                                  (1.5, 30.0, 1.5**30)])
def test_pow_of_a_0d_float32_base_by_a_float16_exponent_is_float32(base: float, exponent: float,
                                                                   want: float) -> None:
    """torch computed it in float16 (a 0-d tensor does not widen the other's type): 4 ** 8 was inf."""
    x, y = np.array(base, np.float32), np.array([exponent], np.float16)
    (got,) = assert_same(_layer("Pow", 2), [x, y], rtol=1e-6)
    assert got.dtype == np.float32 and got[0] == np.float32(want)


# -- AveragePool over 3 axes of an input smaller than the window -----------------------------------
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [1, 1, 3], "auto_pad": "SAME_UPPER", "count_include_pad": 1},
    {"kernel_shape": [3, 1, 2], "pads": [1, 0, 1, 1, 0, 0], "count_include_pad": 1}])
@pytest.mark.parametrize("batch", [0, 2])
def test_average_pool_3d_of_an_input_smaller_than_the_window(attrs: dict[str, Any],
                                                             batch: int) -> None:
    """torch's avg_pool3d wants the unpadded input to cover the window ("input image smaller than
    kernel size"), where the padded one does: padded by the kernel instead."""
    x = np.random.default_rng(3).uniform(-2, 2, (batch, 2, 1, 1, 1)).astype(np.float32)
    assert_same(_layer("AveragePool", 1, attrs, opset=19), [x], rtol=1e-6)


def test_average_pool_3d_of_an_input_smaller_than_the_window_uncounted_padding() -> None:
    """Refused while torch's avg_pool3d was the only route; the explicit-padding sum takes it now."""
    x = np.ones((1, 1, 1, 1, 1), np.float32)
    layer = _layer("AveragePool", 1, {"kernel_shape": [1, 1, 3], "pads": [0, 0, 1, 0, 0, 1]})
    want = reference(layer, [x])
    np.testing.assert_array_equal(want[0], np.ones((1, 1, 1, 1, 1)))
    assert_same(layer, [x], rtol=1e-6)


# -- float64 activations through torch's float-precision shortcuts ------------------------------------
@pytest.mark.parametrize("op, attrs", [("HardSigmoid", {"alpha": float(np.float32(1 / 6))}),
                                       ("HardSigmoid", {"alpha": 1 / 6}), ("HardSwish", {})])
def test_float64_hard_activations_keep_float64_precision(op: str, attrs: dict[str, float]) -> None:
    """HardSigmoid with ONNX's float32 alpha of 1/6 went to torch's hardsigmoid (exactly 1/6), and
    torch's CUDA hardsigmoid / hardswish compute float64 in float: 3e-8 off at 1."""
    x = np.array([1.0, -1.0, 0.0, 2.5, -2.9, 7.0], np.float64)
    layer = _layer(op, 1, {**attrs, "beta": 0.5} if op == "HardSigmoid" else attrs)
    assert_same(layer, [x], rtol=1e-14, atol=1e-15)
