"""Differential tests of the matrix products, convolutions, pools and normalizations
(test_differential.py says how they run and the rule for each case)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from tests.backends.torch.differential import (  # noqa: E402
    LAYOUTS,
    OPSET,
    SETTINGS,
    any_dtype,
    Arg,
    axis_of,
    differential,
    input_dtypes,
    run,
    shapes,
    spatial_sizes,
    tensor,
    tolerance_dtype,
    window_attrs,
)

pytestmark = pytest.mark.slow  # hypothesis, 40 examples a case: `python -m pytest -m slow`


# -- matrix products -------------------------------------------------------------------------------
def _float_tensor(draw: Any, dtype: np.dtype, shape: Sequence[int],
                  layouts: Sequence[str] = LAYOUTS) -> Arg:
    return tensor(draw, dtype, shape, layouts, low=-3, high=3, special=False)


def _product_slack(dtype: np.dtype, k: int) -> float:
    return 4 * max(k, 1) * 9 * tolerance_dtype(dtype)


@SETTINGS
@given(data=st.data())
def _matmul(op: str, data: Any) -> None:
    draw = data.draw
    dtype = any_dtype(draw, op)
    m, k, n = (draw(st.integers(0, 4)) for _ in range(3))
    batch_a, batch_b = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2,
                                                              max_side=3)).input_shapes
    a_shape = [k] if draw(st.integers(0, 3)) == 0 else [*batch_a, m, k]
    b_shape = [k] if draw(st.integers(0, 3)) == 0 else [*batch_b, k, n]
    a, b = _float_tensor(draw, dtype, a_shape), _float_tensor(draw, dtype, b_shape)
    differential(op, [a, b], atol=_product_slack(dtype, k))


def test_matmul() -> None:
    run(_matmul, "MatMul")


@SETTINGS
@given(data=st.data())
def _gemm(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([7, 9, 11, 13]))
    dtype = any_dtype(draw, op, opset)
    m, k, n = (draw(st.integers(0, 4)) for _ in range(3))
    attrs = draw(st.fixed_dictionaries({}, optional={
        "transA": st.sampled_from([0, 1]), "transB": st.sampled_from([0, 1]),
        "alpha": st.sampled_from([1.0, 0.0, 0.5, -2.0]),
        "beta": st.sampled_from([1.0, 0.0, 0.5, -2.0])}))
    a = _float_tensor(draw, dtype, [k, m] if attrs.get("transA") else [m, k])
    b = _float_tensor(draw, dtype, [n, k] if attrs.get("transB") else [k, n])
    args = [a, b]
    if opset < 11 or draw(st.booleans()):
        c_shape = draw(st.sampled_from([(), (1,), (n,), (1, n), (m, 1), (m, n), (1, 1)]))
        args.append(_float_tensor(draw, dtype, c_shape))
    differential(op, args, attrs, opset=opset, atol=3 * _product_slack(dtype, k))


def test_gemm() -> None:
    run(_gemm, "Gemm")


# -- convolution and pools -------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def _conv(op: str, data: Any) -> None:
    draw = data.draw
    dtype = any_dtype(draw, op)
    rank = draw(st.sampled_from([1, 2, 2, 3]))
    kernel, attrs = window_attrs(draw, rank)
    group = draw(st.integers(1, 3))
    c_in, c_out = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    if group > 1:
        attrs["group"] = group
    if draw(st.booleans()):
        attrs["kernel_shape"] = kernel
    spatial = spatial_sizes(draw, kernel, attrs)
    x = _float_tensor(draw, dtype, [draw(st.sampled_from([1, 1, 2, 0])), c_in, *spatial])
    w = _float_tensor(draw, dtype, [c_out, c_in // group, *kernel])
    args = [x, w]
    if draw(st.booleans()):
        args.append(_float_tensor(draw, dtype, [c_out]))
    differential(op, args, attrs, atol=_product_slack(dtype, math.prod(kernel) * c_in // group))


def test_conv() -> None:
    run(_conv, "Conv")


@SETTINGS
@given(data=st.data())
def _pool(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([8, 10, 11, 12, 19, OPSET]))
    dtype = any_dtype(draw, op, opset)
    rank = draw(st.sampled_from([1, 2, 2, 3]))
    kernel, attrs = window_attrs(draw, rank, dilations=opset >= (10 if op == "MaxPool" else 19))
    attrs["kernel_shape"] = kernel
    if opset >= 10 and draw(st.booleans()):
        attrs["ceil_mode"] = draw(st.sampled_from([0, 1]))
    if op == "AveragePool" and draw(st.booleans()):
        attrs["count_include_pad"] = draw(st.sampled_from([0, 1]))
    n_outputs = 1
    if op == "MaxPool":
        if draw(st.integers(0, 4)) == 0:
            attrs["storage_order"] = draw(st.sampled_from([0, 1]))
        n_outputs = draw(st.sampled_from([1, 2]))
    spatial = spatial_sizes(draw, kernel, attrs)
    batch = draw(st.sampled_from([1, 1, 2, 0]))
    x = tensor(draw, dtype, [batch, draw(st.integers(1, 3)), *spatial],
               low=-5, high=5, special=dtype.kind == "f" and op == "MaxPool")
    differential(op, [x], attrs, opset=opset, n_outputs=n_outputs, exact=op == "MaxPool",
                 tol=4)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool(op: str) -> None:
    run(_pool, op)


@SETTINGS
@given(data=st.data())
def _global_pool(op: str, data: Any) -> None:
    draw = data.draw
    dtype = any_dtype(draw, op)
    rank = draw(st.integers(1, 3))
    shape = [draw(st.sampled_from([1, 1, 2, 0])), draw(st.integers(0, 3)),
             *(draw(st.integers(1, 4)) for _ in range(rank))]
    x = tensor(draw, dtype, shape, low=-5, high=5, special=op == "GlobalMaxPool")
    differential(op, [x], exact=op == "GlobalMaxPool", atol=4 * math.prod(shape[2:]) * 5
                 * tolerance_dtype(dtype))


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool(op: str) -> None:
    run(_global_pool, op)


# -- normalizations --------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _batch_norm(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([9, 14, 15, OPSET]))
    dtype, params, _, stats, _ = input_dtypes(draw, op, opset)
    channels = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([1, 1, 2, 0]))
    shape = [batch, channels, *draw(shapes(max_dims=2, min_side=1, max_side=3))]
    attrs = draw(st.fixed_dictionaries({}, optional={"epsilon": st.sampled_from([1e-5, 1e-3, 0.5])}))
    args = [_float_tensor(draw, dtype, shape), _float_tensor(draw, params, [channels]),
            _float_tensor(draw, params, [channels]), _float_tensor(draw, stats, [channels]),
            tensor(draw, stats, [channels], low=0.1, high=4, special=False)]
    narrowest = min((dtype, params, stats), key=lambda d: d.itemsize)
    differential(op, args, attrs, opset=opset, tol=4, precision=narrowest)


def test_batch_normalization() -> None:
    run(_batch_norm, "BatchNormalization")


@SETTINGS
@given(data=st.data())
def _layer_norm(op: str, data: Any) -> None:
    draw = data.draw
    dtype = any_dtype(draw, op)
    shape = draw(shapes(min_dims=1, min_side=1, max_side=4))
    rank = len(shape)
    axis = axis_of(draw, rank)
    normalized = list(shape[axis % rank:])
    scale_shape = normalized[draw(st.integers(0, len(normalized) - 1)):]
    scale_shape = [d if draw(st.booleans()) else 1 for d in scale_shape]
    attrs: dict[str, Any] = {"axis": axis} if axis != -1 or draw(st.booleans()) else {}
    if draw(st.booleans()):
        attrs["epsilon"] = draw(st.sampled_from([1e-5, 1e-2, 0.5]))
    args = [_float_tensor(draw, dtype, shape), _float_tensor(draw, dtype, scale_shape)]
    if draw(st.booleans()):
        args.append(_float_tensor(draw, dtype, scale_shape))
    n_outputs = draw(st.integers(1, 3))
    # (x - mean) * inv_std: the mean's rounding error (a few ulps of x) times inv_std, which is up
    # to 1 / sqrt(epsilon) where x hardly varies (316 for 1e-5), times the scale
    x = args[0].ref.astype(np.float64)
    groups = x.reshape(*x.shape[:axis % rank], -1)
    inv_std = 1 / math.sqrt(float(groups.var(axis=-1).min()) + attrs.get("epsilon", 1e-5))
    scale = max(float(np.abs(args[1].ref.astype(np.float64)).max()), 1.0)
    slack = 8 * tolerance_dtype(dtype) * float(np.abs(x).max()) * inv_std * scale
    differential(op, args, attrs, n_outputs=n_outputs, tol=8, atol=slack)


def test_layer_normalization() -> None:
    run(_layer_norm, "LayerNormalization")
