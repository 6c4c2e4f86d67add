"""The torch indexing and layout kernels (``kernels/indexing.py``) against CpuRef: hypothesis cases
in the style of ``test_differential.py`` (its harness, ``differential.py``: CpuAcc must match CpuRef wherever it claims a
case, and claim some), and the node suite's single-op cases of these ops on CpuAcc, CpuRef.

    python -m pytest tests/backends/torch/test_kernels_indexing.py -q -p no:cacheprovider
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.backends.torch.node_cases import case_names, check_case  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    BOOL,
    F32,
    I32,
    I64,
    LAYOUTS,
    SETTINGS,
    array,
    axis_of,
    differential,
    float32s,
    ints_input,
    place,
    run,
    schema_dtypes,
    shapes,
    tensor,
)

OPS = ("Pad", "CenterCropPad", "GatherElements", "GatherND", "Scatter", "ScatterElements",
       "ScatterND", "TensorScatter", "OneHot", "NonZero", "Compress", "TopK", "Unique",
       "ReverseSequence", "DepthToSpace", "SpaceToDepth", "Trilu", "EyeLike", "NonMaxSuppression",
       "Size", "ConstantOfShape", "Range", "Dropout")


def index_tensor(draw: Any, values: np.ndarray) -> Any:
    """Indices as int64 or int32, in a drawn layout."""
    dtype = draw(st.sampled_from([I64, I32]))
    return place(values.astype(dtype), draw(st.sampled_from(LAYOUTS)))


def indices_into(draw: Any, shape: tuple[int, ...], size: int) -> np.ndarray:
    """Indices of ``shape`` into an axis of ``size``, negative ones among them."""
    return np.array(draw(st.lists(st.integers(-size, size - 1), min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape))))).reshape(shape)


# -- Pad, CenterCropPad ----------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _pad(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([2, 11, 13, 18, 19, 21]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=4, max_side=4)))
    rank = x.ref.ndim
    modes = ["constant", "reflect", "edge"] + (["wrap"] if opset >= 19 else [])
    mode = draw(st.sampled_from(modes))
    axes = list(range(rank))
    if opset >= 18 and draw(st.booleans()):
        axes = draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank,
                             unique_by=lambda a: a % rank))
    pads = draw(st.lists(st.integers(-3, 5), min_size=2 * len(axes), max_size=2 * len(axes)))
    sizes = [x.ref.shape[a] + pads[i] + pads[i + len(axes)] for i, a in enumerate(axes)]
    assume(min(sizes) >= 0)  # a negative size is no output (CpuRef's slice would wrap around)
    if opset < 11:
        attrs = {"pads": pads, "mode": mode}
        if mode == "constant" and draw(st.booleans()):
            attrs["value"] = draw(float32s(-5, 5))
        differential(op, [x], attrs, opset=opset, exact=True)
        return
    args = [x, ints_input(draw, pads)]
    if mode == "constant" and draw(st.booleans()):
        args.append(tensor(draw, dtype, (), ("contiguous", "numpy")))
    if len(axes) < rank or (opset >= 18 and draw(st.booleans())):
        args += [None] * (3 - len(args)) + [ints_input(draw, axes)]
    differential(op, args, {"mode": mode}, opset=opset, exact=True)


@SETTINGS
@given(data=st.data())
def _center_crop_pad(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op, 18)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=4)))
    rank = x.ref.ndim
    axes = draw(st.none() | st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank,
                                     unique_by=lambda a: a % rank))
    count = rank if axes is None else len(axes)
    target = draw(st.lists(st.integers(0, 7), min_size=count, max_size=count))
    args = [x, ints_input(draw, target)] + ([] if axes is None else [ints_input(draw, axes)])
    differential(op, args, opset=18, exact=True)


# -- gathers ---------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _gather_elements(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=4, min_side=1)))
    axis = axis_of(draw, x.ref.ndim)
    size = x.ref.shape[axis]
    # the other axes: as long as the data's, or 1 (broadcast, NumPy's take_along_axis)
    shape = tuple(draw(st.integers(0, 4)) if a == axis % x.ref.ndim else
                  draw(st.sampled_from([n, 1])) for a, n in enumerate(x.ref.shape))
    differential(op, [x, index_tensor(draw, indices_into(draw, shape, size))], {"axis": axis},
                 exact=True)


@SETTINGS
@given(data=st.data())
def _gather_nd(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=4, min_side=1)))
    rank = x.ref.ndim
    batch_dims = draw(st.integers(0, rank - 1))
    depth = draw(st.integers(1, rank - batch_dims))
    middle = draw(shapes(min_dims=0, max_dims=2, max_side=3))
    shape = (*x.ref.shape[:batch_dims], *middle)
    coords = [indices_into(draw, shape, x.ref.shape[batch_dims + j]) for j in range(depth)]
    indices = np.stack(coords, axis=-1)
    differential(op, [x, index_tensor(draw, indices)], {"batch_dims": batch_dims}, exact=True)


# -- scatters --------------------------------------------------------------------------------------
def _unique_along(draw: Any, shape: tuple[int, ...], axis: int, size: int) -> np.ndarray:
    """Indices of ``shape`` along ``axis`` with no two equal in one line (a scatter without a
    reduction has no order among duplicates)."""
    keys = array(draw, F32, (*shape[:axis], size, *shape[axis + 1:]), special=False)
    order = np.argsort(keys, axis=axis, kind="stable")
    chosen = np.take(order, np.arange(shape[axis]), axis=axis)
    return np.where(draw(st.booleans()), chosen - size, chosen)


@SETTINGS
@given(data=st.data())
def _scatter_elements(op: str, data: Any) -> None:
    draw = data.draw
    opset = 9 if op == "Scatter" else draw(st.sampled_from([11, 16, 18]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=3, min_side=1)))
    axis = axis_of(draw, x.ref.ndim) % x.ref.ndim
    size = x.ref.shape[axis]
    reductions = ["none"] + (["add", "mul"] if opset >= 16 else []) + \
        (["max", "min"] if opset >= 18 else [])
    reduction = draw(st.sampled_from(reductions))
    shape = tuple(draw(st.integers(0, n)) for n in x.ref.shape)
    if reduction == "none":
        indices = _unique_along(draw, shape, axis, size)
    else:
        indices = indices_into(draw, shape, size)
    updates = tensor(draw, dtype, shape, integers=(-4, 4))
    attrs: dict[str, Any] = {"axis": axis - (x.ref.ndim if draw(st.booleans()) else 0)}
    if reduction != "none":
        attrs["reduction"] = reduction
    differential(op, [x, index_tensor(draw, indices), updates], attrs, opset=opset,
                 exact=reduction in ("none", "max", "min") or dtype.kind in "biu",
                 tol=8 if dtype.kind == "f" else 1)


@SETTINGS
@given(data=st.data())
def _scatter_nd(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, 16, 18]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=3, min_side=1)))
    depth = draw(st.integers(1, x.ref.ndim))
    reductions = ["none"] + (["add", "mul"] if opset >= 16 else []) + \
        (["max", "min"] if opset >= 18 else [])
    reduction = draw(st.sampled_from(reductions))
    every = np.stack(np.unravel_index(np.arange(int(np.prod(x.ref.shape[:depth]))),
                                      x.ref.shape[:depth]), axis=-1)
    count = draw(st.integers(0, min(len(every), 5)))
    if reduction == "none":
        rows = draw(st.permutations(range(len(every))))[:count]
    else:
        rows = draw(st.lists(st.integers(0, len(every) - 1), min_size=count, max_size=count))
    indices = every[list(rows)].reshape(count, depth)
    if draw(st.booleans()):  # the same rows counted from the end
        indices = indices - np.array(x.ref.shape[:depth])
    updates = tensor(draw, dtype, (count, *x.ref.shape[depth:]), integers=(-4, 4))
    attrs = {} if reduction == "none" else {"reduction": reduction}
    differential(op, [x, index_tensor(draw, indices.astype(np.int64)), updates], attrs,
                 opset=opset, exact=reduction in ("none", "max", "min") or dtype.kind in "biu",
                 tol=8 if dtype.kind == "f" else 1)


@SETTINGS
@given(data=st.data())
def _tensor_scatter(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op, 24)))
    batch, heads, size, width = (draw(st.integers(1, 3)) for _ in range(4))
    length = draw(st.integers(0, size))
    rank4 = draw(st.booleans())
    cache_shape = (batch, heads, size, width) if rank4 else (batch, size, width)
    update_shape = (batch, heads, length, width) if rank4 else (batch, length, width)
    mode = draw(st.sampled_from(["linear", "circular"]))
    high = size - 1 if mode == "circular" else size - length
    args = [tensor(draw, dtype, cache_shape), tensor(draw, dtype, update_shape)]
    if draw(st.booleans()):
        starts = np.array([draw(st.integers(0, max(high, 0))) for _ in range(batch)])
        args.append(place(starts.astype(np.int64)))
    differential(op, args, {"mode": mode, "axis": draw(st.sampled_from([-2, len(cache_shape) - 2]))},
                 opset=24, exact=True)


# -- selections ------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _one_hot(op: str, data: Any) -> None:
    draw = data.draw
    index_type = draw(st.sampled_from(schema_dtypes(op, index=0)))
    depth_type = draw(st.sampled_from(schema_dtypes(op, index=1)))
    value_type = draw(st.sampled_from(schema_dtypes(op, index=2)))
    depth = draw(st.integers(1, 5))
    indices = tensor(draw, index_type, draw(shapes(max_dims=3)), low=-depth - 1, high=depth,
                     special=False, integers=(-depth - 1, depth))
    rank = indices.ref.ndim
    depth_arg = place(np.array(depth, dtype=depth_type).reshape(draw(st.sampled_from([(), (1,)]))),
                      draw(st.sampled_from(["contiguous", "numpy"])))
    values = tensor(draw, value_type, (2,))
    differential(op, [indices, depth_arg, values], {"axis": axis_of(draw, rank + 1)}, exact=True)


@SETTINGS
@given(data=st.data())
def _non_zero(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    differential(op, [tensor(draw, dtype, draw(shapes()), integers=(-1, 1))], exact=True)


@SETTINGS
@given(data=st.data())
def _compress(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1)))
    axis = draw(st.none() | st.integers(-x.ref.ndim, x.ref.ndim - 1))
    size = x.ref.size if axis is None else x.ref.shape[axis]
    condition = tensor(draw, BOOL, (draw(st.integers(0, size)),))
    differential(op, [x, condition], {} if axis is None else {"axis": axis}, exact=True)


@SETTINGS
@given(data=st.data())
def _top_k(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([1, 10, 11]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1)), integers=(-3, 3))  # ties
    axis = axis_of(draw, x.ref.ndim)
    k = draw(st.integers(0, x.ref.shape[axis]))
    if opset == 1:
        differential(op, [x], {"k": k, "axis": axis}, opset=opset, n_outputs=2, exact=True)
        return
    attrs: dict[str, Any] = {"axis": axis}
    if opset >= 11:
        attrs.update(largest=draw(st.sampled_from([0, 1])), sorted=1)
    differential(op, [x, ints_input(draw, [k])], attrs, opset=opset, n_outputs=2, exact=True)


@SETTINGS
@given(data=st.data())
def _unique(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=1, max_dims=3)), integers=(-2, 2), low=-2,
               high=2)
    attrs: dict[str, Any] = {"sorted": draw(st.sampled_from([0, 1]))}
    if draw(st.booleans()):
        attrs["axis"] = axis_of(draw, x.ref.ndim)
    differential(op, [x], attrs, n_outputs=draw(st.integers(1, 4)), exact=True)


@SETTINGS
@given(data=st.data())
def _reverse_sequence(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=2, max_dims=4, min_side=1)))
    time_axis = draw(st.sampled_from([0, 1]))
    batch_axis = 1 - time_axis
    lengths = [draw(st.integers(1, x.ref.shape[time_axis])) for _ in range(x.ref.shape[batch_axis])]
    differential(op, [x, place(np.array(lengths, dtype=np.int64))],
                 {"time_axis": time_axis, "batch_axis": batch_axis}, exact=True)


# -- blocks and triangles --------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _blocks(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    b = draw(st.integers(1, 3))
    n, c, h, w = (draw(st.integers(0, 2)) for _ in range(4))
    shape = (n, c * b * b, h, w) if op == "DepthToSpace" else (n, c, h * b, w * b)
    attrs: dict[str, Any] = {"blocksize": b}
    if op == "DepthToSpace":
        attrs["mode"] = draw(st.sampled_from(["DCR", "CRD"]))
    differential(op, [tensor(draw, dtype, shape)], attrs, exact=True)


@SETTINGS
@given(data=st.data())
def _trilu(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=2, max_dims=4)))
    args = [x]
    if draw(st.booleans()):
        k = draw(st.integers(-6, 6) | st.sampled_from([2**63 - 1, -2**63]))
        args.append(place(np.array(k, dtype=np.int64), draw(st.sampled_from(["contiguous",
                                                                             "numpy"]))))
    differential(op, args, {"upper": draw(st.sampled_from([0, 1]))}, exact=True)


@SETTINGS
@given(data=st.data())
def _eye_like(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes(min_dims=2, max_dims=2)))
    attrs: dict[str, Any] = {"k": draw(st.integers(-5, 5))}
    if draw(st.booleans()):
        import onnx

        target = draw(st.sampled_from(schema_dtypes(op, index=0)))
        attrs["dtype"] = onnx.helper.np_dtype_to_tensor_dtype(target)
    differential(op, [x], attrs, exact=True)


@SETTINGS
@given(data=st.data())
def _non_max_suppression(op: str, data: Any) -> None:
    draw = data.draw
    batches, classes, count = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(0, 8))
    # corners on a coarse grid: boxes overlap, touch and coincide
    boxes = np.array(draw(st.lists(st.integers(0, 8), min_size=batches * count * 4,
                                   max_size=batches * count * 4)), dtype=np.float32) / 2
    scores = array(draw, F32, (batches, classes, count), low=0, high=1, special=False)
    scores = np.round(scores * 4) / 4  # ties
    args = [place(boxes.reshape(batches, count, 4)), place(scores)]
    limits = [np.array([draw(st.integers(0, 6))], dtype=np.int64),
              np.array([draw(st.sampled_from([0.0, 0.3, 0.5, 0.7]))], dtype=np.float32),
              np.array([draw(st.sampled_from([0.0, 0.25, 0.5]))], dtype=np.float32)]
    given_count = draw(st.integers(0, 3))
    args += [place(v, draw(st.sampled_from(["contiguous", "numpy"]))) for v in limits[:given_count]]
    differential(op, args, {"center_point_box": draw(st.sampled_from([0, 1]))}, exact=True)


# -- tensor makers and pass-through ----------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _size(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    differential(op, [tensor(draw, dtype, draw(shapes()))], exact=True)


@SETTINGS
@given(data=st.data())
def _constant_of_shape(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes(max_dims=3))
    attrs: dict[str, Any] = {}
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([F32, I32, I64, BOOL]))
        attrs["value"] = array(draw, dtype, (1,))
    differential(op, [place(np.array(shape, dtype=np.int64))], attrs, exact=True)


@SETTINGS
@given(data=st.data())
def _range(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    bounds = {"integers": (-20, 20), "low": -20, "high": 20, "special": False}
    start, limit = (tensor(draw, dtype, (), ("contiguous",), **bounds) for _ in range(2))
    delta = tensor(draw, dtype, (), ("contiguous",), **bounds)
    assume(delta.ref != 0 and abs((limit.ref - start.ref) / delta.ref) < 100)
    differential(op, [start, limit, delta], exact=dtype.kind in "iu", tol=4)


@SETTINGS
@given(data=st.data())
def _dropout(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([7, 10, 12, 13]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    args = [tensor(draw, dtype, draw(shapes()))]
    attrs: dict[str, Any] = {}
    if opset < 12:
        attrs["ratio"] = draw(st.sampled_from([0.0, 0.25, 0.5]))
    elif draw(st.booleans()):
        args.append(place(np.array(draw(st.sampled_from([0.0, 0.5])), dtype=F32)))
    differential(op, args, attrs, opset=opset, n_outputs=draw(st.integers(1, 2)), exact=True)


PROPERTIES = {
    "Size": _size, "ConstantOfShape": _constant_of_shape, "Range": _range, "Dropout": _dropout,
    "Pad": _pad, "CenterCropPad": _center_crop_pad, "GatherElements": _gather_elements,
    "GatherND": _gather_nd, "Scatter": _scatter_elements, "ScatterElements": _scatter_elements,
    "ScatterND": _scatter_nd, "TensorScatter": _tensor_scatter, "OneHot": _one_hot,
    "NonZero": _non_zero, "Compress": _compress, "TopK": _top_k, "Unique": _unique,
    "ReverseSequence": _reverse_sequence, "DepthToSpace": _blocks, "SpaceToDepth": _blocks,
    "Trilu": _trilu, "EyeLike": _eye_like, "NonMaxSuppression": _non_max_suppression,
}


@pytest.mark.parametrize("op", OPS)
def test_against_cpuref(op: str) -> None:
    run(PROPERTIES[op], op)


@pytest.mark.parametrize("name", case_names(OPS))
def test_node_case(name: str) -> None:
    check_case(name, refusals=("Dropout with a training_mode input",))


def test_every_op_has_node_cases() -> None:
    missing = [op for op in OPS if not case_names((op,))]
    assert not missing, f"no single-op node cases for {missing}"


def test_every_kernel_of_the_table_is_tested_here() -> None:
    from backplane.backends.torch.kernels import indexing

    assert sorted(indexing.KERNELS) == sorted(OPS) == sorted(PROPERTIES)
