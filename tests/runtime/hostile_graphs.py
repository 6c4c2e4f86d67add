"""Hand-written hostile graphs: each a small ONNX model and the inputs that make it hostile.

Sizes that are negative, huge or overflow int64 (Expand, Tile, ConstantOfShape, Range, Reshape, Pad,
Resize, OneHot, TopK), indices out of range (Gather, GatherElements, GatherND, ScatterND,
ScatterElements, Compress), a Split past its input, recurrent layers whose hidden_size contradicts
their weights, convolutions whose groups or kernels contradict their input, a Loop that would run
for ever, If branches of different types, casts to odd types, empty tensors, NaN and Inf, integer
overflow and division by zero, deeply nested bodies, duplicate names, outputs that are inputs or
initializers, attributes out of range. None of them has one right answer but CpuRef's or a clean
refusal: the bench (bench/hostile.py) runs each on every backend list and holds them to CpuRef;
tests/runtime/test_hostile_graphs.py runs them on CpuRef and CpuAcc.

``CASES`` maps a name to a function returning (model, feeds); the same on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
I64_MAX, I64_MIN = (1 << 63) - 1, -(1 << 63)
F = TensorProto.FLOAT
Feeds = dict[str, np.ndarray]
Built = tuple[ModelProto | bytes, Feeds]  # bytes: a model onnx.helper cannot build


def model(nodes: Sequence[onnx.NodeProto], feeds: Feeds, inits: dict[str, Any] | None = None,
          outputs: Sequence[tuple[str, int]] = (("y", F),), opset: int = 17,
          inputs: Sequence[onnx.ValueInfoProto] | None = None) -> Built:
    """A graph of ``nodes`` whose inputs are ``feeds`` (their dtypes and shapes as declared)."""
    if inputs is None:
        inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                  for k, v in feeds.items()]
    tensors = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(list(nodes), "hostile", list(inputs),
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs], tensors)
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    built.ir_version = 8
    return built, feeds


def one(op: str, feeds: Feeds, inits: dict[str, Any] | None = None, names: Sequence[str] = (),
        out: int = F, outs: int = 1, opset: int = 17, **attrs: Any) -> Built:
    """One ``op`` node reading ``names`` (default: the feeds, then the initializers, in order)."""
    names = list(names) or [*feeds, *(inits or {})]
    outputs = [(f"y{k}" if outs > 1 else "y", out) for k in range(outs)]
    node = helper.make_node(op, names, [n for n, _ in outputs], name=op.lower(), **attrs)
    return model([node], feeds, inits, outputs, opset)


def x(*shape: int, fill: float | None = None) -> np.ndarray:
    if fill is not None:
        return np.full(shape, fill, np.float32)
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) / 7 - 1


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


# -- sizes: negative, huge, overflowing ------------------------------------------------------------

SIZES: dict[str, Callable[[], Built]] = {
    "expand_negative_const": lambda: one("Expand", {"x": x(1, 3)}, {"s": i64(-2, 3)}),
    "expand_negative_input": lambda: one("Expand", {"x": x(1, 3), "s": i64(-5, 3)}),
    "expand_huge_input": lambda: one("Expand", {"x": x(1, 1, 3), "s": i64(1 << 20, 1 << 20, 3)}),
    "expand_overflow_input": lambda: one("Expand", {"x": x(1, 1, 3), "s": i64(1 << 32, 1 << 32, 3)}),
    "tile_negative_const": lambda: one("Tile", {"x": x(2, 3)}, {"r": i64(-1, 2)}),
    "tile_huge_input": lambda: one("Tile", {"x": x(2, 3), "r": i64(1 << 31, 1 << 31)}),
    "constantofshape_negative": lambda: one("ConstantOfShape", {"s": i64(-3, 4)}),
    "constantofshape_huge": lambda: one("ConstantOfShape", {"s": i64(1 << 20, 1 << 20, 1 << 10)}),
    "constantofshape_overflow": lambda: one("ConstantOfShape", {"s": i64(1 << 62, 1 << 62)}),
    "range_huge": lambda: one("Range", {"a": np.array(0, np.int64), "b": np.array(1 << 50, np.int64),
                                        "d": np.array(1, np.int64)}, out=TensorProto.INT64),
    "range_zero_delta": lambda: one("Range", {"a": np.array(0, np.int64), "b": np.array(10, np.int64),
                                              "d": np.array(0, np.int64)}, out=TensorProto.INT64),
    "range_nan_limit": lambda: one("Range", {"a": np.array(0, np.float32),
                                             "b": np.array(np.nan, np.float32),
                                             "d": np.array(1, np.float32)}),
    "reshape_negative": lambda: one("Reshape", {"x": x(2, 3)}, {"s": i64(-2, 3)}),
    "reshape_two_free": lambda: one("Reshape", {"x": x(2, 3)}, {"s": i64(-1, -1)}),
    "reshape_wraps_to_zero": lambda: one("Reshape", {"x": x(0, 6), "s": i64(6, 1 << 32, 1 << 32)}),
    "reshape_huge_input": lambda: one("Reshape", {"x": x(2, 3), "s": i64(I64_MAX, 6)}),
    "slice_extreme_bounds": lambda: one("Slice", {"x": x(5)}, {"a": i64(I64_MAX), "b": i64(I64_MIN),
                                                               "c": i64(0), "d": i64(I64_MIN)}),
    "slice_huge_step_forward": lambda: one("Slice", {"x": x(5)}, {"a": i64(0), "b": i64(5),
                                                                  "c": i64(0), "d": i64(I64_MAX)}),
    "slice_huge_step_backward": lambda: one("Slice", {"x": x(5)}, {"a": i64(4), "b": i64(0),
                                                                   "c": i64(0), "d": i64(-I64_MAX)}),
    "slice_step_zero": lambda: one("Slice", {"x": x(5)}, {"a": i64(0), "b": i64(5), "c": i64(0),
                                                          "d": i64(0)}),
    "pad_negative_past_dim": lambda: one("Pad", {"x": x(2, 3)}, {"p": i64(-5, 0, 0, 0)}),
    "pad_huge_input": lambda: one("Pad", {"x": x(2, 3), "p": i64(0, 0, 1 << 40, 0)}),
    "resize_huge_scale": lambda: one("Resize", {"x": x(1, 1, 2, 2)},
                                     {"r": np.zeros(0, np.float32),
                                      "s": np.array([1, 1, 1e6, 1e6], np.float32)}),
    "onehot_negative_depth": lambda: one("OneHot", {"i": i64(0, 1)},
                                         {"d": i64(-3), "v": np.array([0, 1], np.float32)}),
    "onehot_huge_depth": lambda: one("OneHot", {"i": i64(0, 1), "d": i64(1 << 40)},
                                     {"v": np.array([0, 1], np.float32)}),
    "topk_k_too_big": lambda: one("TopK", {"x": x(3)}, {"k": i64(10)}, outs=2),
    "topk_k_negative": lambda: one("TopK", {"x": x(3), "k": i64(-1)}, outs=2),
}


# -- indices out of range, splits past their input -------------------------------------------------

def _scatternd() -> Built:
    return one("ScatterND", {"x": x(4)},
               {"i": np.array([[9]], np.int64), "u": np.array([1], np.float32)})


INDICES: dict[str, Callable[[], Built]] = {
    "gather_oob_const": lambda: one("Gather", {"x": x(3, 4)}, {"i": i64(5)}),
    "gather_oob_input": lambda: one("Gather", {"x": x(3, 4), "i": i64(7)}),
    "gather_negative_oob": lambda: one("Gather", {"x": x(3, 4), "i": i64(-9)}, axis=1),
    "gather_axis_oob": lambda: one("Gather", {"x": x(3, 4), "i": i64(0)}, axis=5),
    "gatherelements_oob": lambda: one("GatherElements",
                                      {"x": x(2, 2), "i": np.array([[0, 5]], np.int64)}),
    "gathernd_oob": lambda: one("GatherND", {"x": x(2, 2), "i": np.array([[9, 0]], np.int64)}),
    "scatternd_oob": _scatternd,
    "scatterelements_oob": lambda: one("ScatterElements", {"x": x(2, 2)},
                                       {"i": np.array([[3]], np.int64),
                                        "u": np.array([[1]], np.float32)}),
    "compress_condition_long": lambda: one("Compress", {"x": x(2, 2)},
                                           {"c": np.array([1, 0, 1, 1, 1], bool)}, axis=0),
    "split_past_input_const": lambda: one("Split", {"x": x(4)}, {"s": i64(3, 3)}, outs=2),
    "split_past_input_attr": lambda: one("Split", {"x": x(4)}, outs=2, opset=11, split=[3, 3]),
    "split_negative": lambda: one("Split", {"x": x(4)}, {"s": i64(6, -2)}, outs=2),
    "split_more_outputs_than_elements": lambda: one("Split", {"x": x(3)}, outs=5, opset=18,
                                                    num_outputs=5),
}


# -- weights that contradict attributes ------------------------------------------------------------

def _recurrent(op: str, gates: int, hidden: int, weights_hidden: int, feature: int = 3) -> Built:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1, gates * weights_hidden, 3)).astype(np.float32)
    r = rng.standard_normal((1, gates * weights_hidden, weights_hidden)).astype(np.float32)
    return one(op, {"x": x(2, 1, feature)}, {"w": w, "r": r}, hidden_size=hidden)


def _conv(channels: int, weight: tuple[int, ...], **attrs: Any) -> Built:
    w = np.ones(weight, np.float32) / 10
    return one("Conv", {"x": x(1, channels, 5, 5)}, {"w": w}, **attrs)


WEIGHTS: dict[str, Callable[[], Built]] = {
    "lstm_hidden_contradicts_weights": lambda: _recurrent("LSTM", 4, 8, 4),
    "gru_hidden_contradicts_weights": lambda: _recurrent("GRU", 3, 8, 4),
    "rnn_hidden_contradicts_weights": lambda: _recurrent("RNN", 1, 2, 4),
    "lstm_input_size_contradicts_weights": lambda: _recurrent("LSTM", 4, 4, 4, feature=5),
    "conv_group_mismatch": lambda: _conv(4, (2, 2, 3, 3), group=3),
    "conv_weight_channels_mismatch": lambda: _conv(3, (2, 4, 3, 3)),
    "conv_kernel_past_input": lambda: _conv(1, (1, 1, 7, 7)),
    "conv_negative_pads": lambda: _conv(1, (1, 1, 3, 3), pads=[-3, -3, -3, -3]),
    "conv_zero_stride": lambda: _conv(1, (1, 1, 3, 3), strides=[0, 0]),
    "maxpool_kernel_past_input": lambda: one("MaxPool", {"x": x(1, 1, 5, 5)}, kernel_shape=[7, 7]),
    "batchnorm_scale_mismatch": lambda: one("BatchNormalization", {"x": x(1, 3, 2, 2)},
                                            {"s": np.ones(2, np.float32),
                                             "b": np.zeros(2, np.float32),
                                             "m": np.zeros(2, np.float32),
                                             "v": np.ones(2, np.float32)}),
    "layernorm_scale_mismatch": lambda: one("LayerNormalization", {"x": x(2, 4)},
                                            {"s": np.ones(3, np.float32)}),
    "matmul_runtime_mismatch": lambda: model(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": x(2, 3), "b": x(4, 2)},
        inputs=[helper.make_tensor_value_info("a", F, ["n", "k"]),
                helper.make_tensor_value_info("b", F, ["j", "m"])]),
    "einsum_bad_equation": lambda: one("Einsum", {"a": x(2, 3), "b": x(3, 4)}, equation="ij,jk->il"),
    "transpose_bad_perm": lambda: one("Transpose", {"x": x(2, 3)}, perm=[0, 0]),
    "unsqueeze_duplicate_axes": lambda: one("Unsqueeze", {"x": x(2, 3)}, {"a": i64(0, 0)}),
    "squeeze_not_one": lambda: one("Squeeze", {"x": x(2, 3)}, {"a": i64(1)}),
    "reduce_axes_oob": lambda: one("ReduceSum", {"x": x(2, 3)}, {"a": i64(5)}),
    "softmax_axis_oob": lambda: one("Softmax", {"x": x(2, 3)}, axis=7),
    "concat_runtime_mismatch": lambda: model(
        [helper.make_node("Concat", ["a", "b"], ["y"], axis=0)], {"a": x(2, 3), "b": x(2, 4)},
        inputs=[helper.make_tensor_value_info("a", F, ["n", "k"]),
                helper.make_tensor_value_info("b", F, ["j", "m"])]),
    "depthtospace_bad_blocksize": lambda: one("DepthToSpace", {"x": x(1, 3, 2, 2)}, blocksize=2),
    "dropout_ratio_past_one": lambda: one("Dropout", {"x": x(2, 3)},
                                          {"r": np.array(1.5, np.float32), "t": np.array(True)}),
}


# -- control flow ----------------------------------------------------------------------------------

def _loop(trip: int) -> Built:
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]),
         helper.make_node("Add", ["a", "one"], ["a_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("a", F, [1])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("a_out", F, [1])])
    node = helper.make_node("Loop", ["n", "cond", "a0"], ["y"], body=body)
    return model([node], {"a0": x(1)}, {"n": np.array(trip, np.int64), "cond": np.array(True),
                                        "one": np.ones(1, np.float32)})


def _if_types() -> Built:
    then = helper.make_graph([helper.make_node("Identity", ["f"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, [3])])
    other = helper.make_graph([helper.make_node("Identity", ["n"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.INT64, [3])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    return model([node], {"c": np.array(False)}, {"f": x(3), "n": i64(1, 2, 3)})


def _nested_if(depth: int) -> Built:
    leaf = helper.make_graph([helper.make_node("Neg", ["x"], ["leaf"])], "leaf", [],
                             [helper.make_tensor_value_info("leaf", F, [3])])
    inner = leaf
    for level in range(depth):  # the then branch nests, the else branch is a leaf: size linear
        out = f"o{level}"
        node = helper.make_node("If", ["c"], [out], then_branch=inner, else_branch=leaf)
        inner = helper.make_graph([node], f"g{level}", [], [helper.make_tensor_value_info(out, F, [3])])
    return model(list(inner.node), {"x": x(3), "c": np.array(True)},
                 outputs=[(inner.output[0].name, F)])


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _nested_if_bytes(depth: int) -> Built:
    """``_nested_if`` past protobuf's nesting limit (100 messages), which onnx.helper cannot build:
    written field by field (NodeProto 1 input, 2 output, 4 op_type, 5 attribute; AttributeProto
    1 name, 6 g, 20 type; GraphProto 1 node, 2 name, 12 output)."""
    leaf = helper.make_graph([helper.make_node("Neg", ["x"], ["leaf"])], "leaf", [],
                             [helper.make_tensor_value_info("leaf", F, [3])]).SerializeToString()
    graph = leaf

    def attribute(name: str, body: bytes) -> bytes:
        return _field(1, name.encode()) + _field(6, body) + _varint(20 << 3) + _varint(5)

    for level in range(depth):
        out = f"o{level}".encode()
        node = (_field(1, b"c") + _field(2, out) + _field(4, b"If")
                + _field(5, attribute("then_branch", graph))
                + _field(5, attribute("else_branch", leaf)))
        info = helper.make_tensor_value_info(out.decode(), F, [3]).SerializeToString()
        graph = _field(1, node) + _field(2, f"g{level}".encode()) + _field(12, info)
    top, feeds = _nested_if(0)  # its inputs and opset; its graph's node and output come from ``graph``
    top.graph.ClearField("node")
    top.graph.ClearField("output")
    return top.SerializeToString() + _field(7, graph), feeds  # a message field given twice merges


CONTROL: dict[str, Callable[[], Built]] = {
    "loop_huge_trip_count": lambda: _loop(1 << 62),
    "loop_negative_trip_count": lambda: _loop(-5),
    "if_branches_of_other_types": _if_types,
    "if_nested_30_deep": lambda: _nested_if(30),
    "if_nested_300_deep": lambda: _nested_if_bytes(300),
}


# -- odd types, empty tensors, NaN and Inf, integer overflow ---------------------------------------

ODD_TYPES = {"undefined": 0, "string": TensorProto.STRING, "complex64": TensorProto.COMPLEX64,
             "bfloat16": TensorProto.BFLOAT16, "float8e4m3fn": TensorProto.FLOAT8E4M3FN,
             "int4": TensorProto.INT4, "type_99": 99}


def _cast(to: int) -> Built:
    return one("Cast", {"x": x(2, 3)}, out=to, to=to)


def _nan(op: str, fill: float, shape: tuple[int, ...] = (1, 1, 4, 4), **attrs: Any) -> Built:
    data = x(*shape)
    data.flat[::3] = fill
    return one(op, {"x": data}, **attrs)


def _int(op: str, a: Sequence[int], b: Sequence[int], dtype: Any = np.int32) -> Built:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return one(op, {"a": np.array(a, dtype), "b": np.array(b, dtype)}, out=elem)


def _whole(name: str, fill: float) -> Built:
    loaded = onnx.load(str(ROOT / "tests" / "data" / f"{name}.onnx"))
    feeds = dict(np.load(ROOT / "tests" / "data" / f"{name}.npz"))
    first = next(iter(feeds))
    feeds[first] = np.full_like(feeds[first], fill)
    return loaded, feeds


VALUES: dict[str, Callable[[], Built]] = {
    **{f"cast_to_{name}": (lambda t=t: _cast(t)) for name, t in ODD_TYPES.items()},
    "cast_huge_to_float16": lambda: one("Cast", {"x": x(3, fill=1e30)}, out=TensorProto.FLOAT16,
                                        to=TensorProto.FLOAT16),
    "empty_relu": lambda: one("Relu", {"x": x(0, 3)}),
    "empty_matmul": lambda: one("MatMul", {"a": x(0, 3), "b": x(3, 4)}),
    "empty_reducesum": lambda: one("ReduceSum", {"x": x(2, 0)}, {"a": i64(1)}),
    "empty_reducemax": lambda: one("ReduceMax", {"x": x(2, 0)}, axes=[1], opset=13),
    "empty_softmax": lambda: one("Softmax", {"x": x(2, 0)}),
    "empty_conv_batch": lambda: one("Conv", {"x": x(0, 1, 4, 4)},
                                    {"w": np.ones((1, 1, 3, 3), np.float32)}),
    "empty_concat": lambda: one("Concat", {"a": x(0, 3), "b": x(2, 3)}, axis=0),
    "empty_argmax_axis": lambda: one("ArgMax", {"x": x(2, 0)}, out=TensorProto.INT64, axis=1),
    "nan_relu": lambda: _nan("Relu", np.nan),
    "nan_clip": lambda: one("Clip", {"x": _nan("Relu", np.nan)[1]["x"]},
                            {"lo": np.array(0, np.float32), "hi": np.array(1, np.float32)}),
    "nan_maxpool": lambda: _nan("MaxPool", np.nan, kernel_shape=[2, 2]),
    "nan_softmax": lambda: _nan("Softmax", np.nan),
    "inf_softmax": lambda: _nan("Softmax", np.inf),
    "inf_logsoftmax": lambda: _nan("LogSoftmax", -np.inf),
    "nan_reducemax": lambda: _nan("ReduceMax", np.nan, keepdims=0),
    "nan_argmax": lambda: _nan("ArgMax", np.nan, out=TensorProto.INT64, axis=3),
    "nan_topk": lambda: one("TopK", {"x": x(2, 5) * np.array([1, np.nan, 1, 1, 1], np.float32)},
                            {"k": i64(2)}, outs=2),
    "nan_max_of_two": lambda: one("Max", {"a": x(2, 3, fill=np.nan), "b": x(2, 3)}),
    "inf_instancenorm": lambda: one("InstanceNormalization", {"x": _nan("Relu", np.inf)[1]["x"]},
                                    {"s": np.ones(1, np.float32), "b": np.zeros(1, np.float32)}),
    "nan_gemm": lambda: one("Gemm", {"a": x(2, 3, fill=np.nan), "b": x(3, 4)}),
    "nan_tiny_mobilenet_v3": lambda: _whole("tiny_mobilenet_v3", np.nan),
    "inf_tiny_mobilenet_v3": lambda: _whole("tiny_mobilenet_v3", np.inf),
    "int32_add_overflow": lambda: _int("Add", [2**31 - 1, -2**31], [1, -1]),
    "int64_mul_overflow": lambda: _int("Mul", [I64_MAX, I64_MIN], [2, -1], np.int64),
    "int32_abs_min": lambda: one("Abs", {"a": np.array([-2**31], np.int32)}, out=TensorProto.INT32),
    "int32_div_by_zero": lambda: _int("Div", [7, -7], [0, 0]),
    "int32_mod_by_zero": lambda: _int("Mod", [7, -7], [0, 0]),
}


# -- names -----------------------------------------------------------------------------------------

def _names(outputs: Sequence[str], nodes: Sequence[onnx.NodeProto] = (),
           twice_input: bool = False) -> Built:
    feeds = {"x": x(2, 3)}
    inputs = [helper.make_tensor_value_info("x", F, [2, 3])] * (2 if twice_input else 1)
    nodes = list(nodes) or [helper.make_node("Add", ["x", "w"], ["y"])]
    return model(nodes, feeds, {"w": x(2, 3) * 2}, [(n, F) for n in outputs], inputs=inputs)


NAMES: dict[str, Callable[[], Built]] = {
    "two_nodes_write_one_name": lambda: _names(["y"], [helper.make_node("Relu", ["x"], ["y"]),
                                                       helper.make_node("Neg", ["x"], ["y"])]),
    "input_listed_twice": lambda: _names(["y"], twice_input=True),
    "input_is_also_initializer": lambda: model([helper.make_node("Add", ["x", "w"], ["y"])],
                                               {"x": x(2, 3), "w": x(2, 3)}, {"w": x(2, 3) * 5}),
    "output_is_input": lambda: _names(["x", "y"]),
    "output_is_initializer": lambda: _names(["w", "y"]),
    "output_listed_twice": lambda: _names(["y", "y"]),
    "node_reads_its_own_output": lambda: _names(["y"], [helper.make_node("Add", ["x", "y"], ["y"])]),
}

CASES: dict[str, Callable[[], Built]] = {**SIZES, **INDICES, **WEIGHTS, **CONTROL, **VALUES, **NAMES}
