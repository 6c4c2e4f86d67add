"""Differential tests of the numeric torch kernels (``kernels/numeric.py``; those of linear
quantization are in test_kernels_quantization.py) against CpuRef, over cases that hypothesis
generates, in the harness of ``differential.py`` (its rules, layouts, settings and environment
variables hold here too).

Selections, bit operations, integer arithmetic and casts must equal CpuRef exactly; float
arithmetic within a tolerance scaled by the length of its sums and products.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
import onnx  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from backplane.backends.torch.kernels import numeric  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    F16,
    F32,
    F64,
    I8,
    I32,
    I64,
    OPSET,
    SETTINGS,
    TORCH_TYPES,
    U8,
    axis_of,
    differential,
    float32s,
    input_dtypes,
    ints_input,
    place,
    run,
    schema_dtypes,
    shapes,
    tensor,
    tolerance_dtype,
)


def _onnx_type(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(dtype)


def _slack(dtype: np.dtype, terms: int, size: float = 1.0) -> float:
    """An absolute tolerance for a sum of ``terms`` values of magnitude up to ``size``."""
    return 4 * max(terms, 1) * size * tolerance_dtype(dtype)


# -- elementwise -----------------------------------------------------------------------------------
UNARY = ("IsNaN", "IsInf", "BitwiseNot", "Celu", "Shrink", "Swish")
UNARY_OPSETS = {"Swish": 24}


def _unary_attrs(draw: Any, op: str) -> dict[str, Any]:
    if op == "IsInf":
        flag = st.sampled_from([0, 1])
        return draw(st.fixed_dictionaries({}, optional={"detect_negative": flag,
                                                        "detect_positive": flag}))
    if op == "Celu":
        return draw(st.fixed_dictionaries({}, optional={"alpha": float32s(0.1, 3)}))
    if op == "Shrink":
        return draw(st.fixed_dictionaries({}, optional={"bias": float32s(-2, 2),
                                                        "lambd": float32s(0, 3)}))
    if op == "Swish":
        return draw(st.fixed_dictionaries({}, optional={"alpha": float32s(-3, 3)}))
    return {}


@SETTINGS
@given(data=st.data())
def _unary(op: str, data: Any) -> None:
    draw = data.draw
    opset = UNARY_OPSETS.get(op, OPSET)
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    x = tensor(draw, dtype, draw(shapes()))
    exact = op in ("IsNaN", "IsInf", "BitwiseNot")
    differential(op, [x], _unary_attrs(draw, op), opset=opset, exact=exact,
                 tol=1 if exact else 4)


@pytest.mark.parametrize("op", UNARY)
def test_unary(op: str) -> None:
    run(_unary, op)


BINARY = ("Mod", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "SwiGLU")
BINARY_OPSETS = {"SwiGLU": (28,), "BitShift": (11, 28)}  # BitShift: signed types from 28


def _divisors(dtype: np.dtype) -> st.SearchStrategy[Any]:
    """Integer divisors with the special ones often: 0, -1 (INT_MIN % -1 traps on x86), 1."""
    info = np.iinfo(dtype)
    special = [0, 1, int(info.max)] + ([-1, int(info.min)] if dtype.kind == "i" else [])
    return st.one_of(st.sampled_from(special), st.integers(int(info.min), int(info.max)))


@SETTINGS
@given(data=st.data())
def _binary(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from(BINARY_OPSETS.get(op, (OPSET,))))
    dtype, other = input_dtypes(draw, op, opset)[:2]
    shape_a, shape_b = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4,
                                                               max_side=3)).input_shapes
    attrs: dict[str, Any] = {}
    if op == "Mod":
        attrs = draw(st.fixed_dictionaries({}, optional={"fmod": st.sampled_from([0, 1])}))
    if op == "BitShift":
        attrs["direction"] = draw(st.sampled_from(["LEFT", "RIGHT"]))
    a = tensor(draw, dtype, shape_a)
    if dtype.kind in "iu" and op == "Mod":
        b = place(draw(hnp.arrays(other, shape_b, elements=_divisors(other))),
                  draw(st.sampled_from(("contiguous", "permuted", "broadcast"))))
    else:
        b = tensor(draw, other, shape_b)
    differential(op, [a, b], attrs, opset=opset, exact=op != "SwiGLU", tol=4)


@pytest.mark.parametrize("op", BINARY)
def test_binary(op: str) -> None:
    run(_binary, op)


# -- cumulative, Einsum, Det -----------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _cumulative(op: str, data: Any) -> None:
    draw = data.draw
    opset = 26 if op == "CumProd" else OPSET
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    shape = draw(shapes(min_dims=1))
    axis = axis_of(draw, len(shape))
    attrs = draw(st.fixed_dictionaries({}, optional={"exclusive": st.sampled_from([0, 1]),
                                                     "reverse": st.sampled_from([0, 1])}))
    low, high = (-2, 2) if op == "CumProd" else (-10, 10)  # no products past the type's range
    x = tensor(draw, dtype, shape, low=low, high=high, large=False)
    axis_input = ints_input(draw, [axis], draw(st.sampled_from([I32, I64])))
    length = shape[axis]
    size = 2.0**length if op == "CumProd" else 10.0
    differential(op, [x, axis_input], attrs, opset=opset, exact=dtype.kind in "iu",
                 atol=_slack(dtype, length, size))


@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
def test_cumulative(op: str) -> None:
    run(_cumulative, op)


EINSUMS = {  # equation -> the letters of each operand's axes (. for an ellipsis of 0-2 axes)
    "ij,jk->ik": ("ij", "jk"), "bij,bjk->bik": ("bij", "bjk"), "ii->i": ("ii",),
    "ij->ji": ("ij",), "...ij->...ji": (".ij",), "i,i": ("i", "i"), "ij": ("ij",),
    "i,j->ij": ("i", "j"), "bii ->bi": ("bii",), "ij, ij ->": ("ij", "ij"),
    "...i,...i->...": (".i", ".i"), "abc,cd->abd": ("abc", "cd"),
}


@SETTINGS
@given(data=st.data())
def _einsum(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    equation = draw(st.sampled_from(sorted(EINSUMS)))
    sizes = {letter: draw(st.integers(0, 3)) for letter in "abcdijk"}
    ellipsis = draw(shapes(max_dims=2, max_side=2))
    operands = []
    for axes in EINSUMS[equation]:
        shape = [d for letter in axes for d in (ellipsis if letter == "." else (sizes[letter],))]
        operands.append(tensor(draw, dtype, shape, low=-3, high=3, special=False))
    terms = math.prod(sizes.values())
    differential(op, operands, {"equation": equation}, atol=_slack(dtype, terms, 9.0))


def test_einsum() -> None:
    run(_einsum, "Einsum")


@SETTINGS
@given(data=st.data())
def _det(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F64]))  # NumPy's linalg has no float16 either
    n = draw(st.integers(1, 4))
    batch = draw(shapes(max_dims=2, max_side=2))
    x = tensor(draw, dtype, [*batch, n, n], low=-2, high=2, special=False)
    differential(op, [x], tol=100, atol=_slack(dtype, math.factorial(n), 2.0**n))


def test_det() -> None:
    run(_det, "Det")


# -- losses ----------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _loss(op: str, data: Any) -> None:
    draw = data.draw
    dtype, index_type = input_dtypes(draw, op)[:2]
    n, classes = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    extra = list(draw(shapes(max_dims=2, min_side=1, max_side=3)))
    scores = tensor(draw, dtype, [n, classes, *extra], low=-5, high=5, special=False)
    if op == "NegativeLogLikelihoodLoss":  # log-probabilities
        scores = place(-np.abs(scores.ref), draw(st.sampled_from(("contiguous", "permuted"))))
    attrs: dict[str, Any] = draw(st.fixed_dictionaries({}, optional={
        "reduction": st.sampled_from(["none", "sum", "mean"]),
        "ignore_index": st.integers(-1, classes)}))
    target = tensor(draw, index_type, [n, *extra], ("contiguous",),
                    integers=(-classes, classes - 1))
    args = [scores, target]
    if draw(st.booleans()):
        args.append(tensor(draw, dtype, [classes], ("contiguous",), low=0, high=2, special=False))
    n_outputs = 2 if op == "SoftmaxCrossEntropyLoss" and draw(st.booleans()) else 1
    terms = n * math.prod(extra)
    differential(op, args, attrs, n_outputs=n_outputs, tol=8, atol=_slack(dtype, terms, 20.0))


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
def test_loss(op: str) -> None:
    run(_loss, op)


# -- ArgMax, ArgMin, Hardmax -----------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _arg(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, 12, OPSET]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    shape = draw(shapes(min_dims=1, min_side=1))
    attrs = {"axis": axis_of(draw, len(shape))}
    attrs.update(draw(st.fixed_dictionaries({}, optional={"keepdims": st.sampled_from([0, 1])})))
    if opset >= 12 and draw(st.booleans()):
        attrs["select_last_index"] = draw(st.sampled_from([0, 1]))
    x = tensor(draw, dtype, shape, integers=(-3, 3))  # few values: ties
    differential(op, [x], attrs, opset=opset, exact=True)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg(op: str) -> None:
    run(_arg, op)


@SETTINGS
@given(data=st.data())
def _hardmax(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, OPSET]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    shape = draw(shapes(min_dims=1, min_side=1))
    attrs = {"axis": axis_of(draw, len(shape))} if draw(st.booleans()) else {}
    if opset < 13 and attrs:
        attrs["axis"] %= len(shape)
    x = tensor(draw, dtype, shape)
    differential(op, [x], attrs, opset=opset, exact=True)


def test_hardmax() -> None:
    run(_hardmax, "Hardmax")


# -- reductions ------------------------------------------------------------------------------------
REDUCTIONS = ("ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
              "ReduceLogSumExp")


@SETTINGS
@given(data=st.data())
def _reduce(op: str, data: Any) -> None:
    draw = data.draw
    with_input = draw(st.booleans())
    opset = draw(st.sampled_from([18, OPSET])) if with_input else draw(st.sampled_from([11, 13]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    shape = draw(shapes())
    rank = len(shape)
    chosen = draw(st.lists(st.integers(0, max(rank - 1, 0)), unique=True, max_size=rank))
    axes = [a - rank if draw(st.booleans()) else a for a in chosen] if rank else []
    attrs: dict[str, Any] = {}
    if draw(st.booleans()):
        attrs["keepdims"] = draw(st.sampled_from([0, 1]))
    low, high = (-2, 2) if op == "ReduceProd" else (-10, 10)
    x = tensor(draw, dtype, shape, low=low, high=high, large=False)
    args = [x]
    if with_input:
        if draw(st.booleans()):
            attrs["noop_with_empty_axes"] = draw(st.sampled_from([0, 1]))
        if axes or draw(st.booleans()):
            args.append(ints_input(draw, axes))
    elif axes:
        attrs["axes"] = axes
    reduced = [d for i, d in enumerate(shape) if not axes or i in {a % rank for a in axes}]
    count = math.prod(reduced)
    size = {"ReduceProd": 2.0**count, "ReduceSumSquare": 100.0, "ReduceL1": 10.0}.get(op, 10.0)
    differential(op, args, attrs, opset=opset, exact=dtype.kind in "iu", tol=4,
                 atol=_slack(dtype, count, size))


@pytest.mark.parametrize("op", REDUCTIONS)
def test_reduce(op: str) -> None:
    run(_reduce, op)


# -- windows and spectra ---------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _window(op: str, data: Any) -> None:
    draw = data.draw
    # a tensor where the output is made (GpuAcc keeps no window's size on the host)
    size = place(np.array(draw(st.integers(0, 40)), draw(st.sampled_from([I32, I64]))))
    attrs: dict[str, Any] = draw(st.fixed_dictionaries({}, optional={
        "periodic": st.sampled_from([0, 1]),
        "output_datatype": st.sampled_from([_onnx_type(t) for t in (F16, F32, F64)])}))
    differential(op, [size], attrs, opset=17, tol=4)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
def test_window(op: str) -> None:
    run(_window, op)


@SETTINGS
@given(data=st.data())
def _dft(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([17, 20]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    batch = draw(shapes(min_dims=1, max_dims=2, min_side=1, max_side=3))
    length = draw(st.integers(1, 8))
    shape = [*batch, length, draw(st.sampled_from([1, 2]))]
    axis = draw(st.integers(1, len(shape) - 2))
    attrs: dict[str, Any] = draw(st.fixed_dictionaries({}, optional={
        "inverse": st.sampled_from([0, 1]), "onesided": st.sampled_from([0, 1])}))
    x = tensor(draw, dtype, shape, low=-3, high=3, special=False)
    n = draw(st.none() | st.integers(1, 10))
    args = [x]
    if opset >= 20:
        args += [None if n is None else ints_input(draw, [n]),
                 ints_input(draw, [axis - len(shape) if draw(st.booleans()) else axis])]
    else:
        attrs["axis"] = axis
        args.append(None if n is None else ints_input(draw, [n]))
    while args[-1] is None:
        args.pop()
    terms = max(n or 0, length) * 2
    differential(op, args, attrs, opset=opset, tol=16, atol=_slack(dtype, terms, 3.0))


def test_dft() -> None:
    run(_dft, "DFT")


@SETTINGS
@given(data=st.data())
def _stft(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op, 17)))
    length = draw(st.integers(1, 8))
    signal = draw(st.integers(length, 16))
    x = tensor(draw, dtype, [draw(st.integers(1, 2)), signal, draw(st.sampled_from([1, 2]))],
               low=-3, high=3, special=False)
    step = ints_input(draw, [draw(st.integers(1, 4))])
    attrs = draw(st.fixed_dictionaries({}, optional={"onesided": st.sampled_from([0, 1])}))
    window = tensor(draw, dtype, [length], low=0, high=1, special=False) \
        if draw(st.booleans()) else None
    frame = ints_input(draw, [length]) if window is None or draw(st.booleans()) else None
    args = [x, step, window, frame]
    while args[-1] is None:
        args.pop()
    differential(op, args, attrs, opset=17, tol=16, atol=_slack(dtype, 2 * length, 3.0))


def test_stft() -> None:
    run(_stft, "STFT")


# -- casts -----------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _cast_like(op: str, data: Any) -> None:
    draw = data.draw
    source = draw(st.sampled_from(schema_dtypes(op)))
    target = draw(st.sampled_from(list(TORCH_TYPES.values())))
    kwargs: dict[str, Any] = {}
    if source.kind == "f" and target.kind in "iu":  # out of range (and NaN) is undefined
        info = np.iinfo(target)
        kwargs = {"low": max(float(info.min), -1e4), "high": min(float(info.max), 1e4),
                  "special": False}
    x = tensor(draw, source, draw(shapes()), **kwargs)
    like = tensor(draw, target, draw(shapes(max_dims=2)))
    differential(op, [x, like], exact=True)


def test_cast_like() -> None:
    run(_cast_like, "CastLike")


@SETTINGS
@given(data=st.data())
def _bit_cast(op: str, data: Any) -> None:
    draw = data.draw
    source = draw(st.sampled_from(schema_dtypes(op, 26)))
    target = draw(st.sampled_from([t for t in TORCH_TYPES.values()
                                   if t.itemsize == source.itemsize]))
    x = tensor(draw, source, draw(shapes()))
    differential(op, [x], {"to": _onnx_type(target)}, opset=26, exact=True)


def test_bit_cast() -> None:
    run(_bit_cast, "BitCast")


# -- what CpuAcc refuses, with a reason ------------------------------------------------------------
def test_refusals_name_the_reason() -> None:
    from backplane.backends.torch.backend import CpuAcc
    from backplane.ir.graph import UNKNOWN, Layer, TensorInfo

    acc = CpuAcc()

    def reason(op: str, infos: list[TensorInfo], attrs: dict[str, Any], opset: int = OPSET) -> str:
        layer = Layer(op.lower(), op, [f"x{i}" for i in range(len(infos))], ["y"], attrs, "",
                      opset)
        support = acc.is_layer_supported(layer, infos, [UNKNOWN])
        assert not support.ok, f"{op} {attrs} claimed"
        return support.reason

    signal = TensorInfo((1, 8, 2), F32)
    assert "inverse DFT" in reason("DFT", [signal], {"inverse": 1})
    assert "direction 'UP'" in reason("BitShift", [TensorInfo((2,), U8)] * 2, {"direction": "UP"})
    assert "Det on float16" in reason("Det", [TensorInfo((2, 2), F16)], {})
    assert "BitCast to bool" in reason("BitCast", [TensorInfo((2,), I8)],
                                       {"to": _onnx_type(np.dtype(np.bool_))}, 26)
    assert "empty tensor" in reason("ArgMax", [TensorInfo((0, 2), F32)], {"axis": 0})
    assert "QuantizeLinear to" in reason(
        "QuantizeLinear", [TensorInfo((2,), F32), TensorInfo((), F32)],
        {"output_dtype": onnx.TensorProto.UINT16}, OPSET)


def test_every_numeric_kernel_is_covered() -> None:
    covered = {*UNARY, *BINARY, "CumSum", "CumProd", "Einsum", "Det", "ArgMax", "ArgMin",
               "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss",
               "Hardmax", *REDUCTIONS, "HannWindow", "HammingWindow", "BlackmanWindow", "DFT",
               "STFT", "CastLike", "BitCast"}
    assert sorted(set(numeric.KERNELS) - covered) == []
