"""NaN and Inf through the patterns CpuAcc fuses, as through CpuRef (test_nan_propagation.py's
second part, kept apart for its length): Conv with its activations, batch norm and residual, Gemm /
MatMul with theirs, squeeze-and-excitation, pools after convolutions, under each of CpuAcc's routes
and compile modes (and GpuAcc's where CUDA is), since fused kernels (oneDNN's post-ops, oneDNN
Graph's partitions, cuDNN's epilogue) are where NaN went missing.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from tests.backends.torch.test_nan_propagation import CONFIGS, backends, compare  # noqa: E402

# -- (a') the fused patterns ----------------------------------------------------------------------
RNG = np.random.default_rng(32)
C, HW = 8, 10


def _const(name: str, value: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _model(nodes: list[Any], inits: list[TensorProto], shape: tuple[int, ...],
           out_shape: tuple[int, ...] | None = None, opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "pattern", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)


def _conv(name: str, x: str, y: str, c_in: int, c_out: int, k: int = 3, group: int = 1,
          stride: int = 1) -> tuple[Any, list[TensorProto]]:
    w = RNG.standard_normal((c_out, c_in // group, k, k)) / k
    b = RNG.standard_normal(c_out)
    node = helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [y], kernel_shape=[k, k],
                            pads=[k // 2] * 4, group=group, strides=[stride, stride])
    return node, [_const(f"{name}_w", w), _const(f"{name}_b", b)]


def _activation(kind: str, x: str, y: str) -> tuple[list[Any], list[TensorProto]]:
    """The activation ``kind`` from ``x`` to ``y``, as exporters write it."""
    simple = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "hardswish": "HardSwish",
              "leaky_relu": "LeakyRelu", "elu": "Elu"}
    if kind in simple:
        return [helper.make_node(simple[kind], [x], [y])], []
    if kind == "relu6":
        return [helper.make_node("Clip", [x, "lo", "hi"], [y])], [_const("lo", 0.0),
                                                                   _const("hi", 6.0)]
    if kind == "clip_min":
        return [helper.make_node("Clip", [x, "lo"], [y])], [_const("lo", 0.0)]
    if kind == "hardsigmoid":  # torch's spelling (alpha 1/6), the one CpuAcc fuses
        return [helper.make_node("HardSigmoid", [x], [y], alpha=1 / 6, beta=0.5)], []
    if kind == "hardsigmoid_onnx":
        return [helper.make_node("HardSigmoid", [x], [y])], []
    if kind == "swish":
        return [helper.make_node("Sigmoid", [x], [f"{y}_s"]),
                helper.make_node("Mul", [x, f"{y}_s"], [y])], []
    if kind == "gelu":
        return [helper.make_node("Gelu", [x], [y])], []
    if kind == "gelu_erf":  # x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write it
        return [helper.make_node("Div", [x, "sqrt2"], [f"{y}_d"]),
                helper.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
                helper.make_node("Add", [f"{y}_e", "one"], [f"{y}_a"]),
                helper.make_node("Mul", [x, f"{y}_a"], [f"{y}_m"]),
                helper.make_node("Mul", [f"{y}_m", "half"], [y])], \
            [_const("sqrt2", np.sqrt(2.0)), _const("one", 1.0), _const("half", 0.5)]
    raise ValueError(f"activation {kind!r} is not one of {ACTIVATIONS}")


ACTIVATIONS = ("relu", "relu6", "clip_min", "hardsigmoid", "hardsigmoid_onnx", "hardswish",
               "sigmoid", "tanh", "leaky_relu", "elu", "swish", "gelu", "gelu_erf")


def conv_activation(kind: str, k: int = 3, group: int = 1) -> onnx.ModelProto:
    conv, inits = _conv("c", "x", "t", C, C, k, group)
    act, more = _activation(kind, "t", "y")
    return _model([conv, *act], inits + more, (1, C, HW, HW))


def conv_bn_residual(kind: str) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Add(x) -> activation (a residual block's end)."""
    conv, inits = _conv("c", "x", "t", C, C)
    bn = helper.make_node("BatchNormalization", ["t", "s", "sh", "m", "v"], ["n"])
    inits += [_const("s", RNG.uniform(0.5, 2, C)), _const("sh", RNG.standard_normal(C)),
              _const("m", RNG.standard_normal(C)), _const("v", RNG.uniform(0.5, 2, C))]
    add = helper.make_node("Add", ["n", "x"], ["r"])
    act, more = _activation(kind, "r", "y")
    return _model([conv, bn, add, *act], inits + more, (1, C, HW, HW))


def conv_pool(pool: str) -> onnx.ModelProto:
    """Conv -> Relu -> a pool (MaxPool 3x3/2, AveragePool, GlobalMaxPool, GlobalAveragePool)."""
    conv, inits = _conv("c", "x", "t", C, C)
    relu = helper.make_node("Relu", ["t"], ["r"])
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]} \
        if pool in ("MaxPool", "AveragePool") else {}
    return _model([conv, relu, helper.make_node(pool, ["r"], ["y"], **attrs)], inits,
                  (1, C, HW, HW))


def squeeze_excite(gate: str) -> onnx.ModelProto:
    """x * gate(W2 relu(W1 mean(x))): GlobalAveragePool, 1x1 Conv, Relu, 1x1 Conv, gate, Mul."""
    conv0, inits = _conv("c0", "x", "a", C, C)
    pool = helper.make_node("GlobalAveragePool", ["a"], ["p"])
    conv1, more1 = _conv("c1", "p", "q", C, C // 2, k=1)
    relu = helper.make_node("Relu", ["q"], ["r"])
    conv2, more2 = _conv("c2", "r", "s", C // 2, C, k=1)
    act, more3 = _activation(gate, "s", "g")
    mul = helper.make_node("Mul", ["a", "g"], ["y"])
    return _model([conv0, pool, conv1, relu, conv2, *act, mul], inits + more1 + more2 + more3,
                  (1, C, HW, HW))


def linear(kind: str, gemm: bool) -> onnx.ModelProto:
    """(Gemm | MatMul + Add) -> activation on a (4, 16) input, then a residual Add."""
    w = RNG.standard_normal((16, 16)) / 4
    inits = [_const("w", w), _const("b", RNG.standard_normal(16))]
    if gemm:
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["t"])]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["u"]),
                 helper.make_node("Add", ["u", "b"], ["t"])]
    act, more = _activation(kind, "t", "a")
    nodes += act
    nodes += [helper.make_node("MatMul", ["a", "w2"], ["v"]),
              helper.make_node("Add", ["v", "a"], ["y"])]
    return _model(nodes, inits + more + [_const("w2", w.T)], (4, 16))


def conv_then_linear(kind: str) -> onnx.ModelProto:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> activation: a linear inside a
    subgraph that oneDNN Graph compiles."""
    conv, inits = _conv("c", "x", "t", C, C)
    nodes = [conv, helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "w", "b"], ["g"], transB=1)]
    act, more = _activation(kind, "g", "y")
    inits += [_const("w", RNG.standard_normal((C, C))), _const("b", RNG.standard_normal(C))]
    return _model(nodes + act, inits + more, (1, C, HW, HW))


PATTERNS: dict[str, Any] = {
    **{f"conv-{k}": functools.partial(conv_activation, k) for k in ACTIVATIONS},
    **{f"conv1x1-{k}": functools.partial(conv_activation, k, 1) for k in ("relu", "relu6")},
    **{f"depthwise-{k}": functools.partial(conv_activation, k, 3, C) for k in ("relu", "relu6")},
    **{f"residual-{k}": functools.partial(conv_bn_residual, k) for k in ("relu", "relu6")},
    **{f"pool-{p}": functools.partial(conv_pool, p) for p in
       ("MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool")},
    **{f"se-{g}": functools.partial(squeeze_excite, g) for g in ("hardsigmoid", "sigmoid")},
    **{f"gemm-{k}": functools.partial(linear, k, True) for k in ("relu", "relu6", "gelu_erf")},
    **{f"matmul-{k}": functools.partial(linear, k, False) for k in
       ("relu", "hardsigmoid", "gelu_erf", "tanh")},
    **{f"conv-gemm-{k}": functools.partial(conv_then_linear, k) for k in ("relu", "relu6")},
}


def _pattern_input(shape: tuple[int, ...], kind: str) -> np.ndarray:
    """A finite input with, for "nan", NaN at two places (one pixel in all channels, one value
    alone); for "inf", +Inf and -Inf at one value each and in one pixel in all channels
    (convolutions turn the latter to NaN as CpuRef's do: inf - inf)."""
    x = RNG.standard_normal(shape).astype(np.float32)
    flat = x.reshape(shape[0], shape[1], -1) if len(shape) == 4 else x.reshape(1, 1, -1)
    special = (np.nan, np.nan) if kind == "nan" else (np.inf, -np.inf)
    flat[0, :, 3] = special[0]  # a whole pixel (4-D) or a value
    flat[0, -1, -5] = special[1]
    return x


def _pattern_params() -> list[Any]:
    """Every pattern under every configuration, but the gemm route's for 1x1 convolutions only
    (for any other, forcing it measures the other routes, as the default does)."""
    return [pytest.param(backend, options, pattern, kind, id=f"{backend}-{config}-{pattern}-{kind}")
            for backend, config, options in CONFIGS for pattern in sorted(PATTERNS)
            for kind in ("nan", "inf") if config != "layers-gemm" or pattern.startswith("conv1x1")]


@pytest.mark.parametrize("backend,options,pattern,kind", _pattern_params())
def test_fused_pattern(backend: str, options: dict[str, Any], pattern: str, kind: str) -> None:
    spec = backends(backend, options)
    model = PATTERNS[pattern]()
    shape = tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)
    compare(model, {"x": _pattern_input(shape, kind)}, spec)
