"""The harness and strategies of the differential tests (test_differential*.py, test_kernels_*.py):
each generated case run on the torch kernel table's backend (CpuAcc, or GpuAcc where
``BACKPLANE_DIFFERENTIAL_BACKEND`` says) and on CpuRef, and the rule it is held to
(test_differential.py's docstring says it).
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
from hypothesis import HealthCheck, assume, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from backplane.backends.reference.backend import CpuRef  # noqa: E402
from backplane.backends.torch.backend import CpuAcc, GpuAcc  # noqa: E402
from backplane.ir.graph import UNKNOWN, Layer, TensorInfo  # noqa: E402

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



def float32s(low: float, high: float) -> st.SearchStrategy[float]:
    """Float attributes, as ONNX holds them (float32) and the frontend gives them (Python floats).

    None below 1e-3 but 0: CpuRef rounds an attribute to a float16 input's type (NumPy's rule for
    Python scalars), where 1e-24 is 0 and -inf * alpha NaN; torch computes with the float32 value.
    That is the attribute's precision, not the op's semantics."""
    return st.floats(low, high).map(lambda v: 0.0 if abs(v) < 1e-3 else float(np.float32(v)))


def any_dtype(draw: Any, op: str, opset: int = OPSET) -> np.dtype:
    return draw(st.sampled_from(schema_dtypes(op, opset)))



AUTO_PAD = ("NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def spatial_sizes(draw: Any, kernel: Sequence[int], attrs: dict[str, Any]) -> list[int]:
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


def window_attrs(draw: Any, rank: int, dilations: bool = True, max_kernel: int = 3) \
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
