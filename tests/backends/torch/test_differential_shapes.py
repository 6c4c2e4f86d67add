"""Differential tests of the shape ops (test_differential.py says how they run and the rule
for each case)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from tests.backends.torch.differential import (  # noqa: E402
    I32,
    I64,
    OPSET,
    SETTINGS,
    any_dtype,
    array,
    axis_of,
    differential,
    ints_input,
    place,
    run,
    shapes,
    tensor,
)

pytestmark = pytest.mark.slow  # hypothesis, 40 examples a case: `python -m pytest -m slow`


# -- shape ops -------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _reshape(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes())
    opset = draw(st.sampled_from([13, 14, OPSET]))
    x = tensor(draw, any_dtype(draw, op, opset), shape)
    # the target: runs of the input's sizes merged, 1s inserted, the runs shuffled
    cuts = sorted(draw(st.sets(st.integers(1, max(len(shape) - 1, 1)), max_size=3)))
    runs = [shape[a:b] for a, b in zip([0, *cuts], [*cuts, len(shape)]) if shape[a:b]]
    target = [math.prod(r) for r in runs]
    target = draw(st.permutations(target)) if len(target) > 1 else target
    target = list(target)
    for _ in range(draw(st.integers(0, 2))):
        target.insert(draw(st.integers(0, len(target))), 1)
    attrs: dict[str, Any] = {}
    allowzero = opset >= 14 and draw(st.booleans())
    if allowzero:
        attrs["allowzero"] = 1
    if target and draw(st.booleans()) and math.prod(target) > 0:
        target[draw(st.integers(0, len(target) - 1))] = -1
    if not allowzero:  # 0 copies the input's size at that position
        for i, d in enumerate(target):
            if i < len(shape) and d == shape[i] and draw(st.booleans()):
                target[i] = 0
    differential(op, [x, ints_input(draw, target)], attrs, opset=opset, exact=True)


def test_reshape() -> None:
    run(_reshape, "Reshape")


@SETTINGS
@given(data=st.data())
def _flatten(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes())
    attrs = {}
    if draw(st.booleans()):
        attrs["axis"] = axis_of(draw, len(shape), extra=1)
    x = tensor(draw, any_dtype(draw, op), shape)
    differential(op, [x], attrs, exact=True)


def test_flatten() -> None:
    run(_flatten, "Flatten")


@SETTINGS
@given(data=st.data())
def _transpose(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes(max_dims=5, max_side=3))
    attrs = {}
    if draw(st.booleans()):
        attrs["perm"] = list(draw(st.permutations(range(len(shape)))))
    differential(op, [tensor(draw, any_dtype(draw, op), shape)], attrs, exact=True)


def test_transpose() -> None:
    run(_transpose, "Transpose")


@SETTINGS
@given(data=st.data())
def _squeeze(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, 13, OPSET]))
    shape = draw(shapes(max_side=2))
    ones = [i for i, d in enumerate(shape) if d == 1]
    x = tensor(draw, any_dtype(draw, op, opset), shape)
    if draw(st.booleans()) or not ones:
        axes = None
    else:
        axes = [a - len(shape) if draw(st.booleans()) else a
                for a in draw(st.lists(st.sampled_from(ones), min_size=1, unique=True))]
    if opset < 13:
        differential(op, [x], {} if axes is None else {"axes": axes}, opset=opset, exact=True)
    else:
        differential(op, [x] + ([] if axes is None else [ints_input(draw, axes)]), opset=opset,
                     exact=True)


def test_squeeze() -> None:
    run(_squeeze, "Squeeze")


@SETTINGS
@given(data=st.data())
def _unsqueeze(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, 13, OPSET]))
    shape = draw(shapes(max_dims=3, max_side=3))
    count = draw(st.integers(1, 3))
    rank = len(shape) + count
    chosen = draw(st.lists(st.integers(0, rank - 1), min_size=count, max_size=count, unique=True))
    axes = [a - rank if draw(st.booleans()) else a for a in chosen]
    x = tensor(draw, any_dtype(draw, op, opset), shape)
    if opset < 13:
        differential(op, [x], {"axes": axes}, opset=opset, exact=True)
    else:
        differential(op, [x, ints_input(draw, axes)], opset=opset, exact=True)


def test_unsqueeze() -> None:
    run(_unsqueeze, "Unsqueeze")


@SETTINGS
@given(data=st.data())
def _concat(op: str, data: Any) -> None:
    draw = data.draw
    shape = list(draw(shapes(min_dims=1)))
    axis = axis_of(draw, len(shape))
    dtype = any_dtype(draw, op)
    args = []
    for _ in range(draw(st.integers(1, 3))):
        part = list(shape)
        part[axis] = draw(st.integers(0, 3))
        args.append(tensor(draw, dtype, part))
    differential(op, args, {"axis": axis}, exact=True)


def test_concat() -> None:
    run(_concat, "Concat")


@SETTINGS
@given(data=st.data())
def _split(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([13, 18, OPSET]))
    shape = list(draw(shapes(min_dims=1, max_side=6)))
    axis = axis_of(draw, len(shape))
    size = shape[axis]
    x = tensor(draw, any_dtype(draw, op, opset), shape)
    attrs: dict[str, Any] = {}
    if draw(st.booleans()):
        attrs["axis"] = axis
    else:
        axis = 0
        size = shape[0]
    how = draw(st.sampled_from(["sizes", "even", "num_outputs"] if opset >= 18 else
                               ["sizes", "even"]))
    if how == "sizes":  # explicit sizes that add up, zeros allowed
        cuts = sorted(draw(st.lists(st.integers(0, size), max_size=3)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, size])]
        differential(op, [x, ints_input(draw, sizes)], attrs, opset=opset,
                     n_outputs=len(sizes), exact=True)
        return
    count = draw(st.integers(1, 4))
    if how == "even":  # no sizes: equal parts (before 18 they must divide; at 18 num_outputs)
        assume(size % count == 0)
        if opset >= 18:
            attrs["num_outputs"] = count
        differential(op, [x], attrs, opset=opset, n_outputs=count, exact=True)
        return
    chunk = -(-size // count)  # num_outputs: ceil-sized parts, the last smaller, never negative
    assume(size - chunk * (count - 1) >= 0)
    attrs["num_outputs"] = count
    differential(op, [x], attrs, opset=opset, n_outputs=count, exact=True)


def test_split() -> None:
    run(_split, "Split")


BIG = 2**63 - 1


@SETTINGS
@given(data=st.data())
def _slice(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([10, 11, 13, OPSET]))
    shape = draw(shapes(min_dims=1, max_side=5))
    rank = len(shape)
    x = tensor(draw, any_dtype(draw, op, opset), shape)
    chosen = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    bound = st.one_of(st.integers(-7, 7), st.sampled_from([BIG, -BIG - 1, 2**31 - 1, -2**31]))
    starts = [draw(bound) for _ in chosen]
    ends = [draw(bound) for _ in chosen]
    steps = [draw(st.sampled_from([1, 1, 2, 3, -1, -2, -3, BIG, -BIG - 1])) for _ in chosen]
    axes = [a - rank if draw(st.booleans()) else a for a in chosen]
    index_dtype = draw(st.sampled_from([I32, I64]))
    if index_dtype == I32:
        clip = lambda v: int(np.clip(v, -2**31, 2**31 - 1))  # noqa: E731
        starts, ends, steps = ([clip(v) for v in vs] for vs in (starts, ends, steps))
    args = [x, ints_input(draw, starts, index_dtype), ints_input(draw, ends, index_dtype)]
    form = draw(st.sampled_from(["starts_ends", "axes", "steps"]))
    if form == "starts_ends" and axes != list(range(len(axes))):
        form = "axes"
    if form == "axes" and any(s != 1 for s in steps):
        form = "steps"
    if form in ("axes", "steps"):
        args.append(ints_input(draw, axes, index_dtype))
    if form == "steps":
        args.append(ints_input(draw, steps, index_dtype))
    differential(op, args, opset=opset, exact=True)


def test_slice() -> None:
    run(_slice, "Slice")


@SETTINGS
@given(data=st.data())
def _gather(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes(min_dims=1))
    rank = len(shape)
    attrs = {}
    axis = 0
    if draw(st.booleans()):
        axis = attrs["axis"] = axis_of(draw, rank)
    size = shape[axis]
    index_shape = draw(shapes(max_dims=3, max_side=3))
    if size == 0:
        index_shape = (*index_shape[:-1], 0) if index_shape else (0,)
    index_dtype = draw(st.sampled_from([I32, I64]))
    indices = array(draw, index_dtype, index_shape, integers=(-size, max(size - 1, -size)))
    layouts = ("contiguous", "permuted", "strided", "broadcast")
    opset = draw(st.sampled_from([11, 13, OPSET]))
    args = [tensor(draw, any_dtype(draw, op, opset), shape),
            place(indices, draw(st.sampled_from(layouts)))]
    differential(op, args, attrs, opset=opset, exact=True)


def test_gather() -> None:
    run(_gather, "Gather")


@SETTINGS
@given(data=st.data())
def _expand(op: str, data: Any) -> None:
    draw = data.draw
    a, b = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=3)).input_shapes
    x = tensor(draw, any_dtype(draw, op), a)
    differential(op, [x, ints_input(draw, b)], exact=True)


def test_expand() -> None:
    run(_expand, "Expand")


@SETTINGS
@given(data=st.data())
def _tile(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes(max_side=3))
    repeats = draw(st.lists(st.integers(0, 3), min_size=len(shape), max_size=len(shape)))
    x = tensor(draw, any_dtype(draw, op), shape)
    differential(op, [x, ints_input(draw, repeats)], exact=True)


def test_tile() -> None:
    run(_tile, "Tile")


@SETTINGS
@given(data=st.data())
def _shape(op: str, data: Any) -> None:
    draw = data.draw
    shape = draw(shapes(max_dims=5))
    opset = draw(st.sampled_from([13, 15, OPSET]))
    attrs = draw(st.fixed_dictionaries({}, optional={"start": st.integers(-7, 7),
                                                     "end": st.integers(-7, 7)}))
    if opset < 15:
        attrs = {}
    differential(op, [tensor(draw, any_dtype(draw, op, opset), shape)], attrs, opset=opset,
                 exact=True)


def test_shape() -> None:
    run(_shape, "Shape")
