"""CpuRef's kernels against the ONNX backend node suite, one single-node case at a time.

Every op CpuRef claims must pass all of its cases; a case CpuRef refuses is a clean "not supported"
(skipped with the reason). Cases go straight through the backend's support check and workload
factory, so no runtime, optimizer or frontend is involved.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest

from backplane.backends.api.backend import kernel_key
from backplane.backends.reference.backend import CpuRef
from backplane.backends.reference.kernels import indexing, shape
from backplane.frontends.onnx_types import attribute_value, tensor_to_array
from backplane.ir.graph import Layer, TensorInfo

DEFAULT_DOMAINS = ("", "ai.onnx")


@functools.lru_cache(maxsize=1)
def node_cases() -> dict[str, Any]:
    """The node suite's single-node cases, in the default domain, whose op CpuRef has a kernel for."""
    from onnx.backend.test.loader import load_node_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow on purpose
        cases = load_node_model_tests()
    return {case.name: case for case in cases if _is_candidate(case.model)}


def _is_candidate(model: onnx.ModelProto) -> bool:
    nodes = model.graph.node
    if len(nodes) != 1:
        return False
    graph_attrs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(attr.type in graph_attrs for attr in nodes[0].attribute):
        return False
    return kernel_key(_layer(model)) in CpuRef.KERNELS


def _opset(model: onnx.ModelProto, domain: str) -> int:
    domains = DEFAULT_DOMAINS if domain in DEFAULT_DOMAINS else (domain,)
    return next(o.version for o in model.opset_import if o.domain in domains)


def _no_graph(graph: onnx.GraphProto) -> None:
    raise AssertionError("single-node cases with graph attributes are filtered out")


def _value(value: Any) -> Any:
    """A case's value as the runtime holds it: TensorProtos (bfloat16, float8, ...) as arrays."""
    return tensor_to_array(value) if isinstance(value, onnx.TensorProto) else value


def _info(value: Any) -> TensorInfo:
    if isinstance(value, np.ndarray):
        return TensorInfo(tuple(value.shape), value.dtype)
    return TensorInfo(None, None)  # a sequence, an optional, or absent


def _layer(model: onnx.ModelProto) -> Layer:
    node = model.graph.node[0]
    attrs = {attr.name: attribute_value(attr, import_graph=_no_graph) for attr in node.attribute}
    return Layer(node.name or node.op_type, node.op_type, list(node.input), list(node.output),
                 attrs, node.domain, _opset(model, node.domain))


def _assert_same(name: str, actual: Any, expected: Any, rtol: float, atol: float) -> None:
    """The comparison of onnx's backend test runner: shape, dtype, then values (strings exactly)."""
    if isinstance(expected, (list, tuple)):  # a sequence (or an optional holding one)
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"output {name}"
        for i, (act, exp) in enumerate(zip(actual, expected)):
            _assert_same(f"{name}[{i}]", _value(act), _value(exp), rtol, atol)
        return
    if expected is None:  # an empty optional
        assert actual is None, f"output {name}: {actual!r} is not an empty optional"
        return
    assert isinstance(actual, np.ndarray), f"output {name} is a {type(actual).__name__}, not an array"
    assert actual.shape == expected.shape, f"output {name}: shape {actual.shape} != {expected.shape}"
    if expected.dtype == object:
        np.testing.assert_array_equal(actual, expected, err_msg=f"output {name}")
        return
    assert actual.dtype == expected.dtype, f"output {name}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=f"output {name}")


@pytest.mark.parametrize("case_name", sorted(node_cases()))
def test_node_case(case_name: str) -> None:
    case = node_cases()[case_name]
    layer = _layer(case.model)
    graph_inputs = [i.name for i in case.model.graph.input]
    graph_outputs = [o.name for o in case.model.graph.output]
    backend = CpuRef()
    for inputs, expected in case.data_sets:
        by_name = dict(zip(graph_inputs, map(_value, inputs)))
        args = [by_name[name] if name else None for name in layer.inputs]
        expected_by_name = dict(zip(graph_outputs, map(_value, expected)))
        in_infos = [_info(a) for a in args]
        out_infos = [_info(expected_by_name.get(name)) for name in layer.outputs]
        support = backend.is_layer_supported(layer, in_infos, out_infos)
        if not support:
            assert isinstance(support.reason, str) and support.reason, "a refusal must give a reason"
            pytest.skip(f"not supported: {support.reason}")
        workload = backend.create_workload_factory().create_workload(layer, in_infos, out_infos)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NaN and inf cases are intended
            results = workload(*args)
        assert isinstance(results, tuple), f"{layer.op_type} returned a {type(results).__name__}"
        assert len(results) == len(layer.outputs), f"{len(results)} outputs for {layer.outputs}"
        for name, actual in zip(layer.outputs, results):
            if name in expected_by_name:
                _assert_same(name, actual, expected_by_name[name], case.rtol, case.atol)


# -- element types beyond NumPy's ------------------------------------------------------------------
MOVEMENT_OPS = (shape.ANY_DTYPE | indexing.ANY_DTYPE) - {"Range"}
ML_DTYPES = [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
             np.dtype(ml_dtypes.float8_e5m2)]


def _movement_cases() -> list[str]:
    return [name for name, case in node_cases().items()
            if _layer(case.model).op_type in MOVEMENT_OPS
            and any(getattr(_value(x), "dtype", None) == np.float32 for x in case.data_sets[0][0])]


@pytest.mark.parametrize("case_name", sorted(_movement_cases()))
def test_data_movement_is_the_same_in_every_element_type(case_name: str) -> None:
    """Layout and selection ops CpuRef claims for ml_dtypes' types move values without touching
    them: in bfloat16 or float8 they give the float32 result, element for element."""
    case = node_cases()[case_name]
    layer = _layer(case.model)
    graph_inputs = [i.name for i in case.model.graph.input]
    kernel = CpuRef().create_workload_factory().create_workload(layer, [], [])
    by_name = dict(zip(graph_inputs, map(_value, case.data_sets[0][0])))
    for dtype in ML_DTYPES:
        narrow = {n: v.astype(dtype) if getattr(v, "dtype", None) == np.float32 else v
                  for n, v in by_name.items()}
        wide = {n: v.astype(np.float32) if getattr(v, "dtype", None) == dtype else v
                for n, v in narrow.items()}  # the same values, exactly, in float32
        actual = kernel(*[narrow[n] if n else None for n in layer.inputs])
        expected = kernel(*[wide[n] if n else None for n in layer.inputs])
        for act, exp in zip(actual, expected):
            if exp.dtype == np.float32:
                assert act.dtype == dtype, f"{dtype}: {act.dtype}"
                act = act.astype(np.float32)
            np.testing.assert_array_equal(act, exp, err_msg=f"{layer.op_type} in {dtype}")


# -- recurrent layers whose attributes contradict their weights (issue 32, bench/hostile.py) -------
def _recurrent_model(op: str, gates: int, hidden: int, weights_hidden: int, feature: int = 3,
                     direction: str = "forward"):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((1, gates * weights_hidden, 3)).astype(np.float32)
    r = rng.standard_normal((1, gates * weights_hidden, weights_hidden)).astype(np.float32)
    node = helper.make_node(op, ["x", "w", "r"], ["y"], hidden_size=hidden, direction=direction)
    graph = helper.make_graph(
        [node], "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, feature])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(r, "r")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("op, gates, hidden, weights_hidden, feature, direction, reason", [
    ("LSTM", 4, 8, 4, 3, "forward", "hidden_size 8 but R [1, 16, 4] is of hidden size 4"),
    ("GRU", 3, 8, 4, 3, "forward", "hidden_size 8 but R [1, 12, 4] is of hidden size 4"),
    ("RNN", 1, 2, 4, 3, "forward", "hidden_size 2 but R [1, 4, 4] is of hidden size 4"),
    ("LSTM", 4, 4, 4, 5, "forward", "X [2, 1, 5] has 5 features where W [1, 16, 3] takes 3"),
    ("GRU", 3, 4, 4, 3, "bidirectional", "holds 1 directions where direction 'bidirectional'"),
])
def test_recurrent_weights_that_contradict_the_layer_are_refused_at_load(
        op, gates, hidden, weights_hidden, feature, direction, reason) -> None:
    """ONNX Runtime refuses these; OpenVINO crashed on them, CpuRef and CpuAcc read past or short
    of the weights (or failed at the run with a matmul's message)."""
    from backplane import InferenceSession
    from backplane.optimizer.optimize import OptimizationError

    model = _recurrent_model(op, gates, hidden, weights_hidden, feature, direction)
    with pytest.raises(OptimizationError, match=re.escape(reason)):
        InferenceSession(model, backends=["CpuRef"])


def _one_node(op: str, inputs: dict, attrs: dict | None = None, outputs: int = 1) -> bytes:
    from onnx import helper, numpy_helper

    node = helper.make_node(op, list(inputs), [f"y{i}" for i in range(outputs)], **(attrs or {}))
    graph = helper.make_graph(
        [node], op, [], [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None)
                         for i in range(outputs)],
        [numpy_helper.from_array(value, name) for name, value in inputs.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("backends", [["CpuRef"], ["CpuAcc", "CpuRef"]], ids=",".join)
@pytest.mark.parametrize("op, inputs, outputs, message", [
    ("Split", {"x": np.ones(4, np.float32), "s": np.array([6, -2], np.int64)}, 2, "non-negative|>= 0"),
    ("Pad", {"x": np.ones((2, 3), np.float32), "p": np.array([-5, 0, 0, 0], np.int64)}, 1,
     "a negative pad removes at most what the axis has"),
    ("Dropout", {"x": np.ones(3, np.float32), "r": np.array(1.5, np.float32),
                 "t": np.array(True)}, 1, r"ratio 1.5 is not in \[0, 1\)"),
])
def test_what_onnx_runtime_refuses_is_refused(backends, op, inputs, outputs, message) -> None:
    """bench/hostile.py found CpuRef answering these (outputs of 6 and -2 elements, a Pad past its
    axis, a Dropout ratio of 1.5) where ONNX Runtime refuses."""
    if backends[0] == "CpuAcc":
        pytest.importorskip("torch")
    from backplane import ExecutionError, InferenceSession, ModelError, OptimizationError

    with pytest.raises((ExecutionError, OptimizationError, ModelError), match=message):
        session = InferenceSession(_one_node(op, inputs, outputs=outputs), backends=backends)
        session.run(None, {})


@pytest.mark.parametrize("index", [-4, 3, -1, 2])
def test_gather_counts_negative_indices_from_the_end_and_refuses_one_out_of_range(index) -> None:
    """ONNX's Gather takes indices in [-size, size): -1 is the last; -4 of 3 is out of range (a
    wrap before np.take made it -1 again, the last row, with no error)."""
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    if not -3 <= index < 3:
        with pytest.raises(IndexError):
            indexing.gather(data, np.array(index, np.int64))
        return
    np.testing.assert_array_equal(indexing.gather(data, np.array([index], np.int64))[0],
                                  data[[index % 3]])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
def test_reduce_mean_is_numpys_mean_to_the_bit(dtype) -> None:
    """ReduceMean sums in the input's type and divides by the count, as np.mean with that dtype
    does (integers truncated, NaN and infinities through, an empty reduction NaN)."""
    from backplane.backends.reference.kernels import reduce

    rng = np.random.default_rng(1)
    for shape, axes in [((2, 16), (0, 1)), ((3, 5, 7), (1,)), ((4, 6), (0,)), ((5, 0), (1,)),
                        ((), ())]:
        x = (rng.standard_normal(shape) * 50).astype(dtype)
        if x.size and x.dtype.kind == "f":
            x.reshape(-1)[0], x.reshape(-1)[-1] = np.nan, np.inf
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the empty mean's
            want = np.mean(x, axis=axes, keepdims=True, dtype=x.dtype)
            got = reduce._mean(x, axes)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.bool_])
def test_reduce_max_and_min_are_the_ufuncs_reductions(dtype) -> None:
    """ReduceMax / ReduceMin reduce with np.maximum / np.minimum where there are values (no
    ``initial``: np.max's wrapper), np.max's identity where there are none: NaN through, the
    result's type the input's, the axes kept or squeezed as asked."""
    from backplane.backends.reference.kernels import reduce

    rng = np.random.default_rng(2)
    for shape, axes in [((2, 16), None), ((1, 16), (1,)), ((3, 5, 7), (0, 2)), ((5, 0), (1,)),
                        ((), None)]:
        x = (rng.standard_normal(shape) * 50).astype(dtype)
        if x.size and x.dtype.kind == "f":
            x.reshape(-1)[min(1, x.size - 1)] = np.nan
        for kernel, reference, identity in [(reduce.reduce_max, np.max, reduce._identity_of_max),
                                            (reduce.reduce_min, np.min, reduce._identity_of_min)]:
            for keepdims in (0, 1):
                given = None if axes is None else np.array(axes, np.int64)
                got = kernel(x, given, keepdims=keepdims)[0]
                want = reference(x, axis=axes, keepdims=bool(keepdims), initial=identity(x.dtype))
                assert np.asarray(got).dtype == x.dtype and np.shape(got) == np.shape(want)
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
def test_gemm_scales_and_adds_as_onnx_does(dtype) -> None:
    """Gemm's product scaled by alpha and C by beta, in A's type (floats in place, integers
    through floats as before), NaN through, C broadcast by row, column or scalar."""
    from backplane.backends.reference.kernels import matmul

    rng = np.random.default_rng(3)
    a = (rng.standard_normal((3, 4)) * 4).astype(dtype)
    b = (rng.standard_normal((5, 4)) * 4).astype(dtype)
    if a.dtype.kind == "f":
        a[0, 0] = np.nan
    for c in (None, (rng.standard_normal(5) * 4).astype(dtype),
              (rng.standard_normal((3, 1)) * 4).astype(dtype), np.array(2, dtype)):
        for alpha, beta in [(1.0, 1.0), (0.5, 2.0)]:
            got = matmul.gemm(a, b, c, alpha=alpha, beta=beta, transB=1)[0]
            want = alpha * (a.astype(np.float64) @ b.astype(np.float64).T)
            if c is not None:
                want = want + beta * c.astype(np.float64)
            assert got.dtype == a.dtype and got.shape == (3, 5)
            half = dtype == np.float16
            np.testing.assert_allclose(got, want.astype(dtype), rtol=2e-3 if half else 1e-5,
                                       atol=0.1 if half else 1e-4)
            if a.dtype.kind == "f":
                assert np.isnan(got[0]).all() and not np.isnan(got[1:]).any()


def test_unsqueeze_is_expand_dims_and_constant_of_shape_is_full() -> None:
    """Unsqueeze by one reshape gives np.expand_dims's view (a strided input's too), negative
    axes and any order, and its error for an axis named twice; ConstantOfShape np.full's array."""
    from backplane.backends.reference.kernels import shape

    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    for data, axes in [(np.array(3, np.int64), [0]), (strided, [0, -1]), (strided, [3, 1]),
                       (np.zeros((2, 0, 3), np.float16), [-2]), (strided.T, [1, 0])]:
        got = shape.unsqueeze(data, np.array(axes, np.int64))[0]
        want = np.expand_dims(data, tuple(a % (data.ndim + len(axes)) for a in axes))
        assert got.shape == want.shape and np.shares_memory(got, data) == bool(data.size)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        shape.unsqueeze(strided, np.array([1, -3], np.int64))  # axis 1 of 4, twice
    for dims, value in [([1, 16], None), ([], np.array([2.5], np.float16)),
                        ([0, 3], np.array([7], np.int32)), ([2, 2], np.array([True]))]:
        given = np.array(dims, np.int64)
        got = shape.constant_of_shape(given, value)[0]
        fill = np.zeros(1, np.float32) if value is None else value
        want = np.full(dims, fill[0], dtype=fill.dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
