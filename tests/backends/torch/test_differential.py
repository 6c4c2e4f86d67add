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

The explicit regression tests for what these found are in ``test_differential_regressions.py``.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
import onnx  # noqa: E402
from hypothesis import HealthCheck, assume, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from backplane.backends.reference.backend import CpuRef  # noqa: E402
from backplane.backends.torch.backend import CpuAcc, GpuAcc  # noqa: E402
from backplane.backends.torch.kernels import KERNELS  # noqa: E402
from backplane.ir.graph import UNKNOWN, Layer, TensorInfo  # noqa: E402

pytestmark = pytest.mark.slow  # hypothesis, 40 examples a case: `python -m pytest -m slow`
CI_EXAMPLES = 40
EXAMPLES = int(os.environ.get("BACKPLANE_HYPOTHESIS_EXAMPLES", "0") or 0)
SETTINGS = settings(
    max_examples=EXAMPLES or CI_EXAMPLES,
    derandomize=not EXAMPLES,  # CI: the same cases every run; a long run: fresh ones
    deadline=None,
    database=None,  # nothing written into the working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
    print_blob=True,
)

OPSET = 21
BACKEND = os.environ.get("BACKPLANE_DIFFERENTIAL_BACKEND", "CpuAcc")
"""The torch backend under test: CpuAcc, or GpuAcc (same kernels, CUDA tensors) on a CUDA machine."""
ACC, REF = (GpuAcc() if BACKEND == "GpuAcc" else CpuAcc()), CpuRef()
if ACC.missing:
    pytest.skip(f"{BACKEND}: {ACC.missing}", allow_module_level=True)
DEVICE = ACC.device() if isinstance(ACC, GpuAcc) else torch.device("cpu")
FACTORY = ACC.tensor_handle_factories()[0]

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BOOL = np.dtype(np.bool_)
I8, I16, I32, I64, U8 = (np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8))
TORCH_TYPES = {"tensor(float16)": F16, "tensor(float)": F32, "tensor(double)": F64,
               "tensor(int8)": I8, "tensor(int16)": I16, "tensor(int32)": I32, "tensor(int64)": I64,
               "tensor(uint8)": U8, "tensor(bool)": BOOL}
TOLERANCE = {F16: (4e-3, 1e-3), F32: (2e-5, 1e-6), F64: (1e-10, 1e-12)}  # rtol, atol
EPS = {F16: 2.0**-10, F32: 2.0**-23, F64: 2.0**-52}

LAYOUTS = ("contiguous", "permuted", "strided", "offset", "channels_last", "broadcast")
"""How CpuAcc gets an input: a contiguous tensor, the transpose of one, every other element of
one, one at a storage offset, channels-last (4-D, 5-D), or a stride-0 expansion of one slice."""

OUTCOMES: dict[str, Counter[str]] = {}
"""op -> how its generated cases went ("claimed", "CpuAcc refuses: ...", "skipped, CpuRef raises
...")."""


def note(op: str, outcome: str) -> None:
    OUTCOMES.setdefault(op, Counter())[outcome] += 1
    event(outcome)


# -- the harness -----------------------------------------------------------------------------------
class Arg:
    """One input: the array CpuRef gets and the value CpuAcc gets (a torch tensor in some layout,
    or a NumPy array for a host-side shape input)."""

    def __init__(self, ref: np.ndarray, acc: Any) -> None:
        self.ref, self.acc = ref, acc


def place(array: np.ndarray, layout: str = "contiguous") -> Arg:
    """``array`` for both backends, CpuAcc's as a tensor in ``layout`` (the same values; "broadcast"
    repeats the first slice along an axis, for both)."""
    array = np.array(array)  # a copy of our own, C-contiguous
    shape = array.shape
    base = torch.from_numpy(array.copy()).to(DEVICE)
    if layout == "numpy":
        return Arg(array, array.copy())
    if array.ndim == 0 or layout == "contiguous":
        return Arg(array, base)
    if layout == "broadcast":
        axes = [i for i, d in enumerate(shape) if d > 1]
        if not axes:
            return Arg(array, base)
        first = np.take(array, [0], axis=axes[0])
        ref = np.ascontiguousarray(np.broadcast_to(first, shape))
        return Arg(ref, torch.from_numpy(first.copy()).to(DEVICE).expand(shape))
    if layout == "channels_last" and array.ndim in (4, 5):
        fmt = torch.channels_last if array.ndim == 4 else torch.channels_last_3d
        return Arg(array, base.contiguous(memory_format=fmt))
    if layout == "strided":
        wide = torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=base.dtype, device=DEVICE)
        wide[..., ::2] = base
        return Arg(array, wide[..., ::2])
    if layout == "offset":
        flat = torch.zeros(array.size + 3, dtype=base.dtype, device=DEVICE)
        flat[3:] = base.reshape(-1)
        return Arg(array, flat[3:].view(shape))
    reverse = list(reversed(range(array.ndim)))  # "permuted", and channels_last of another rank
    return Arg(array, base.permute(reverse).contiguous().permute(reverse))


def _host(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.array(value, copy=True)


def differential(op: str, args: Sequence[Arg | None], attrs: dict[str, Any] | None = None, *,
                 opset: int = OPSET, n_outputs: int = 1, exact: bool = False, tol: float = 1.0,
                 atol: float = 0.0, precision: np.dtype | None = None) -> bool:
    """Run one case on CpuRef and, if it claims it, on CpuAcc; assert they agree. Returns whether
    CpuAcc claimed it.

    Float outputs agree within ``TOLERANCE`` of their type (or of ``precision``, the narrowest type
    of a computation on mixed types) times ``tol``, or within ``atol``."""
    layer = Layer(op.lower(), op, [f"x{i}" if a is not None else "" for i, a in enumerate(args)],
                  [f"y{j}" for j in range(n_outputs)], dict(attrs or {}), "", opset)
    in_infos = [UNKNOWN if a is None else TensorInfo(tuple(a.ref.shape), a.ref.dtype) for a in args]
    reference_support = REF.is_layer_supported(layer, in_infos, [UNKNOWN] * n_outputs)
    if not reference_support:
        note(op, f"skipped, CpuRef refuses: {reference_support.reason}")
    assume(reference_support.ok)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # overflow, invalid values: intended
            workload = REF.create_workload_factory().create_workload(layer, in_infos,
                                                                     [UNKNOWN] * n_outputs)
            expected = [np.asarray(r) for r in workload(*[None if a is None else a.ref.copy()
                                                          for a in args])[:n_outputs]]
    except Exception as exc:  # not valid ONNX (CpuRef is the spec)
        message = re.sub(r"\d+", "N", str(exc))[:70]
        note(op, f"skipped, CpuRef raises {type(exc).__name__}: {message}")
        assume(False)
    out_infos = [TensorInfo(tuple(e.shape), e.dtype) for e in expected]
    support = ACC.is_layer_supported(layer, in_infos, out_infos)
    if not support:
        assert support.reason, "a refusal must give a reason"
        note(op, f"CpuAcc refuses: {support.reason}")
        return False
    note(op, "claimed")
    before = [None if a is None else _host(a.acc) for a in args]
    workload = ACC.create_workload_factory().create_workload(layer, in_infos, out_infos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        results = workload(*[None if a is None else a.acc for a in args])
    assert isinstance(results, tuple), f"{op} returned a {type(results).__name__}"
    assert len(results) >= n_outputs, f"{op}: {len(results)} outputs, the layer has {n_outputs}"
    for index, want in enumerate(expected):
        result = results[index]
        assert isinstance(result, torch.Tensor), f"output {index} is a {type(result).__name__}"
        assert result.device == DEVICE, f"output {index} is on {result.device}, not {DEVICE}"
        got = FACTORY.copy_out(result)
        assert_matches(f"{op} output {index}", got, want, exact, tol, atol, precision)
    for index, (arg, was) in enumerate(zip(args, before)):
        if arg is not None:
            np.testing.assert_array_equal(_host(arg.acc), was, err_msg=f"{op} wrote to input {index}")
    return True


def assert_matches(name: str, got: np.ndarray, want: np.ndarray, exact: bool, tol: float = 1.0,
                   atol: float = 0.0, precision: np.dtype | None = None) -> None:
    assert got.shape == want.shape, f"{name}: shape {got.shape} != CpuRef's {want.shape}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != CpuRef's {want.dtype}"
    if exact or want.dtype not in TOLERANCE:
        np.testing.assert_array_equal(got, want, err_msg=name)
        return
    rtol, base_atol = TOLERANCE[want.dtype if precision is None else precision]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol * tol,
                               atol=max(base_atol * tol, atol), equal_nan=True, err_msg=name)


def run(test: Callable[..., None], op: str, *args: Any) -> None:
    """Run a property for ``op`` and check that CpuAcc claimed some of its cases."""
    OUTCOMES.pop(op, None)
    test(op, *args)
    outcomes = OUTCOMES.get(op, Counter())
    if EXAMPLES:  # the long run's record (shown with pytest -s)
        print(f"\n{op}: {sum(outcomes.values())} cases generated")
        for outcome, count in outcomes.most_common():
            print(f"    {count:6d}  {outcome[:150]}")
    assert outcomes["claimed"], f"CpuAcc claimed none of the generated {op} cases: {outcomes}"


# -- strategies ------------------------------------------------------------------------------------
def schema_dtypes(op: str, opset: int = OPSET, index: int = 0) -> list[np.dtype]:
    """The element types of input ``index`` that the op's schema allows and torch has."""
    schema = onnx.defs.get_schema(op, opset)
    return _allowed(schema, schema.inputs[min(index, len(schema.inputs) - 1)].type_str)


def _allowed(schema: Any, type_str: str) -> list[np.dtype]:
    allowed = {type_str}
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            allowed = set(constraint.allowed_type_strs)
    return [dtype for name, dtype in TORCH_TYPES.items() if name in allowed]


def input_dtypes(draw: Any, op: str, opset: int = OPSET) -> list[np.dtype]:
    """An element type per input of the op, one drawn per type parameter of its schema (inputs
    that share a parameter share the type)."""
    schema = onnx.defs.get_schema(op, opset)
    chosen: dict[str, np.dtype] = {}
    for formal in schema.inputs:
        if formal.type_str not in chosen:
            chosen[formal.type_str] = draw(st.sampled_from(_allowed(schema, formal.type_str)))
    return [chosen[formal.type_str] for formal in schema.inputs]


SPECIAL_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, math.inf, -math.inf, math.nan, 1e4, -1e4)


def elements(dtype: np.dtype, low: float = -10, high: float = 10, special: bool = True,
             integers: tuple[int, int] | None = None, large: bool = True) -> st.SearchStrategy[Any]:
    """Values of ``dtype``: integers over the type's range (or ``integers``), floats in [low, high]
    and, if ``special``, zeros, infinities, NaN and (if ``large``) +-1e4."""
    if dtype == BOOL:
        return st.booleans()
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = integers if integers is not None else (info.min, info.max)
        return st.integers(max(lo, int(info.min)), min(hi, int(info.max)))
    limit = float(np.finfo(dtype).max)
    low, high = (float(dtype.type(np.clip(v, -limit, limit))) for v in (low, high))
    finite = st.floats(low, high, width=dtype.itemsize * 8)
    if not special:
        return finite
    return st.one_of(finite, finite, finite, st.sampled_from(
        [v for v in SPECIAL_FLOATS if not math.isfinite(v) or abs(v) <= (limit if large else high)]))


def array(draw: Any, dtype: np.dtype, shape: Sequence[int], **kwargs: Any) -> np.ndarray:
    return draw(hnp.arrays(dtype, tuple(shape), elements=elements(dtype, **kwargs)))


def tensor(draw: Any, dtype: np.dtype, shape: Sequence[int], layouts: Sequence[str] = LAYOUTS,
           **kwargs: Any) -> Arg:
    """An input of ``dtype`` and ``shape``, CpuAcc's in a layout drawn from ``layouts``."""
    return place(array(draw, dtype, shape, **kwargs), draw(st.sampled_from(layouts)))


def ints_input(draw: Any, values: Sequence[int], dtype: np.dtype = I64) -> Arg:
    """A shape-like input (a shape, axes, starts): a torch tensor or a host NumPy array."""
    return place(np.array(list(values), dtype=dtype).reshape(len(values)),
                 draw(st.sampled_from(("contiguous", "numpy"))))


def shapes(min_dims: int = 0, max_dims: int = 4, min_side: int = 0, max_side: int = 4) \
        -> st.SearchStrategy[tuple[int, ...]]:
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side,
                            max_side=max_side)


def axis_of(draw: Any, rank: int, extra: int = 0) -> int:
    """An axis of a rank-``rank`` tensor, negative or not ([-rank, rank - 1 + extra])."""
    return draw(st.integers(-rank, rank - 1 + extra))


def tolerance_dtype(dtype: np.dtype) -> float:
    return EPS.get(dtype, 0.0)


# -- elementwise: unary ----------------------------------------------------------------------------
UNARY = ("Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log", "Floor", "Ceil", "Round", "Sign", "Erf",
         "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Tanh", "Asinh", "Acosh",
         "Atanh", "Not", "Relu", "Sigmoid", "HardSwish", "Softplus", "Softsign", "Mish", "Identity",
         "LeakyRelu", "Elu", "Selu", "HardSigmoid", "ThresholdedRelu", "Gelu")
SELECTIONS = frozenset({"Neg", "Abs", "Floor", "Ceil", "Round", "Sign", "Not", "Relu", "Identity",
                        "ThresholdedRelu"})
"""Ops that select or round: no arithmetic to differ in, so exact."""


def float32s(low: float, high: float) -> st.SearchStrategy[float]:
    """Float attributes, as ONNX holds them (float32) and the frontend gives them (Python floats).

    None below 1e-3 but 0: CpuRef rounds an attribute to a float16 input's type (NumPy's rule for
    Python scalars), where 1e-24 is 0 and -inf * alpha NaN; torch computes with the float32 value.
    That is the attribute's precision, not the op's semantics."""
    return st.floats(low, high).map(lambda v: 0.0 if abs(v) < 1e-3 else float(np.float32(v)))


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


# -- shape ops -------------------------------------------------------------------------------------
def any_dtype(draw: Any, op: str, opset: int = OPSET) -> np.dtype:
    return draw(st.sampled_from(schema_dtypes(op, opset)))


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
AUTO_PAD = ("NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _spatial(draw: Any, kernel: Sequence[int], attrs: dict[str, Any]) -> list[int]:
    """Spatial sizes, mostly large enough that the padded input covers the window (CpuRef raises
    otherwise, a wasted case), sometimes anything (CpuAcc refuses what torch would raise on)."""
    rank = len(kernel)
    dilations = attrs.get("dilations", [1] * rank)
    pads = attrs.get("pads", [0] * 2 * rank)
    sizes = []
    for i, (k, d) in enumerate(zip(kernel, dilations)):
        least = 1 if attrs.get("auto_pad", "NOTSET").startswith("SAME") else \
            max(1, (k - 1) * d + 1 - pads[i] - pads[i + rank])
        sizes.append(draw(st.integers(least, least + 3) if draw(st.integers(0, 5))
                          else st.integers(1, 6)))
    return sizes


def _window_attrs(draw: Any, rank: int, dilations: bool = True, max_kernel: int = 3) \
        -> tuple[list[int], dict[str, Any]]:
    kernel = [draw(st.integers(1, max_kernel)) for _ in range(rank)]
    attrs: dict[str, Any] = {}
    if draw(st.booleans()):
        attrs["strides"] = [draw(st.integers(1, 3)) for _ in range(rank)]
    if dilations and draw(st.booleans()):
        attrs["dilations"] = [draw(st.integers(1, 2)) for _ in range(rank)]
    auto_pad = draw(st.sampled_from(AUTO_PAD))
    if auto_pad != "NOTSET":
        attrs["auto_pad"] = auto_pad
    elif draw(st.booleans()):  # mostly narrower than the window (ONNX Runtime's rule for pools)
        extents = [(k - 1) * d + 1 for k, d in zip(kernel, attrs.get("dilations", [1] * rank))]
        widest = st.sampled_from([0, 1, 2])
        attrs["pads"] = [draw(st.integers(0, e - 1) if draw(st.integers(0, 5)) else widest)
                         for e in extents * 2]
    return kernel, attrs


@SETTINGS
@given(data=st.data())
def _conv(op: str, data: Any) -> None:
    draw = data.draw
    dtype = any_dtype(draw, op)
    rank = draw(st.sampled_from([1, 2, 2, 3]))
    kernel, attrs = _window_attrs(draw, rank)
    group = draw(st.integers(1, 3))
    c_in, c_out = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    if group > 1:
        attrs["group"] = group
    if draw(st.booleans()):
        attrs["kernel_shape"] = kernel
    spatial = _spatial(draw, kernel, attrs)
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
    kernel, attrs = _window_attrs(draw, rank, dilations=opset >= (10 if op == "MaxPool" else 19))
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
    spatial = _spatial(draw, kernel, attrs)
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


# -- coverage --------------------------------------------------------------------------------------
COVERED = {*UNARY, *BINARY, *VARIADIC, "Where", "Clip", "Cast", *REDUCTIONS, "Softmax", "LogSoftmax",
           "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice",
           "Gather", "Expand", "Tile", "Shape", "MatMul", "Gemm", "Conv", "MaxPool", "AveragePool",
           "GlobalAveragePool", "GlobalMaxPool", "BatchNormalization", "LayerNormalization"}


def test_every_kernel_is_covered() -> None:
    """A kernel added to the table without a property here fails this, until it gets one."""
    from backplane.backends.torch.kernels import numeric  # test_kernels_numeric.py covers these
    from backplane.backends.torch.kernels import indexing, network, recurrent  # test_kernels_<name>
    from backplane.backends.torch.kernels import attention, ml, vision  # test_kernels_vision.py
    from backplane.backends.torch.kernels import contrib_quant  # test_contrib_quant.py
    from backplane.backends.torch.kernels import contrib_transformer  # test_contrib_transformer
    from backplane.backends.torch.kernels import contrib_attention  # test_contrib_transformer

    others = {*numeric.KERNELS, *indexing.KERNELS, *recurrent.KERNELS, *network.KERNELS,
              *vision.KERNELS, *attention.KERNELS, *ml.KERNELS, *contrib_quant.KERNELS,
              *contrib_transformer.KERNELS, *contrib_attention.KERNELS}
    assert sorted(set(KERNELS) - COVERED - others) == []
