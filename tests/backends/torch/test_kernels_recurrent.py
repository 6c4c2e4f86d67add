"""The torch network kernels of ``kernels/recurrent.py`` (RNN / GRU / LSTM, ConvTranspose, Col2Im,
the normalizations, LRN, LpPool, GlobalLpPool, MaxUnpool) against CpuRef: hypothesis cases in the
style of ``test_differential.py`` (its harness, ``differential.py``), and the node suite's single-op cases of these ops on
CpuAcc, CpuRef.

    python -m pytest tests/backends/torch/test_kernels_recurrent.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.backends.torch.node_cases import case_names, check_case  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    F16,
    SETTINGS,
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

OPS = ("RNN", "GRU", "LSTM", "ConvTranspose", "Col2Im", "InstanceNormalization",
       "GroupNormalization", "RMSNormalization", "LRN", "LpNormalization",
       "MeanVarianceNormalization", "LpPool", "GlobalLpPool", "MaxUnpool", "GridSample",
       "AffineGrid")

SMALL = {"low": -2, "high": 2, "special": False}
"""Values for long chains of arithmetic (recurrences, sums of products): finite and moderate, so
that a tolerance means something."""


def floats(draw: Any, op: str, opset: int = 21) -> np.dtype:
    return draw(st.sampled_from(schema_dtypes(op, opset)))


# -- RNN, GRU, LSTM --------------------------------------------------------------------------------
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


@SETTINGS
@given(data=st.data())
def _recurrent(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op, 14)
    seq, batch, width, hidden = (draw(st.integers(1, 3)) for _ in range(4))
    direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
    dirs = 2 if direction == "bidirectional" else 1
    layout = draw(st.sampled_from([0, 1]))
    gates = GATES[op] * hidden
    x_shape = (batch, seq, width) if layout else (seq, batch, width)
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    args: list[Any] = [tensor(draw, dtype, x_shape, **SMALL),
                       tensor(draw, dtype, (dirs, gates, width), **SMALL),
                       tensor(draw, dtype, (dirs, gates, hidden), **SMALL)]
    optional = [tensor(draw, dtype, (dirs, 2 * gates), **SMALL),
                place(np.array([draw(st.integers(1, seq)) for _ in range(batch)], np.int32)),
                tensor(draw, dtype, state, **SMALL)]
    if op == "LSTM":
        optional += [tensor(draw, dtype, state, **SMALL),
                     tensor(draw, dtype, (dirs, 3 * hidden), **SMALL)]
    for value in optional:
        args.append(value if draw(st.booleans()) else None)
    while args[-1] is None:
        args.pop()
    attrs: dict[str, Any] = {"direction": direction, "hidden_size": hidden, "layout": layout}
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(["Sigmoid", "Tanh", "Relu", "Softsign", "Softplus"]),
                              min_size=len(DEFAULTS[op]) * dirs, max_size=len(DEFAULTS[op]) * dirs))
        attrs["activations"] = names
    if draw(st.booleans()):
        attrs["clip"] = draw(float32s(0.5, 3))
    if op == "GRU":
        attrs["linear_before_reset"] = draw(st.sampled_from([0, 1]))
    if op == "LSTM":
        attrs["input_forget"] = draw(st.sampled_from([0, 1]))
    n_outputs = draw(st.integers(1, 3 if op == "LSTM" else 2))
    differential(op, args, attrs, opset=14, n_outputs=n_outputs, tol=4 * (width + hidden) * seq,
                 atol=0.05 if dtype == F16 else 0.0)


# -- ConvTranspose, Col2Im -------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _conv_transpose(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op)
    rank = draw(st.integers(1, 3))
    group = draw(st.integers(1, 2))
    c, m = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    spatial = [draw(st.integers(1, 4)) for _ in range(rank)]
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    attrs: dict[str, Any] = {"strides": strides, "group": group}
    if draw(st.booleans()):
        attrs["dilations"] = [draw(st.integers(1, 2)) for _ in range(rank)]
    choice = draw(st.sampled_from(["pads", "auto_pad", "output_shape", "none"]))
    if choice == "pads":
        attrs["pads"] = [draw(st.integers(0, 2)) for _ in range(2 * rank)]
    elif choice == "auto_pad":
        attrs["auto_pad"] = draw(st.sampled_from(["SAME_UPPER", "SAME_LOWER", "VALID"]))
    elif choice == "output_shape":
        attrs["output_shape"] = [draw(st.integers(1, 9)) for _ in range(rank)]
    if draw(st.booleans()):
        attrs["output_padding"] = [draw(st.integers(0, s - 1)) for s in strides]
    if choice == "pads":  # pads past the result leave no output (CpuRef's crop would wrap)
        extra = attrs.get("output_padding", [0] * rank)
        dilations = attrs.get("dilations", [1] * rank)
        assume(all((i - 1) * s + (k - 1) * d + 1 + e - attrs["pads"][a] - attrs["pads"][a + rank] >= 0
                   for a, (i, s, k, d, e) in enumerate(zip(spatial, strides, kernel, dilations,
                                                            extra))))
    x = tensor(draw, dtype, (draw(st.integers(1, 2)), c, *spatial), **SMALL)
    w = tensor(draw, dtype, (c, m // group, *kernel), **SMALL)
    args = [x, w] + ([tensor(draw, dtype, (m,), **SMALL)] if draw(st.booleans()) else [])
    terms = c * math.prod(kernel)
    differential(op, args, attrs, tol=4 * terms, atol=0.02 * terms if dtype == F16 else 0.0)


@SETTINGS
@given(data=st.data())
def _col2im(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op, 18)))
    rank = draw(st.integers(1, 3))
    image = [draw(st.integers(1, 5)) for _ in range(rank)]
    block = [draw(st.integers(1, 3)) for _ in range(rank)]
    dilations = [draw(st.integers(1, 2)) for _ in range(rank)]
    strides = [draw(st.integers(1, 2)) for _ in range(rank)]
    pads = [draw(st.integers(0, 2)) for _ in range(2 * rank)]
    padded = [n + pads[i] + pads[i + rank] for i, n in enumerate(image)]
    blocks = [(p - d * (k - 1) - 1) // s + 1 for p, k, d, s in zip(padded, block, dilations, strides)]
    assume(min(blocks) >= 1)  # no block fits: no valid input
    channels = draw(st.integers(1, 2))
    columns = tensor(draw, dtype, (draw(st.integers(1, 2)), channels * math.prod(block),
                                   math.prod(blocks)), integers=(-20, 20), **SMALL)
    attrs = {"dilations": dilations, "pads": pads, "strides": strides}
    differential(op, [columns, ints_input(draw, image), ints_input(draw, block)], attrs, opset=18,
                 tol=4 * math.prod(block), exact=dtype.kind in "biu")


# -- normalizations --------------------------------------------------------------------------------
def _norm_tol(dtype: np.dtype, count: int) -> dict[str, Any]:
    """Statistics over ``count`` elements: float16 results are rounded once from float32 (one
    half-ulp each side), float32 and float64 differ by the sums' orders."""
    return {"tol": 4 * max(count, 1) if dtype != F16 else 2.0, "atol": 2e-3 if dtype == F16 else 0}


@SETTINGS
@given(data=st.data())
def _instance_norm(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op)
    shape = draw(shapes(min_dims=3, max_dims=5, min_side=1, max_side=4))
    x = tensor(draw, dtype, shape, **SMALL)
    args = [x, tensor(draw, dtype, shape[1:2], **SMALL), tensor(draw, dtype, shape[1:2], **SMALL)]
    differential(op, args, {"epsilon": draw(st.sampled_from([1e-5, 1e-2]))},
                 **_norm_tol(dtype, math.prod(shape[2:])))


@SETTINGS
@given(data=st.data())
def _group_norm(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([18, 21]))
    dtype = floats(draw, op, opset)
    groups = draw(st.integers(1, 3))
    shape = (draw(st.integers(1, 2)), groups * draw(st.integers(1, 2)),
             *draw(shapes(min_dims=1, max_dims=2, min_side=1, max_side=3)))
    params = groups if opset < 21 else shape[1]
    args = [tensor(draw, dtype, shape, **SMALL), tensor(draw, dtype, (params,), **SMALL),
            tensor(draw, dtype, (params,), **SMALL)]
    differential(op, args, {"num_groups": groups}, opset=opset,
                 **_norm_tol(dtype, math.prod(shape[1:]) // groups))


@SETTINGS
@given(data=st.data())
def _rms_norm(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op, 23)
    shape = draw(shapes(min_dims=1, max_dims=4, min_side=1))
    axis = axis_of(draw, len(shape))
    scale_shape = shape[axis % len(shape):][draw(st.integers(0, len(shape) - axis % len(shape) - 1)):]
    args = [tensor(draw, dtype, shape, **SMALL), tensor(draw, dtype, scale_shape, **SMALL)]
    differential(op, args, {"axis": axis}, opset=23,
                 **_norm_tol(dtype, math.prod(shape[axis % len(shape):])))


@SETTINGS
@given(data=st.data())
def _lrn(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op)
    shape = draw(shapes(min_dims=2, max_dims=4, min_side=1))
    attrs = {"size": draw(st.integers(1, 4)), "alpha": draw(float32s(1e-3, 1)),
             "beta": draw(float32s(0.1, 1)), "bias": draw(float32s(0.5, 2))}
    differential(op, [tensor(draw, dtype, shape, **SMALL)], attrs, tol=8,
                 atol=2e-3 if dtype == F16 else 0.0)


@SETTINGS
@given(data=st.data())
def _lp_norm(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op)
    shape = draw(shapes(min_dims=1, max_dims=4, min_side=1))
    attrs = {"axis": axis_of(draw, len(shape)), "p": draw(st.sampled_from([1, 2]))}
    differential(op, [tensor(draw, dtype, shape, **SMALL)], attrs, tol=8 * max(shape),
                 atol=2e-3 if dtype == F16 else 0.0)


@SETTINGS
@given(data=st.data())
def _mvn(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([d for d in schema_dtypes(op) if d != F16]))  # E[x²] - E[x]²
    shape = draw(shapes(min_dims=1, max_dims=4, min_side=2))
    rank = len(shape)
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    x = tensor(draw, dtype, shape, **SMALL)
    # the variance as E[x²] - E[x]² cancels where the values are alike: keep them apart
    spread = x.ref.var(axis=tuple(axes))
    if np.any(spread < 0.05):
        return
    differential(op, [x], {"axes": axes}, tol=64 * math.prod(shape))


# -- pools -----------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _lp_pool(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, 18]))
    dtype = floats(draw, op, opset)
    rank = draw(st.integers(1, 3))
    spatial = [draw(st.integers(1, 5)) for _ in range(rank)]
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    attrs: dict[str, Any] = {"kernel_shape": kernel, "p": draw(st.sampled_from([1, 2, 3])),
                             "strides": [draw(st.integers(1, 2)) for _ in range(rank)]}
    if draw(st.booleans()):
        attrs["pads"] = [draw(st.integers(0, k - 1)) for k in kernel * 2]
    elif draw(st.booleans()):
        attrs["auto_pad"] = draw(st.sampled_from(["SAME_UPPER", "SAME_LOWER", "VALID"]))
    if opset >= 18:
        attrs["dilations"] = [draw(st.integers(1, 2)) for _ in range(rank)]
        attrs["ceil_mode"] = draw(st.sampled_from([0, 1]))
    x = tensor(draw, dtype, (1, draw(st.integers(1, 2)), *spatial), **SMALL)
    differential(op, [x], attrs, opset=opset, tol=8 * math.prod(kernel),
                 atol=4e-3 if dtype == F16 else 0.0)


@SETTINGS
@given(data=st.data())
def _global_lp_pool(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op)
    shape = draw(shapes(min_dims=3, max_dims=5, min_side=1, max_side=4))
    differential(op, [tensor(draw, dtype, shape, **SMALL)], {"p": draw(st.sampled_from([1, 2, 3]))},
                 tol=8 * math.prod(shape[2:]), atol=4e-3 if dtype == F16 else 0.0)


@SETTINGS
@given(data=st.data())
def _max_unpool(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op)
    rank = draw(st.integers(1, 3))
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    pooled = [draw(st.integers(1, 3)) for _ in range(rank)]
    spatial = [(p - 1) * s + k for p, s, k in zip(pooled, strides, kernel)]
    # indices as a MaxPool gives them: distinct flat positions, each inside its own plane
    plane = math.prod(spatial)
    per_plane = math.prod(pooled)
    if per_plane > plane:
        return
    picks = [np.array(draw(st.permutations(range(plane)))[:per_plane]) + i * plane
             for i in range(n * c)]
    indices = np.concatenate(picks).reshape(n, c, *pooled).astype(np.int64)
    args = [tensor(draw, dtype, (n, c, *pooled)), place(indices)]
    if draw(st.booleans()):
        target = [n, c, *[s + draw(st.integers(0, 2)) for s in spatial]]
        args.append(ints_input(draw, target))
    differential(op, args, {"kernel_shape": kernel, "strides": strides}, exact=True)


# -- sampling --------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _grid_sample(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([16, 20]))
    dtype = floats(draw, op, opset)
    rank = draw(st.sampled_from([2, 3]))
    modes = ["linear", "nearest", "cubic"] if opset >= 20 else ["bilinear", "nearest", "bicubic"]
    attrs = {"mode": draw(st.sampled_from(modes)), "align_corners": draw(st.sampled_from([0, 1])),
             "padding_mode": draw(st.sampled_from(["zeros", "border", "reflection"]))}
    x = tensor(draw, dtype, (1, draw(st.integers(1, 2)),
                             *[draw(st.integers(1, 4)) for _ in range(rank)]), **SMALL)
    out = [draw(st.integers(1, 3)) for _ in range(rank)]
    # coordinates past [-1, 1], but never on a pixel's edge (nearest rounds half to even there,
    # and one ulp of difference picks the other neighbour)
    grid = tensor(draw, dtype, (1, *out, rank), low=-1.6, high=1.6, special=False)
    if attrs["mode"] == "nearest":
        assume(not _on_a_pixel_edge(grid.ref, x.ref.shape[2:], attrs["align_corners"]))
    differential(op, [x, grid], attrs, opset=opset, tol=64, atol=0.02 if dtype == F16 else 1e-5)


def _on_a_pixel_edge(grid: np.ndarray, spatial: Sequence[int], align_corners: int) -> bool:
    """Whether a grid point lands within float16's rounding of a half-pixel: there nearest's
    neighbour depends on the precision the coordinate is computed in (CpuRef: the input's type;
    torch: float32), and either is right (a tie). Reflection maps half-pixels to half-pixels."""
    sizes = np.array(spatial[::-1], dtype=np.float64)  # the grid's last axis is x, y[, z]
    g = grid.astype(np.float64)
    pixel = (g + 1) / 2 * (sizes - 1) if align_corners else ((g + 1) * sizes - 1) / 2
    return bool(np.any(np.abs(pixel - np.floor(pixel) - 0.5) < 0.01))


@SETTINGS
@given(data=st.data())
def _affine_grid(op: str, data: Any) -> None:
    draw = data.draw
    dtype = floats(draw, op, 20)
    rank = draw(st.sampled_from([2, 3]))
    n = draw(st.integers(1, 2))
    size = [n, draw(st.integers(1, 2)), *[draw(st.integers(1, 4)) for _ in range(rank)]]
    theta = tensor(draw, dtype, (n, rank, rank + 1), **SMALL)
    differential(op, [theta, ints_input(draw, size)],
                 {"align_corners": draw(st.sampled_from([0, 1]))}, opset=20, tol=16,
                 atol=4e-3 if dtype == F16 else 1e-6)


PROPERTIES = {
    "GridSample": _grid_sample, "AffineGrid": _affine_grid,
    "RNN": _recurrent, "GRU": _recurrent, "LSTM": _recurrent, "ConvTranspose": _conv_transpose,
    "Col2Im": _col2im, "InstanceNormalization": _instance_norm, "GroupNormalization": _group_norm,
    "RMSNormalization": _rms_norm, "LRN": _lrn, "LpNormalization": _lp_norm,
    "MeanVarianceNormalization": _mvn, "LpPool": _lp_pool, "GlobalLpPool": _global_lp_pool,
    "MaxUnpool": _max_unpool,
}


@pytest.mark.parametrize("op", OPS)
def test_against_cpuref(op: str) -> None:
    run(PROPERTIES[op], op)


@pytest.mark.parametrize("name", case_names(OPS))
def test_node_case(name: str) -> None:
    check_case(name)


def test_every_op_has_node_cases() -> None:
    missing = [op for op in OPS if not case_names((op,))]
    assert missing == ["GlobalLpPool"], f"no single-op node cases for {missing}"  # onnx has none


def test_every_kernel_of_the_table_is_tested_here() -> None:
    from backplane.backends.torch.kernels import network, recurrent  # recurrent.py split in two

    assert sorted({**recurrent.KERNELS, **network.KERNELS}) == sorted(OPS) == sorted(PROPERTIES)
