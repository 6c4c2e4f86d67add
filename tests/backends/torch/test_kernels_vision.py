"""Differential tests of the vision torch kernels (``kernels/vision.py``: Resize, Upsample, RoiAlign,
DeformConv) and of what issue 17's last stretch added elsewhere (AveragePool with dilations or
uncounted padding, MaxPool on 8-bit integers, Pow on integers, ReduceMax / ReduceMin on bool),
against CpuRef, over cases that hypothesis generates, in the harness of ``differential.py``;
then the node suite's single-op cases of each op through CpuAcc, CpuRef.

Integer results (Resize of integers rounds and saturates, pools and reductions select) must equal
CpuRef exactly; float ones within a tolerance of their type.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backplane.backends.torch.kernels import vision  # noqa: E402
from tests.backends.torch.node_cases import case_names, check_case  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    BOOL,
    F16,
    F32,
    F64,
    I8,
    OPSET,
    SETTINGS,
    U8,
    Arg,
    spatial_sizes,
    window_attrs,
    array,
    differential,
    ints_input,
    place,
    run,
    schema_dtypes,
    shapes,
    tensor,
)


def _floats_input(draw: Any, values: list[float]) -> Arg:
    """A host-read float input (scales, roi): a torch tensor or a host NumPy array."""
    return place(np.array(values, dtype=np.float32),
                 draw(st.sampled_from(("contiguous", "numpy"))))


# -- Resize, Upsample ------------------------------------------------------------------------------
MODES = ("nearest", "linear", "cubic")
TRANSFORMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
              "asymmetric", "tf_crop_and_resize")
NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _resize_attrs(draw: Any, opset: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {"mode": draw(st.sampled_from(MODES))}
    if opset < 11:
        return attrs
    attrs["coordinate_transformation_mode"] = draw(st.sampled_from(
        TRANSFORMS if opset >= 18 else TRANSFORMS[:1] + TRANSFORMS[2:]))
    attrs["nearest_mode"] = draw(st.sampled_from(NEAREST))
    attrs["cubic_coeff_a"] = draw(st.sampled_from([-0.75, -0.5, -0.6]))
    attrs["exclude_outside"] = draw(st.sampled_from([0, 1]))
    if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
        attrs["extrapolation_value"] = draw(st.sampled_from([0.0, -1.5, 10.0]))
    if opset >= 18:
        attrs["antialias"] = draw(st.sampled_from([0, 1]))
    return attrs


@SETTINGS
@given(data=st.data())
def _resize(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([10, 11, 13, 18, 19]))
    dtype = draw(st.sampled_from([F16, F32, F64, I8, U8]))
    shape = list(draw(shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)))
    attrs = _resize_attrs(draw, opset)
    axes = list(range(len(shape)))
    if opset >= 18 and draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
        attrs["axes"] = [a - len(shape) if draw(st.booleans()) else a for a in axes]
    x = tensor(draw, dtype, shape, low=-20, high=20, special=False)
    factors = [draw(st.sampled_from([0.5, 0.6, 1.0, 1.5, 2.0, 3.0, 0.34])) for _ in axes]
    if opset == 10:
        differential("Resize", [x, _floats_input(draw, factors)], attrs, opset=10,
                     exact=dtype.kind in "iu", tol=4)
        return
    roi = None
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        starts = [draw(st.sampled_from([0.0, 0.2, -0.1])) for _ in axes]
        ends = [draw(st.sampled_from([1.0, 0.8, 1.2])) for _ in axes]
        roi = _floats_input(draw, starts + ends)
    if draw(st.booleans()):
        args = [x, roi, _floats_input(draw, factors)]
    else:
        sizes = [draw(st.integers(1, 6)) for _ in axes]
        if opset >= 18 and draw(st.booleans()):
            attrs["keep_aspect_ratio_policy"] = draw(st.sampled_from(
                ["stretch", "not_larger", "not_smaller"]))
        args = [x, roi, None, ints_input(draw, sizes)]
    differential("Resize", args, attrs, opset=opset, exact=dtype.kind in "iu", tol=4)


def test_resize() -> None:
    run(_resize, "Resize")


@SETTINGS
@given(data=st.data())
def _upsample(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([7, 9]))
    dtype = draw(st.sampled_from([F16, F32, I8, U8]))
    shape = list(draw(shapes(min_dims=2, max_dims=4, min_side=1, max_side=3)))
    factors = [1.0, 1.0, *(draw(st.sampled_from([1.0, 2.0, 3.0, 1.5])) for _ in shape[2:])]
    mode = draw(st.sampled_from(["nearest", "linear"]))
    x = tensor(draw, dtype, shape, low=-20, high=20, special=False)
    if opset == 7:
        differential(op, [x], {"mode": mode, "scales": factors}, opset=7,
                     exact=dtype.kind in "iu", tol=4)
    else:
        differential(op, [x, _floats_input(draw, factors)], {"mode": mode}, opset=9,
                     exact=dtype.kind in "iu", tol=4)


def test_upsample() -> None:
    run(_upsample, "Upsample")


# -- RoiAlign, DeformConv --------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _roi_align(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([10, 16]))
    dtype = draw(st.sampled_from([F32, F64]))
    n, c, h, w = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 6)), \
        draw(st.integers(1, 6))
    x = tensor(draw, dtype, [n, c, h, w], low=-5, high=5, special=False)
    r = draw(st.integers(0, 3))
    corners = array(draw, dtype, [r, 4], low=-1, high=7, special=False)
    rois = np.concatenate([np.minimum(corners[:, :2], corners[:, 2:]),
                           np.maximum(corners[:, :2], corners[:, 2:])], axis=1)
    batches = np.array([draw(st.integers(0, n - 1)) for _ in range(r)], np.int64)
    attrs: dict[str, Any] = {"output_height": draw(st.integers(1, 3)),
                             "output_width": draw(st.integers(1, 3)),
                             "sampling_ratio": draw(st.integers(0, 2)),
                             "spatial_scale": draw(st.sampled_from([1.0, 0.5, 2.0])),
                             "mode": draw(st.sampled_from(["avg", "max"]))}
    if opset >= 16:
        attrs["coordinate_transformation_mode"] = draw(st.sampled_from(
            ["half_pixel", "output_half_pixel"]))
    differential(op, [x, place(rois), place(batches)], attrs, opset=opset, tol=8)


def test_roi_align() -> None:
    run(_roi_align, "RoiAlign")


@SETTINGS
@given(data=st.data())
def _deform_conv(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F64]))
    rank = draw(st.sampled_from([1, 2, 2]))
    group, offset_group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    channels = group * offset_group * draw(st.integers(1, 2))
    c_out = group * draw(st.integers(1, 2))
    kernel, attrs = window_attrs(draw, rank, max_kernel=2)
    attrs.pop("auto_pad", None)
    spatial = spatial_sizes(draw, kernel, attrs)
    dilations = attrs.get("dilations", [1] * rank)
    strides = attrs.get("strides", [1] * rank)
    pads = attrs.get("pads", [0] * 2 * rank)
    out = [(n + pads[i] + pads[i + rank] - (k - 1) * d - 1) // s + 1
           for i, (n, k, d, s) in enumerate(zip(spatial, kernel, dilations, strides))]
    if min(out) < 1:
        return
    attrs.update(group=group, offset_group=offset_group)
    if draw(st.booleans()):
        attrs["kernel_shape"] = kernel
    batch = draw(st.integers(1, 2))
    taps = int(np.prod(kernel))
    args = [tensor(draw, dtype, [batch, channels, *spatial], low=-3, high=3, special=False),
            tensor(draw, dtype, [c_out, channels // group, *kernel], low=-3, high=3,
                   special=False),
            tensor(draw, dtype, [batch, offset_group * taps * rank, *out], low=-2, high=2,
                   special=False)]
    extras = draw(st.integers(0, 2))
    if extras >= 1:
        args.append(tensor(draw, dtype, [c_out], low=-3, high=3, special=False))
    if extras == 2:
        args.append(tensor(draw, dtype, [batch, offset_group * taps, *out], low=0, high=1,
                           special=False))
    differential(op, args, attrs, opset=19, tol=4 * taps * channels)


def test_deform_conv() -> None:
    run(_deform_conv, "DeformConv")


# -- pools, Pow and reductions (nn.py, elementwise.py, shape.py) -----------------------------------
@SETTINGS
@given(data=st.data())
def _pool(op: str, data: Any) -> None:
    draw = data.draw
    opset = 19 if op == "AveragePool" else draw(st.sampled_from([12, OPSET]))
    dtype = draw(st.sampled_from([F32, F64] if op == "AveragePool" else [I8, U8, F32]))
    rank = draw(st.sampled_from([1, 2, 3]))
    kernel, attrs = window_attrs(draw, rank)
    attrs["kernel_shape"] = kernel
    attrs["ceil_mode"] = draw(st.sampled_from([0, 1]))
    n_outputs = 1
    if op == "AveragePool":
        attrs["count_include_pad"] = draw(st.sampled_from([0, 1]))
    else:
        attrs["storage_order"] = draw(st.sampled_from([0, 1]))
        n_outputs = draw(st.sampled_from([1, 2]))
    spatial = spatial_sizes(draw, kernel, attrs)
    x = tensor(draw, dtype, [draw(st.integers(1, 2)), draw(st.integers(1, 2)), *spatial],
               low=-5, high=5, special=False)
    differential(op, [x], attrs, opset=opset, n_outputs=n_outputs, exact=op == "MaxPool", tol=4)


@pytest.mark.parametrize("op", ["AveragePool", "MaxPool"])
def test_pool(op: str) -> None:
    run(_pool, op)


@SETTINGS
@given(data=st.data())
def _integer_pow(op: str, data: Any) -> None:
    draw = data.draw
    base = draw(st.sampled_from([t for t in schema_dtypes(op, 15) if t.kind in "iu"]))
    exponent = draw(st.sampled_from(schema_dtypes(op, 15, index=1)))
    x = tensor(draw, base, draw(shapes(max_side=3)), integers=(-6, 6), low=-6, high=6,
               special=False)
    y = tensor(draw, exponent, draw(shapes(max_dims=2, max_side=3)), integers=(0, 5), low=-2,
               high=4, special=False)
    differential(op, [x, y], opset=15, exact=True)


def test_integer_pow() -> None:
    run(_integer_pow, "Pow")


@SETTINGS
@given(data=st.data())
def _bool_extremum(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([BOOL, BOOL, F32, I8]))
    shape = list(draw(shapes(min_dims=1, max_side=3)))
    x = tensor(draw, dtype, shape)
    args = [x]
    attrs = {"keepdims": draw(st.sampled_from([0, 1]))}
    if draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(-len(shape), len(shape) - 1), max_size=2)))
        if len({a % len(shape) for a in axes}) == len(axes):
            args.append(ints_input(draw, axes))
    differential(op, args, attrs, opset=20, exact=True)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_bool_and_empty_extremum(op: str) -> None:
    run(_bool_extremum, op)


# -- the node suite ----------------------------------------------------------------------------------
OPS = ("Resize", "Upsample", "RoiAlign", "DeformConv", "AveragePool", "MaxPool", "Pow", "ReduceMax",
       "ReduceMin")


@pytest.mark.parametrize("name", case_names(OPS))
def test_node_case(name: str) -> None:
    check_case(name)


def test_every_op_has_node_cases() -> None:
    missing = [op for op in OPS if not case_names((op,))]
    assert missing == []


def test_every_vision_kernel_is_covered() -> None:
    covered = {"Resize", "Upsample", "RoiAlign", "DeformConv"}
    assert sorted(set(vision.KERNELS) - covered) == []


def test_resize_refusal_names_the_choices() -> None:
    from backplane.backends.torch.backend import CpuAcc
    from backplane.ir.graph import UNKNOWN, Layer, TensorInfo

    layer = Layer("r", "Resize", ["x", "", "s"], ["y"], {"mode": "area"}, "", 19)
    support = CpuAcc().is_layer_supported(layer, [TensorInfo((1, 1, 2, 2), F32), UNKNOWN,
                                                  TensorInfo((4,), F32)], [UNKNOWN])
    assert not support.ok and "mode='area'" in support.reason and "cubic" in support.reason

