"""Differential tests: every op of the torch kernel table (CpuAcc, GpuAcc) against CpuRef, over cases
that hypothesis generates.

The rule for each generated case: when CpuAcc claims the layer (``is_layer_supported`` is ok), its
outputs must equal CpuRef's: exactly for integers, booleans, data movement and selections, within a
tolerance suited to the element type for float arithmetic (scaled by the length of the sum for
reductions, products and convolutions). CpuAcc must also return torch tensors, one per output, and
leave its inputs as they were. A case CpuRef refuses or raises on is not valid ONNX (or not in the
spec's reach) and is skipped with ``hypothesis.assume``; a case CpuAcc refuses is fine as long as it
gives a reason (the layer falls back to CpuRef). Every test asserts that CpuAcc claimed at least one of
its cases, so that a kernel refused everywhere does not pass unseen.

Generated cases cover 0-d tensors, size-0 dimensions, broadcasting, negative axes and indices,
extreme slice bounds, every element type the op's ONNX schema allows that torch has, several opsets
where the kernel changed, and CpuAcc's inputs in other memory layouts than contiguous: transposed
strides, every other element, a storage offset, channels-last (4-D and 5-D) and stride-0 broadcast
views (what a Transpose, Slice or Expand before the layer hands over). Shape-like inputs (Reshape's
shape, Slice's starts, ...) arrive as torch tensors or as NumPy arrays (GpuAcc keeps those on the
host).

Runs:

- CI (the default): a fixed seed (``derandomize=True``) and ``CI_EXAMPLES`` examples per op::

      python -m pytest tests/backends/torch/test_differential.py -q -p no:cacheprovider

- Longer: ``BACKPLANE_HYPOTHESIS_EXAMPLES=N`` runs N examples per op from random seeds (pytest's
  ``--hypothesis-seed=S`` makes one reproducible); with ``-s`` each test prints how its cases went
  (claimed, refused by CpuAcc and why, skipped because CpuRef refused or raised)::

      BACKPLANE_HYPOTHESIS_EXAMPLES=1000 python -m pytest tests/backends/torch/test_differential.py \\
          -q -p no:cacheprovider -s --hypothesis-seed=7

- GpuAcc (the same kernels on CUDA tensors), on a machine with CUDA:
  ``BACKPLANE_DIFFERENTIAL_BACKEND=GpuAcc`` (skipped where GpuAcc is not available).

The explicit regression tests for what these found are in ``test_differential_regressions.py``;
the harness and strategies in ``differential.py``; the shape ops' properties in
``test_differential_shapes.py``, the products', convolutions', pools' and normalizations' in
``test_differential_nn.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
import onnx  # noqa: E402
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from backplane.backends.torch.kernels import KERNELS  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    BOOL,
    F16,
    OPSET,
    SETTINGS,
    TORCH_TYPES,
    axis_of,
    differential,
    float32s,
    input_dtypes,
    ints_input,
    run,
    schema_dtypes,
    shapes,
    tensor,
    tolerance_dtype,
)

pytestmark = pytest.mark.slow  # hypothesis, 40 examples a case: `python -m pytest -m slow`


# -- elementwise: unary ----------------------------------------------------------------------------
UNARY = ("Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log", "Floor", "Ceil", "Round", "Sign", "Erf",
         "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Tanh", "Asinh", "Acosh",
         "Atanh", "Not", "Relu", "Sigmoid", "HardSwish", "Softplus", "Softsign", "Mish", "Identity",
         "LeakyRelu", "Elu", "Selu", "HardSigmoid", "ThresholdedRelu", "Gelu")
SELECTIONS = frozenset({"Neg", "Abs", "Floor", "Ceil", "Round", "Sign", "Not", "Relu", "Identity",
                        "ThresholdedRelu"})
"""Ops that select or round: no arithmetic to differ in, so exact."""


def _unary_attrs(draw: Any, op: str) -> dict[str, Any]:
    value = float32s(-3, 3)
    positive = float32s(0.01, 3)
    if op == "LeakyRelu":
        return draw(st.fixed_dictionaries({}, optional={"alpha": value}))
    if op in ("Elu", "ThresholdedRelu"):
        return draw(st.fixed_dictionaries({}, optional={"alpha": positive}))
    if op == "Selu":
        return draw(st.fixed_dictionaries({}, optional={"alpha": positive, "gamma": positive}))
    if op == "HardSigmoid":
        return draw(st.fixed_dictionaries({}, optional={
            "alpha": st.one_of(st.sampled_from([1 / 6, float(np.float32(1 / 6))]), value),
            "beta": st.one_of(st.just(0.5), value)}))
    if op == "Gelu":
        return draw(st.fixed_dictionaries({}, optional={"approximate": st.sampled_from(
            ["none", "tanh"])}))
    return {}


@SETTINGS
@given(data=st.data())
def _unary(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    x = tensor(draw, dtype, draw(shapes()))
    differential(op, [x], _unary_attrs(draw, op), exact=op in SELECTIONS)


@pytest.mark.parametrize("op", UNARY)
def test_unary(op: str) -> None:
    run(_unary, op)


# -- elementwise: binary and variadic, with broadcasting -------------------------------------------
BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "LessOrEqual", "Greater",
          "GreaterOrEqual", "And", "Or", "Xor", "PRelu")
VARIADIC = ("Sum", "Mean", "Max", "Min")
EXACT_BINARY = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or",
                          "Xor", "Max", "Min"})


@SETTINGS
@given(data=st.data())
def _binary(op: str, data: Any) -> None:
    draw = data.draw
    dtype, other = input_dtypes(draw, op)
    if op == "PRelu":  # the slope broadcasts to X, one way
        shape_x = draw(shapes())
        shape_b = shape_x[draw(st.integers(0, len(shape_x))):]
        shape_b = tuple(d if draw(st.booleans()) else 1 for d in shape_b)
        shape_a = shape_x
    else:
        shape_a, shape_b = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4,
                                                                   max_side=3)).input_shapes
    a = tensor(draw, dtype, shape_a)
    kwargs: dict[str, Any] = {}
    if op == "Pow" and other.kind in "iu":
        kwargs["integers"] = (-6, 6)  # exponents past float32's exact integers are another story
    b = tensor(draw, other, shape_b, **kwargs)
    if op == "Pow":  # -inf ** 0.5: NumPy itself gives NaN or inf (C's pow) depending on the loop
        base, exponent = np.broadcast_arrays(a.ref, b.ref)
        assume(not (np.isneginf(base) & (exponent != np.round(exponent))).any())
    differential(op, [a, b], exact=op in EXACT_BINARY or dtype.kind in "biu")


@pytest.mark.parametrize("op", BINARY)
def test_binary(op: str) -> None:
    run(_binary, op)


@SETTINGS
@given(data=st.data())
def _variadic(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op)))
    count = draw(st.integers(1, 3))
    result = draw(hnp.mutually_broadcastable_shapes(num_shapes=count, max_dims=4, max_side=3))
    args = [tensor(draw, dtype, shape) for shape in result.input_shapes]
    differential(op, args, exact=op in EXACT_BINARY or dtype.kind in "biu",
                 opset=draw(st.sampled_from([8, 12, OPSET])))


@pytest.mark.parametrize("op", VARIADIC)
def test_variadic(op: str) -> None:
    run(_variadic, op)


@SETTINGS
@given(data=st.data())
def _where(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(schema_dtypes(op, index=1)))
    result = draw(hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=4, max_side=3))
    cond, x, y = result.input_shapes
    differential(op, [tensor(draw, BOOL, cond), tensor(draw, dtype, x), tensor(draw, dtype, y)],
                 exact=True)


def test_where() -> None:
    run(_where, "Where")


@SETTINGS
@given(data=st.data())
def _clip(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([6, 11, 12, OPSET]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    x = tensor(draw, dtype, draw(shapes()))
    if opset < 11:  # bounds are attributes
        bounds = float32s(-5, 5)
        attrs = draw(st.fixed_dictionaries({}, optional={"min": bounds, "max": bounds}))
        differential(op, [x], attrs, opset=opset, exact=True)
        return
    low = draw(st.none() | st.just(True))
    high = draw(st.none() | st.just(True))
    bound = {"integers": (-100, 100)} if dtype.kind in "iu" else {"low": -5, "high": 5,
                                                                  "special": False}
    host = ("contiguous", "numpy")  # GpuAcc keeps the bounds on the host
    args = [x, None if low is None else tensor(draw, dtype, (), host, **bound),
            None if high is None else tensor(draw, dtype, (), host, **bound)]
    while args and args[-1] is None and len(args) > 1:
        args.pop()
    differential(op, args, opset=opset, exact=True)


def test_clip() -> None:
    run(_clip, "Clip")


# -- Cast ------------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def _cast(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([6, 13, 19, OPSET]))
    source = draw(st.sampled_from(schema_dtypes(op, opset)))
    target = draw(st.sampled_from(list(TORCH_TYPES.values())))
    kwargs: dict[str, Any] = {}
    if source.kind == "f" and target.kind in "iu":
        # out of the target's range (and NaN) is undefined: in range, rounding toward zero
        info = np.iinfo(target)
        kwargs = {"low": max(float(info.min), -1e4), "high": min(float(info.max), 1e4),
                  "special": False}
    elif source.kind == "f":
        kwargs = {"low": -1e5, "high": 1e5}
    x = tensor(draw, source, draw(shapes()), **kwargs)
    attrs: dict[str, Any] = {"to": onnx.helper.np_dtype_to_tensor_dtype(target)}
    if opset >= 19 and draw(st.booleans()):
        attrs["saturate"] = draw(st.sampled_from([0, 1]))
    differential(op, [x], attrs, opset=opset, exact=True)


def test_cast() -> None:
    run(_cast, "Cast")


# -- reductions ------------------------------------------------------------------------------------
REDUCTIONS = {"ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18}
"""op -> the opset where its axes became an input."""


@SETTINGS
@given(data=st.data())
def _reduce(op: str, data: Any) -> None:
    draw = data.draw
    with_input = draw(st.booleans())
    opset = REDUCTIONS[op] if with_input else draw(st.sampled_from([11, REDUCTIONS[op] - 1]))
    opset = max(opset, OPSET) if with_input and draw(st.booleans()) else opset
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    shape = draw(shapes())
    rank = len(shape)
    chosen = draw(st.lists(st.integers(0, max(rank - 1, 0)), unique=True, max_size=rank))
    axes = [a - rank if draw(st.booleans()) else a for a in chosen] if rank else []
    attrs: dict[str, Any] = {}
    if draw(st.booleans()):
        attrs["keepdims"] = draw(st.sampled_from([0, 1]))
    # float16 sums: CpuRef's (NumPy's) partial sums are float16 and overflow where torch's float32
    # ones do not (a mean of 1e4s is inf there): that is precision, not semantics, so no 1e4s
    x = tensor(draw, dtype, shape, large=dtype != F16)
    args = [x]
    if with_input:
        if draw(st.booleans()):
            attrs["noop_with_empty_axes"] = draw(st.sampled_from([0, 1]))
        if axes or draw(st.booleans()):
            args.append(ints_input(draw, axes))
    elif axes:
        attrs["axes"] = axes
    reduced = [d for i, d in enumerate(shape) if not axes or i in {a % rank for a in axes}]
    count = max(math.prod(reduced), 1)
    finite = np.abs(x.ref[np.isfinite(x.ref)]) if dtype.kind == "f" else np.zeros(0)
    biggest = float(finite.max()) if finite.size else 0.0
    slack = 4 * count * biggest * tolerance_dtype(dtype)
    differential(op, args, attrs, opset=opset, exact=op in ("ReduceMax", "ReduceMin"),
                 atol=slack)


@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reduce(op: str) -> None:
    run(_reduce, op)


@SETTINGS
@given(data=st.data())
def _softmax(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([11, 12, 13, OPSET]))
    dtype = draw(st.sampled_from(schema_dtypes(op, opset)))
    shape = draw(shapes(min_dims=1))
    attrs = {}
    if draw(st.booleans()):
        attrs["axis"] = axis_of(draw, len(shape))
    x = tensor(draw, dtype, shape, special=False)
    differential(op, [x], attrs, opset=opset, tol=4)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax(op: str) -> None:
    run(_softmax, op)



# -- coverage --------------------------------------------------------------------------------------
COVERED = {*UNARY, *BINARY, *VARIADIC, "Where", "Clip", "Cast", *REDUCTIONS, "Softmax", "LogSoftmax",
           "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice",
           "Gather", "Expand", "Tile", "Shape", "MatMul", "Gemm", "Conv", "MaxPool", "AveragePool",
           "GlobalAveragePool", "GlobalMaxPool", "BatchNormalization", "LayerNormalization"}


def test_every_kernel_is_covered() -> None:
    """A kernel added to the table without a property here fails this, until it gets one."""
    from backplane.backends.torch.kernels import numeric, quantization  # test_kernels_<name>.py
    from backplane.backends.torch.kernels import indexing, network, recurrent  # test_kernels_<name>
    from backplane.backends.torch.kernels import attention, ml, vision  # test_kernels_vision.py
    from backplane.backends.torch.kernels import contrib_quant  # test_contrib_quant.py
    from backplane.backends.torch.kernels import contrib_transformer  # test_contrib_transformer
    from backplane.backends.torch.kernels import contrib_attention  # test_contrib_transformer

    others = {*numeric.KERNELS, *quantization.KERNELS, *indexing.KERNELS, *recurrent.KERNELS,
              *network.KERNELS,
              *vision.KERNELS, *attention.KERNELS, *ml.KERNELS, *contrib_quant.KERNELS,
              *contrib_transformer.KERNELS, *contrib_attention.KERNELS}
    assert sorted(set(KERNELS) - COVERED - others) == []
