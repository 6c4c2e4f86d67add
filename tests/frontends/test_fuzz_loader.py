"""Fuzzing the loader: damaged and hostile ONNX models, each loaded and run in a process of its own.

Seed models (the committed tiny models, the demo model and small hand-made ones) are mutated, by
bytes (bit flips, truncations, overwrites, insertions, deletions of the serialized protobuf) and by
fields (dims, names, dtypes, domains, opsets, attributes, duplicate outputs, cycles, empty graphs,
initializers whose data disagrees with their dims, ...), and each mutant goes through
``InferenceSession(bytes, backends=["CpuRef"])`` and, where it loads, a run with zero inputs of the
declared shapes. Every outcome must be one of backplane's own errors with a message, or a run whose
outputs match ONNX Runtime's (where ORT runs the model too) within 1e-4 relative. Anything else is a
finding: another exception type, an empty message, a crash of the process, a hang past the time
limit, or memory growing past the limit.

Each case runs in a forked child (the parent has imported everything once) under an address-space
limit, killed past its time limit; ONNX Runtime runs in a second child, so a crash of ORT is never
taken for one of backplane's. The same seed gives the same cases on any machine.

The CI slice is ``test_fuzz_slice`` below (a fixed seed, a few hundred cases); the long run is
``python bench/fuzz_loader.py --cases 5000`` (same machinery, findings saved under
/tmp/fuzz_findings/).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import os
import pickle
import random
import resource
import select
import signal
import struct
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
SEED_FILES = [ROOT / "tests" / "data" / f"tiny_{n}.onnx" for n in ("bert", "gpt2", "mobilenet_v3")]
SEED_FILES.append(ROOT / "models" / "mobilenet_v2_w020_c10.onnx")

RTOL = 1e-4
MAX_FEED_ELEMENTS = 1 << 22  # a mutant declaring a larger input is loaded, not run (a user's choice)
MAX_SENT_BYTES = 64 << 20  # outputs larger than this are not sent back for comparison
MEMORY_BUDGET = 2 << 30  # address space a case may add to the parent's
GROWTH_LIMIT = 1 << 30  # resident memory a case may add before it counts as a blow-up

OWN_ERRORS = ("ModelError", "OptimizationError", "InvalidInputError", "ExecutionError",
              "UnsupportedError", "UnknownBackendError")


def own_error_classes() -> tuple[type, ...]:
    from backplane.backends.api.kernels import UnsupportedError
    from backplane.backends.registry import UnknownBackendError
    from backplane.frontends.onnx import ModelError
    from backplane.optimizer.optimize import OptimizationError
    from backplane.runtime.loaded_network import ExecutionError
    from backplane.runtime.runtime import InvalidInputError
    return (ModelError, OptimizationError, InvalidInputError, ExecutionError, UnsupportedError,
            UnknownBackendError)


# -- seed models ------------------------------------------------------------------------------------

def _model(nodes: list[NodeProto], inputs: list, outputs: list, inits: Sequence[TensorProto] = (),
           opset: int = 17, functions: Sequence[onnx.FunctionProto] = (),
           extra_opsets: Sequence[onnx.OperatorSetIdProto] = ()) -> ModelProto:
    graph = helper.make_graph(nodes, "seed", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
                              functions=list(functions))
    model.ir_version = 8
    return model


def _vi(name: str, elem: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _f(name: str, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return _vi(name, TensorProto.FLOAT, shape)


def _arr(values: Any, name: str, dtype: Any = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def seed_small_cnn() -> ModelProto:
    from tests.conftest import small_cnn_model
    return small_cnn_model()


def seed_constants() -> ModelProto:
    """A Constant node, an initializer, a symbolic batch dimension."""
    const = helper.make_node("Constant", [], ["c"], name="const",
                             value=_arr([1.0, 2.0, 3.0], "c_value"))
    nodes = [const, helper.make_node("Add", ["x", "c"], ["y"], name="add1"),
             helper.make_node("Mul", ["y", "bias"], ["z"], name="mul1"),
             helper.make_node("Sigmoid", ["z"], ["out"], name="sig")]
    return _model(nodes, [_f("x", ["batch", 3])], [_f("out", ["batch", 3])],
                  [_arr([0.5, -1.0, 2.0], "bias")])


def seed_shapes() -> ModelProto:
    """Reshape, Transpose, Slice, Concat, Split (two outputs), Unsqueeze, ReduceMean, Gather, Cast."""
    rng = np.random.default_rng(1)
    inits = [_arr([2, 3, 4], "shape", np.int64), _arr([0], "starts", np.int64),
             _arr([2], "ends", np.int64), _arr([1], "axes1", np.int64),
             _arr([2, 1], "split", np.int64), _arr([0, 2], "idx", np.int64),
             _arr(rng.standard_normal((4, 5)), "w")]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[1, 0, 2]),
        helper.make_node("Slice", ["t", "starts", "ends"], ["s"], name="slice"),
        helper.make_node("Concat", ["s", "s"], ["cat"], name="concat", axis=2),
        helper.make_node("Split", ["t", "split"], ["p0", "p1"], name="split", axis=0),
        helper.make_node("ReduceMean", ["p0"], ["m"], name="mean", axes=[0], keepdims=1),
        helper.make_node("Unsqueeze", ["p1", "axes1"], ["u"], name="unsq"),
        helper.make_node("Gather", ["cat", "idx"], ["g"], name="gather", axis=2),
        helper.make_node("MatMul", ["m", "w"], ["mm"], name="matmul"),
        helper.make_node("Cast", ["mm"], ["mm64"], name="cast", to=TensorProto.DOUBLE),
        helper.make_node("Tanh", ["mm64"], ["th"], name="tanh"),
    ]
    return _model(nodes, [_f("x", [6, 4])],
                  [_vi("th", TensorProto.DOUBLE, [1, 2, 5]), _f("u", None), _f("g", None)], inits)


def seed_ints() -> ModelProto:
    """Integer and boolean tensors: Equal, Where, Not, ArgMax, Expand, ConstantOfShape."""
    nodes = [
        helper.make_node("Equal", ["ids", "zero"], ["eq"], name="equal"),
        helper.make_node("Not", ["eq"], ["ne"], name="not"),
        helper.make_node("Where", ["ne", "ids", "ten"], ["w"], name="where"),
        helper.make_node("ArgMax", ["w"], ["am"], name="argmax", axis=1, keepdims=0),
        helper.make_node("Shape", ["ids"], ["shp"], name="shape"),
        helper.make_node("ConstantOfShape", ["shp"], ["ones"], name="cos",
                         value=_arr([1.5], "v")),
        helper.make_node("Cast", ["w"], ["wf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Add", ["ones", "wf"], ["sum"], name="add"),
        helper.make_node("Expand", ["sum", "eshape"], ["big"], name="expand"),
    ]
    inits = [_arr(0, "zero", np.int64), _arr(10, "ten", np.int64), _arr([2, 3, 4], "eshape", np.int64)]
    return _model(nodes, [_vi("ids", TensorProto.INT64, [3, 4])],
                  [_vi("am", TensorProto.INT64, [3]), _f("big", [2, 3, 4])], inits)


def seed_if() -> ModelProto:
    """If whose branches read outer tensors."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["t0"], name="t_mul"),
                              helper.make_node("Relu", ["t0"], ["t"], name="t_relu")],
                             "then", [], [_f("t", [4])])
    other = helper.make_graph([helper.make_node("Add", ["x", "w"], ["e0"], name="e_add"),
                               helper.make_node("Neg", ["e0"], ["e"], name="e_neg")],
                              "else", [], [_f("e", [4])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["sx"], name="sum", keepdims=0),
             helper.make_node("Less", ["sx", "w0"], ["cond"], name="less"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then,
                              else_branch=other)]
    return _model(nodes, [_f("x", [4])], [_f("y", [4])],
                  [_arr([1, -2, 3, -4], "w"), _arr(1.0, "w0")])


def seed_loop() -> ModelProto:
    """Loop carrying a value, with a scan output and an outer tensor read in the body."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "step"], ["acc_out"], name="b_add"),
         helper.make_node("Mul", ["acc_out", "acc_out"], ["sq"], name="b_square"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="b_cond")],
        "body", [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []),
                 _f("acc_in", [3])],
        [_vi("cond_out", TensorProto.BOOL, []), _f("acc_out", [3]), _f("sq", [3])])
    nodes = [helper.make_node("Loop", ["trip", "", "x"], ["acc", "squares"], name="loop", body=body)]
    return _model(nodes, [_f("x", [3])], [_f("acc", [3]), _f("squares", [4, 3])],
                  [_arr(4, "trip", np.int64), _arr([0.5, 1.0, -1.0], "step")])


def seed_scan() -> ModelProto:
    """Scan: a running sum over the first axis."""
    body = helper.make_graph([helper.make_node("Add", ["s_in", "x_t"], ["s_out"], name="b_add"),
                              helper.make_node("Identity", ["s_out"], ["y_t"], name="b_id")],
                             "body", [_f("s_in", [2]), _f("x_t", [2])], [_f("s_out", [2]), _f("y_t", [2])])
    node = helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body,
                            num_scan_inputs=1)
    return _model([node], [_f("s0", [2]), _f("xs", [5, 2])], [_f("s", [2]), _f("ys", [5, 2])])


def seed_function() -> ModelProto:
    """A local function (inlined at import) and a second domain."""
    fn = helper.make_function("local", "Scale", ["a"], ["b"],
                              [helper.make_node("Constant", [], ["k"], value_float=3.0),
                               helper.make_node("Mul", ["a", "k"], ["b"])],
                              [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Scale", ["x"], ["y"], domain="local", name="scale"),
             helper.make_node("Softmax", ["y"], ["z"], name="softmax", axis=-1)]
    return _model(nodes, [_f("x", [2, 3])], [_f("z", [2, 3])], functions=[fn],
                  extra_opsets=[helper.make_opsetid("local", 1)])


def seed_norm() -> ModelProto:
    """BatchNormalization, LayerNormalization, Pad, MaxPool, Resize."""
    rng = np.random.default_rng(2)
    inits = [_arr(rng.uniform(0.5, 1.5, 2), "scale"), _arr(rng.standard_normal(2), "bias"),
             _arr(rng.standard_normal(2), "mean"), _arr(rng.uniform(0.5, 1.5, 2), "var"),
             _arr([0, 0, 1, 1, 0, 0, 1, 1], "pads", np.int64),
             _arr([1, 1, 2, 2], "scales"), _arr(rng.uniform(0.5, 1.5, 8), "ln_scale")]
    nodes = [
        helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["bn"], name="bn"),
        helper.make_node("Pad", ["bn", "pads"], ["pad"], name="pad", mode="constant"),
        helper.make_node("MaxPool", ["pad"], ["mp"], name="pool", kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("Resize", ["mp", "", "scales"], ["rs"], name="resize", mode="nearest"),
        helper.make_node("LayerNormalization", ["rs", "ln_scale"], ["ln"], name="ln", axis=-1),
    ]
    return _model(nodes, [_f("x", [1, 2, 3, 3])], [_f("ln", [1, 2, 8, 8])], inits)


HAND_MADE: dict[str, Callable[[], ModelProto]] = {
    "small_cnn": seed_small_cnn, "constants": seed_constants, "shapes": seed_shapes,
    "ints": seed_ints, "if": seed_if, "loop": seed_loop, "scan": seed_scan,
    "function": seed_function, "norm": seed_norm,
}


def seed_models() -> dict[str, ModelProto]:
    seeds = {name: make() for name, make in HAND_MADE.items()}
    for path in SEED_FILES:
        seeds[path.stem] = onnx.load(str(path))
    return seeds


# -- mutations ---------------------------------------------------------------------------------------

INTERESTING_DIMS = (-1, -7, 0, 1, 3, 1 << 31, 1 << 40, (1 << 62), (1 << 63) - 1)
INTERESTING_INTS = (-(1 << 63), -(1 << 31), -100, -2, -1, 0, 1, 2, 7, 1 << 31, 1 << 40, (1 << 63) - 1)
INTERESTING_FLOATS = (0.0, -0.0, -1.0, 1e-45, 1e38, float("inf"), float("-inf"), float("nan"))
ELEM_TYPES = (0, *range(1, 29), 29, 99, -3, 1 << 30)
OTHER_OPS = ("Relu", "Add", "Conv", "Gemm", "MatMul", "Reshape", "Concat", "Split", "Loop", "If",
             "Scan", "Constant", "Identity", "Cast", "Gather", "Slice", "Transpose", "Softmax",
             "BatchNormalization", "ConstantOfShape", "Expand", "Range", "TopK", "NonZero",
             "Resize", "Einsum", "SequenceConstruct", "SplitToSequence", "ConcatFromSequence",
             "Optional", "OptionalGetElement", "LSTM", "Pad", "Tile", "ScatterND", "Col2Im",
             "StringNormalizer", "RandomNormal", "Dropout", "LayerNormalization", "Attention",
             "Frobnicate", "", "relu", "Relu ")
DOMAINS = ("com.unknown", "ai.onnx.ml", "com.microsoft", "ai.onnx", "ai.onnx.preview.training",
           "local", "x" * 300)


class Skip(Exception):
    """The mutation does not apply to this model."""


def all_graphs(model: ModelProto) -> list[GraphProto]:
    """The main graph and every sub-graph in a node attribute, at any depth."""
    found: list[GraphProto] = []

    def walk(graph: GraphProto) -> None:
        found.append(graph)
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return found


def all_node_lists(model: ModelProto) -> list[Any]:
    """Node lists: every graph's, and every local function's."""
    return [g.node for g in all_graphs(model)] + [f.node for f in model.functions]


def _pick(rng: random.Random, items: Sequence[Any]) -> Any:
    if not items:
        raise Skip
    return items[rng.randrange(len(items))]


def _pick_graph(rng: random.Random, model: ModelProto) -> GraphProto:
    graphs = all_graphs(model)
    return graphs[0] if rng.random() < 0.6 else _pick(rng, graphs)


def _pick_node(rng: random.Random, model: ModelProto) -> NodeProto:
    lists = [nodes for nodes in all_node_lists(model) if len(nodes)]
    nodes = lists[0] if lists and rng.random() < 0.6 else _pick(rng, lists)
    return _pick(rng, nodes)


def _value_infos(graph: GraphProto) -> list[onnx.ValueInfoProto]:
    return [*graph.input, *graph.output, *graph.value_info]


def _tensor_names(graph: GraphProto) -> list[str]:
    names = [vi.name for vi in graph.input] + [i.name for i in graph.initializer]
    return names + [o for n in graph.node for o in n.output if o]


def m_dim(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    vis = [vi for vi in _value_infos(graph) if vi.type.HasField("tensor_type")]
    vi = _pick(rng, vis)
    shape = vi.type.tensor_type.shape
    choice = rng.random()
    if choice < 0.6 and len(shape.dim):
        dim = _pick(rng, shape.dim)
        value = _pick(rng, INTERESTING_DIMS)
        dim.Clear()
        dim.dim_value = value
        return f"dim of '{vi.name}' -> {value}"
    if choice < 0.7 and len(shape.dim):
        dim = _pick(rng, shape.dim)
        dim.Clear()
        dim.dim_param = _pick(rng, ("N", "", "batch", "ä"))
        return f"dim of '{vi.name}' -> symbolic"
    if choice < 0.8:
        shape.dim.add().dim_value = rng.choice((1, 2, 0))
        return f"extra dim on '{vi.name}'"
    if choice < 0.9 and len(shape.dim):
        del shape.dim[rng.randrange(len(shape.dim))]
        return f"dim removed from '{vi.name}'"
    vi.type.tensor_type.ClearField("shape")
    return f"shape of '{vi.name}' cleared"


def m_dangling_input(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    if not len(node.input):
        raise Skip
    k = rng.randrange(len(node.input))
    node.input[k] = rng.choice(("dangling", "", "dangling" * 40))
    return f"input {k} of node '{node.name}' ({node.op_type}) -> '{node.input[k][:20]}'"


def m_dangling_output(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    if rng.random() < 0.5 and len(graph.output):
        vi = _pick(rng, graph.output)
        vi.name = rng.choice(("nowhere", ""))
        return f"graph output -> '{vi.name}'"
    node = _pick(rng, graph.node)
    if not len(node.output):
        raise Skip
    k = rng.randrange(len(node.output))
    node.output[k] = rng.choice(("renamed", ""))
    return f"output {k} of node '{node.name}' ({node.op_type}) -> '{node.output[k]}'"


def m_dtype(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    choice = rng.random()
    value = _pick(rng, ELEM_TYPES)
    if choice < 0.5:
        vis = [vi for vi in _value_infos(graph) if vi.type.HasField("tensor_type")]
        vi = _pick(rng, vis)
        vi.type.tensor_type.elem_type = value
        return f"elem_type of '{vi.name}' -> {value}"
    if choice < 0.8:
        init = _pick(rng, graph.initializer)
        init.data_type = value
        return f"data_type of initializer '{init.name}' -> {value}"
    nodes = [n for n in graph.node if n.op_type in ("Cast", "Constant", "ConstantOfShape",
                                                   "RandomNormal", "EyeLike")]
    node = _pick(rng, nodes)
    for attr in node.attribute:
        if attr.name == "to" or attr.name == "dtype":
            attr.i = value
            return f"'{attr.name}' of node '{node.name}' -> {value}"
        if attr.type == AttributeProto.TENSOR:
            attr.t.data_type = value
            return f"tensor of node '{node.name}' -> data_type {value}"
    raise Skip


def m_domain(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    node.domain = _pick(rng, DOMAINS)
    if rng.random() < 0.5:
        model.opset_import.append(helper.make_opsetid(node.domain, rng.choice((1, 17, 999))))
    return f"domain of node '{node.name}' -> '{node.domain[:20]}'"


def m_opset(rng: random.Random, model: ModelProto) -> str:
    choice = rng.random()
    if choice < 0.6:
        entries = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
        entry = _pick(rng, entries)
        entry.version = _pick(rng, (999, 0, -1, 1, 6, 7, 10, 11, 13, 16, 18, 21, 1 << 40))
        return f"default opset -> {entry.version}"
    if choice < 0.75:
        model.ClearField("opset_import")
        return "opset_import cleared"
    if choice < 0.9:
        model.opset_import.append(helper.make_opsetid(rng.choice(("", "ai.onnx")), rng.choice((1, 999, 13))))
        return "a second default opset"
    model.ir_version = _pick(rng, (0, 1, 3, 999, -1))
    return f"ir_version -> {model.ir_version}"


def m_attr_type(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    attr = _pick(rng, node.attribute)
    if rng.random() < 0.5:  # a value of another type, consistent with its type field
        name = attr.name
        value = rng.choice((1.5, 3, "three", [1, 2], [1.0, 2.0], ["a"],
                            numpy_helper.from_array(np.ones(2, np.float32))))
        attr.CopyFrom(helper.make_attribute(name, value))
        return f"attribute '{name}' of node '{node.name}' -> {type(value).__name__}"
    attr.type = _pick(rng, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 99))
    return f"attribute '{attr.name}' of node '{node.name}' -> type {attr.type}"


def m_attr_value(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    attr = _pick(rng, node.attribute)
    if attr.type == AttributeProto.INT:
        attr.i = _pick(rng, INTERESTING_INTS)
    elif attr.type == AttributeProto.INTS:
        if len(attr.ints) and rng.random() < 0.7:
            attr.ints[rng.randrange(len(attr.ints))] = _pick(rng, INTERESTING_INTS)
        elif rng.random() < 0.5:
            attr.ints.append(_pick(rng, INTERESTING_INTS))
        else:
            attr.ClearField("ints")
    elif attr.type == AttributeProto.FLOAT:
        attr.f = _pick(rng, INTERESTING_FLOATS)
    elif attr.type == AttributeProto.FLOATS:
        attr.floats.append(_pick(rng, INTERESTING_FLOATS))
    elif attr.type == AttributeProto.STRING:
        attr.s = rng.choice((b"", b"NOTSET", b"\xff\xfe", b"x" * 100, b"linear", b"SAME_UPPER"))
    elif attr.type == AttributeProto.TENSOR:
        attr.t.dims.append(_pick(rng, (0, 2, 1 << 40)))
    else:
        raise Skip
    return f"value of attribute '{attr.name}' of node '{node.name}' ({node.op_type})"


def m_attr_missing(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    if not len(node.attribute):
        raise Skip
    k = rng.randrange(len(node.attribute))
    name = node.attribute[k].name
    del node.attribute[k]
    return f"attribute '{name}' removed from node '{node.name}' ({node.op_type})"


def m_attr_extra(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    if rng.random() < 0.5 and len(node.attribute):
        node.attribute.append(node.attribute[rng.randrange(len(node.attribute))])
        return f"attribute duplicated on node '{node.name}'"
    node.attribute.append(helper.make_attribute(rng.choice(("bogus", "", "axis", "value")), 1))
    return f"attribute added to node '{node.name}' ({node.op_type})"


def m_duplicate_output(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    node = _pick(rng, graph.node)
    names = [vi.name for vi in graph.input] + [o for n in graph.node for o in n.output
                                               if o and n is not node]
    if not len(node.output):
        raise Skip
    node.output[0] = _pick(rng, names)
    return f"output of node '{node.name}' -> '{node.output[0]}' (already produced)"


def m_duplicate_node(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    node = _pick(rng, graph.node)
    graph.node.insert(rng.randrange(len(graph.node) + 1), node)
    return f"node '{node.name}' duplicated"


def m_cycle(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    if not len(graph.node):
        raise Skip
    i = rng.randrange(len(graph.node))
    j = rng.randrange(i, len(graph.node))
    source, target = graph.node[j], graph.node[i]
    outputs = [o for o in source.output if o]
    if not len(target.input) or not outputs:
        raise Skip
    k = rng.randrange(len(target.input))
    target.input[k] = _pick(rng, outputs)
    return f"cycle: node '{target.name}' reads '{target.input[k]}' of node '{source.name}'"


def m_reorder(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    nodes = list(graph.node)
    if len(nodes) < 2:
        raise Skip
    rng.shuffle(nodes)
    graph.ClearField("node")
    graph.node.extend(nodes)
    return "nodes shuffled"


def m_empty(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    fields = rng.sample(("node", "input", "output", "initializer", "value_info"), rng.randint(1, 3))
    for name in fields:
        graph.ClearField(name)
    if rng.random() < 0.1:
        model.ClearField("graph")
        return "graph removed"
    return f"graph fields {fields} emptied"


def m_initializer(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    init = _pick(rng, [*graph.initializer, *[a.t for n in graph.node for a in n.attribute
                                             if a.type == AttributeProto.TENSOR]])
    choice = rng.randrange(9)
    if choice == 0:
        init.raw_data = init.raw_data + bytes(rng.choice((1, 3, 4, 64)))
    elif choice == 1:
        init.raw_data = init.raw_data[:rng.randrange(max(1, len(init.raw_data)))]
    elif choice == 2:
        init.dims.append(rng.choice((2, 3, 0)))
    elif choice == 3:
        if not len(init.dims):
            raise Skip
        init.dims[rng.randrange(len(init.dims))] = _pick(rng, INTERESTING_DIMS)
    elif choice == 4:
        init.ClearField("dims")
        init.dims.extend([_pick(rng, INTERESTING_DIMS)])
    elif choice == 5:  # typed data of the wrong length
        init.ClearField("raw_data")
        init.float_data.extend([1.0] * rng.choice((0, 1, 7)))
    elif choice == 6:  # both raw and typed data
        init.float_data.extend([1.0, 2.0])
        init.int64_data.extend([3])
    elif choice == 7:  # external data that is not there
        init.data_location = TensorProto.EXTERNAL
        del init.external_data[:]
        for key, value in (("location", rng.choice(("missing.bin", "/etc/hostname", "../../x",
                                                     ""))),
                           ("offset", str(rng.choice((0, 1 << 40, -4)))),
                           ("length", str(rng.choice((4, 1 << 40))))):
            entry = init.external_data.add()
            entry.key, entry.value = key, value
    else:
        init.segment.begin, init.segment.end = 0, 1
    return f"initializer '{init.name}' data (variant {choice})"


def m_initializer_names(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    choice = rng.randrange(4)
    if choice == 0:  # an initializer twice, with other data
        init = _pick(rng, graph.initializer)
        twin = graph.initializer.add()
        twin.CopyFrom(init)
        twin.raw_data = bytes(len(twin.raw_data))
        return f"initializer '{init.name}' twice"
    if choice == 1:  # an initializer over a graph input (a default value)
        vi = _pick(rng, graph.input)
        graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), vi.name))
        return f"initializer over input '{vi.name}'"
    if choice == 2:
        k = rng.randrange(len(graph.initializer)) if len(graph.initializer) else None
        if k is None:
            raise Skip
        name = graph.initializer[k].name
        del graph.initializer[k]
        return f"initializer '{name}' removed"
    vi = _pick(rng, graph.input)
    graph.input.append(vi)
    return f"input '{vi.name}' declared twice"


def m_type_kind(rng: random.Random, model: ModelProto) -> str:
    graph = _pick_graph(rng, model)
    vi = _pick(rng, _value_infos(graph))
    choice = rng.randrange(5)
    if choice == 0:
        vi.type.CopyFrom(helper.make_sequence_type_proto(helper.make_tensor_type_proto(1, [2])))
    elif choice == 1:
        vi.type.CopyFrom(helper.make_optional_type_proto(helper.make_tensor_type_proto(1, [2])))
    elif choice == 2:
        vi.type.CopyFrom(helper.make_map_type_proto(7, helper.make_tensor_type_proto(1, [2])))
    elif choice == 3:
        vi.type.CopyFrom(helper.make_sparse_tensor_type_proto(1, [2, 2]))
    else:
        vi.ClearField("type")
    return f"type of '{vi.name}' -> kind {choice}"


def m_op_type(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    node.op_type = _pick(rng, OTHER_OPS)
    return f"node '{node.name}' -> op '{node.op_type}'"


def m_arity(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    choice = rng.randrange(4)
    if choice == 0 and len(node.input):
        del node.input[-1]
    elif choice == 1:
        node.input.append(rng.choice((node.input[0] if len(node.input) else "x", "", "extra")))
    elif choice == 2 and len(node.output):
        del node.output[-1]
    else:
        node.output.append(rng.choice(("more", "")))
    return f"arity of node '{node.name}' ({node.op_type}), variant {choice}"


def m_function(rng: random.Random, model: ModelProto) -> str:
    fn = _pick(rng, model.functions)
    choice = rng.randrange(5)
    if choice == 0:  # the function calls itself
        fn.node.append(helper.make_node(fn.name, [fn.input[0]], ["rec"], domain=fn.domain))
    elif choice == 1:
        fn.ClearField("opset_import")
    elif choice == 2:
        fn.output.append("missing_out")
    elif choice == 3:
        fn.input.append("extra_in")
    else:
        fn.domain = "elsewhere"
    return f"function '{fn.name}' variant {choice}"


def m_names(rng: random.Random, model: ModelProto) -> str:
    node = _pick_node(rng, model)
    other = _pick_node(rng, model)
    node.name = rng.choice((other.name, "", "a/b:c", "x" * 500))
    return f"node renamed '{node.name[:20]}'"


FIELD_MUTATIONS: dict[str, Callable[[random.Random, ModelProto], str]] = {
    "dim": m_dim, "dangling_input": m_dangling_input, "dangling_output": m_dangling_output,
    "dtype": m_dtype, "domain": m_domain, "opset": m_opset, "attr_type": m_attr_type,
    "attr_value": m_attr_value, "attr_missing": m_attr_missing, "attr_extra": m_attr_extra,
    "duplicate_output": m_duplicate_output, "duplicate_node": m_duplicate_node, "cycle": m_cycle,
    "reorder": m_reorder, "empty": m_empty, "initializer": m_initializer,
    "initializer_names": m_initializer_names, "type_kind": m_type_kind, "op_type": m_op_type,
    "arity": m_arity, "function": m_function, "names": m_names,
}


def data_spans(model: ModelProto, blob: bytes) -> list[tuple[int, int]]:
    """Where the raw data of the model's larger tensors lies in its serialized bytes."""
    spans = []
    for graph in all_graphs(model):
        for init in graph.initializer:
            if len(init.raw_data) >= 64:
                start = blob.find(init.raw_data)
                if start >= 0:
                    spans.append((start, start + len(init.raw_data)))
    return sorted(spans)


def _structure_position(rng: random.Random, size: int, spans: list[tuple[int, int]]) -> int:
    for _ in range(20):
        pos = rng.randrange(size)
        if not any(a <= pos < b for a, b in spans):
            return pos
    return rng.randrange(size)


def byte_mutation(rng: random.Random, blob: bytes, spans: list[tuple[int, int]]) -> tuple[bytes, str]:
    data = bytearray(blob)
    kind = rng.choice(("flip", "flip", "truncate", "overwrite", "insert", "delete", "duplicate"))
    structure = rng.random() < 0.7  # most of the bytes are weights: aim at the rest mostly

    def position() -> int:
        return _structure_position(rng, len(data), spans) if structure else rng.randrange(len(data))

    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            pos = position()
            data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[position():]
    elif kind == "overwrite":
        for _ in range(rng.randint(1, 4)):
            data[position()] = rng.choice((0x00, 0xff, 0x7f, 0x80, 0x01, rng.randrange(256)))
    elif kind == "insert":
        pos = position()
        data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == "delete":
        pos = position()
        del data[pos:pos + rng.randint(1, 16)]
    else:
        pos = position()
        length = rng.randint(1, 64)
        data[pos:pos] = data[pos:pos + length]
    return bytes(data), f"bytes: {kind}"


@dataclasses.dataclass
class Case:
    index: int
    seed_name: str
    mutations: list[str]
    blob: bytes


def generate(seed: int, count: int, seeds: dict[str, ModelProto] | None = None,
             byte_share: float = 0.35) -> Iterator[Case]:
    """``count`` mutants, the same for the same ``seed``."""
    seeds = seeds or seed_models()
    names = sorted(seeds)
    blobs = {name: seeds[name].SerializeToString() for name in names}
    spans = {name: data_spans(seeds[name], blobs[name]) for name in names}
    rng = random.Random(seed)
    for index in range(count):
        name = rng.choice(names)
        if rng.random() < byte_share:
            blob, what = blobs[name], []
            for _ in range(rng.choice((1, 1, 1, 2, 3))):
                blob, description = byte_mutation(rng, blob, spans[name] if blob is blobs[name] else [])
                what.append(description)
            yield Case(index, name, what, blob)
            continue
        model = ModelProto()
        model.CopyFrom(seeds[name])
        what = []
        tries = 0
        wanted = rng.choice((1, 1, 1, 2, 3))
        while len(what) < wanted and tries < 50:
            tries += 1
            kind = rng.choice(sorted(FIELD_MUTATIONS))
            attempt = ModelProto()
            attempt.CopyFrom(model)
            try:
                description = FIELD_MUTATIONS[kind](rng, attempt)
                blob = attempt.SerializeToString()
            except Skip:
                continue
            except Exception as exc:  # noqa: BLE001 - protobuf refuses some values: not a mutant
                if isinstance(exc, (ValueError, TypeError, OverflowError)):
                    continue
                raise
            model = attempt
            what.append(f"{kind}: {description}")
        yield Case(index, name, what, model.SerializeToString())


# -- running a case ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    """What one case came to. ``kind``: 'error' (one of backplane's, ``error`` its class), 'ran'
    (compared with ORT where it ran: 'match', 'ort-refused' or a mismatch finding), 'loaded'
    (loaded, not run: inputs that zeros cannot stand for), 'hang, ORT too' (a run that ends in
    neither runtime), or a finding: 'bad-exception', 'empty-message', 'crash', 'hang', 'blow-up',
    'mismatch'."""

    kind: str
    error: str = ""  # the class of backplane's exception
    message: str = ""
    detail: str = ""  # a traceback, a mismatch, why it was not run
    ort: str = ""  # 'ran', 'loaded' (not run: no inputs), 'refused: <why>', 'crash', 'hang' or ''
    seconds: float = 0.0
    growth: int = 0  # resident bytes the case added

    @property
    def finding(self) -> bool:
        return self.kind in FINDINGS


FINDINGS = ("bad-exception", "empty-message", "crash", "hang", "blow-up", "mismatch")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vsize() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _in_child(work: Callable[[Callable[[Any], None]], Any], timeout: float,
              memory: int | None) -> tuple[str, Any, int, Any]:
    """Run ``work(post)`` in a forked child under an address-space limit of ``memory`` bytes past
    the parent's (None: none), killed after ``timeout`` seconds. Returns (status, result, growth,
    posted): status 'ok' (``result`` what ``work`` returned, ``growth`` the resident bytes it
    added), 'crash' (``result`` the signal or exit status) or 'hang'; ``posted``: the last value
    ``work`` posted on the way (None if none), which survives a crash or hang."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        status = 0
        try:
            os.close(read_fd)
            faulthandler.disable()  # a crash is reported by the parent, from the signal
            warnings.simplefilter("ignore")  # NumPy's on NaNs and empty slices: not findings
            quiet = os.open(os.devnull, os.O_WRONLY)  # ORT's and protobuf's logs
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            out = os.fdopen(write_fd, "wb")

            def send(kind: bytes, value: Any) -> None:
                payload = pickle.dumps(value)
                out.write(kind + struct.pack("<Q", len(payload)) + payload)
                out.flush()

            start = _rss()
            if memory is not None:
                limit = _vsize() + memory
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            result = work(lambda value: send(b"P", value))
            growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
            send(b"R", (result, growth))
            out.close()
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
            status = 70
        finally:
            os._exit(status)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    data = bytearray()
    hung = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                hung = True
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if ready:
                chunk = os.read(read_fd, 1 << 20)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    posted, result = None, None
    offset = 0
    while offset + 9 <= len(data):
        kind, size = data[offset:offset + 1], struct.unpack("<Q", data[offset + 1:offset + 9])[0]
        if offset + 9 + size > len(data):
            break
        value = pickle.loads(data[offset + 9:offset + 9 + size])
        offset += 9 + size
        if kind == b"P":
            posted = value
        else:
            result = value
    if hung:
        return "hang", None, 0, posted
    if result is None:
        if os.WIFSIGNALED(status):
            return "crash", f"killed by signal {os.WTERMSIG(status)}", 0, posted
        return "crash", f"exit status {os.waitstatus_to_exitcode(status)}", 0, posted
    return "ok", result[0], result[1], posted


def feeds_for(session: Any) -> tuple[dict[str, Any] | None, str]:
    """Zeros of each input's declared shape (free dims 1), or None and why not."""
    feeds = {}
    for name in session.optimized.input_names:
        info = session.graph.info(name)
        if info.dtype is None:
            return None, f"input '{name}' is not a tensor of a known type"
        shape = [1 if not isinstance(d, int) else d for d in (info.shape or ())]
        if math.prod(shape) > MAX_FEED_ELEMENTS:
            return None, f"input '{name}' has {math.prod(shape)} elements"
        if info.dtype == object:
            feeds[name] = np.full(shape, "", dtype=object)
        else:
            feeds[name] = np.zeros(shape, info.dtype)
    return feeds, ""


def _backplane_work(blob: bytes) -> Callable[[Callable[[Any], None]], dict[str, Any]]:
    def work(post: Callable[[Any], None]) -> dict[str, Any]:
        import backplane
        own = own_error_classes()
        stage = "load"
        try:
            session = backplane.InferenceSession(blob, backends=["CpuRef"])
            feeds, why = feeds_for(session)
            if feeds is None:
                return {"kind": "loaded", "detail": why}
            stage = "run"
            post(feeds if sum(_nbytes(v) for v in feeds.values()) <= MAX_SENT_BYTES else None)
            outputs = session.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - classified here
            kind = "error" if isinstance(exc, own) else "bad-exception"
            if kind == "error" and not str(exc).strip():
                kind = "empty-message"
            return {"kind": kind, "error": type(exc).__name__, "message": str(exc)[:2000],
                    "detail": f"at {stage}:\n{traceback.format_exc()[-6000:]}"}
        sent = [o if _nbytes(o) <= MAX_SENT_BYTES else None for o in outputs]
        return {"kind": "ran", "feeds": feeds, "outputs": sent}
    return work


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _ort_work(blob: bytes, feeds: dict[str, Any] | None) -> Callable[[Callable[[Any], None]], dict[str, Any]]:
    def work(post: Callable[[Any], None]) -> dict[str, Any]:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 4
        try:
            session = ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
            if feeds is None:
                return {"ran": False}
            names = [o.name for o in session.get_outputs()]
            given = {i.name for i in (*session.get_inputs(),  # and inputs' defaults, fed
                                      *session.get_overridable_initializers())}
            outputs = session.run(names, {k: v for k, v in feeds.items() if k in given})
        except Exception as exc:  # noqa: BLE001 - ORT refusing is an answer
            return {"refused": f"{type(exc).__name__}: {str(exc)[:300]}"}
        return {"ran": True, "outputs": outputs}
    return work


def compare(ours: Sequence[Any], theirs: Sequence[Any]) -> str:
    """'' where the outputs agree within RTOL (relative to each output's scale), else what differs."""
    if len(ours) != len(theirs):
        return f"{len(ours)} outputs, ORT gives {len(theirs)}"
    for k, (a, b) in enumerate(zip(ours, theirs)):
        if a is None:  # too large to send back
            continue
        if isinstance(b, list) or isinstance(a, list):
            if not isinstance(a, list) or not isinstance(b, list):
                return f"output {k}: {type(a).__name__}, ORT gives {type(b).__name__}"
            problem = compare(a, b)
            if problem:
                return f"output {k}: {problem}"
            continue
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return f"output {k}: shape {a.shape}, ORT gives {b.shape}"
        if a.dtype != b.dtype:
            return f"output {k}: dtype {a.dtype}, ORT gives {b.dtype}"
        if a.dtype.kind in "OUSb" or a.dtype.kind in "iu":
            if not np.array_equal(a, b):
                return f"output {k}: values differ ({a.ravel()[:6]} vs {b.ravel()[:6]})"
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(b64)
        if not np.array_equal(np.isnan(a64), np.isnan(b64)) or \
                not np.array_equal(a64[~finite & ~np.isnan(b64)], b64[~finite & ~np.isnan(b64)]):
            return f"output {k}: non-finite values differ"
        scale = float(np.max(np.abs(b64[finite]))) if finite.any() else 0.0
        error = float(np.max(np.abs(a64[finite] - b64[finite]))) if finite.any() else 0.0
        if error > RTOL * max(scale, 1e-6) + 1e-7:
            return f"output {k}: max |diff| {error:.3g} at scale {scale:.3g}"
    return ""


def run_case(blob: bytes, timeout: float = 20.0, memory: int = MEMORY_BUDGET,
             ort_always: bool = False) -> Outcome:
    """One mutant through backplane, then (where backplane ran it, or always) through ORT. A run
    that does not end is a finding unless ORT's does not end either (a model that loops for ages)."""
    start = time.monotonic()
    status, result, growth, feeds = _in_child(_backplane_work(blob), timeout, memory)
    seconds = time.monotonic() - start
    if status == "hang":
        outcome = Outcome("hang", detail=f"no answer within {timeout} s "
                                         f"({'running' if feeds is not None else 'loading'})",
                          seconds=seconds)
        if feeds is not None:  # loaded: does ORT end on the same inputs?
            ort_status, theirs, _, _ = _in_child(_ort_work(blob, feeds), timeout, memory)
            outcome.ort = ort_status if ort_status != "ok" else \
                "ran" if theirs.get("ran") else f"refused: {theirs.get('refused', '')}"
            if ort_status == "hang":
                outcome.kind = "hang, ORT too"
        return outcome
    if status == "crash":
        return Outcome("crash", detail=str(result), seconds=seconds)
    outcome = Outcome(result["kind"], result.get("error", ""), result.get("message", ""),
                      result.get("detail", ""), seconds=seconds, growth=growth)
    if growth > GROWTH_LIMIT and not outcome.finding:
        outcome.kind, outcome.detail = "blow-up", f"resident memory grew by {growth >> 20} MiB"
        return outcome
    if outcome.kind != "ran" and not (ort_always and outcome.kind in ("error", "loaded")):
        return outcome
    status, theirs, _, _ = _in_child(_ort_work(blob, result.get("feeds", feeds)), timeout, memory)
    if status != "ok":
        outcome.ort = status
    elif "refused" in theirs:
        outcome.ort = f"refused: {theirs['refused']}"
    elif not theirs["ran"]:  # no inputs to run it on: backplane refused it at load
        outcome.ort = "loaded"
    else:
        outcome.ort = "ran"
        if outcome.kind == "ran" and theirs["ran"]:
            problem = compare(result["outputs"], theirs["outputs"])
            if problem:
                outcome.kind, outcome.detail = "mismatch", problem
    return outcome


def summarize(results: Sequence[tuple[Case, Outcome]]) -> Counter:
    counts: Counter = Counter()
    for _, outcome in results:
        if outcome.kind == "error":
            counts[f"error {outcome.error}"] += 1
            if outcome.ort in ("ran", "loaded"):
                counts[f"(backplane refused, ORT {outcome.ort})"] += 1
        elif outcome.kind == "ran":
            counts["ran, matches ORT" if outcome.ort == "ran" else f"ran, ORT {outcome.ort.split(':')[0]}"] += 1
        else:
            counts[outcome.kind] += 1
    return counts


def fuzz(seed: int, count: int, timeout: float = 20.0, ort_always: bool = False,
         progress: Callable[[Case, Outcome], None] | None = None) -> list[tuple[Case, Outcome]]:
    results = []
    for case in generate(seed, count):
        outcome = run_case(case.blob, timeout, ort_always=ort_always)
        results.append((case, outcome))
        if progress:
            progress(case, outcome)
    return results


def describe(case: Case, outcome: Outcome) -> str:
    return (f"case {case.index} of seed model '{case.seed_name}' ({'; '.join(case.mutations)}): "
            f"{outcome.kind} {outcome.error} {outcome.message[:300]}\n{outcome.detail[-3000:]}")


# -- the CI slice -------------------------------------------------------------------------------------

CI_SEED = 20240510
CI_CASES = 300


@pytest.mark.parametrize("name", sorted(HAND_MADE) + [p.stem for p in SEED_FILES])
def test_every_seed_model_runs_and_matches_ort(name: str) -> None:
    """The seeds themselves: loaded, run on zeros and equal to ORT, so a mutant's failure is its own."""
    model = seed_models()[name]
    outcome = run_case(model.SerializeToString(), timeout=60)
    assert outcome.kind == "ran", describe(Case(0, name, [], b""), outcome)
    assert outcome.ort == "ran", outcome.ort


def test_the_harness_tells_findings_from_answers() -> None:
    """An own error with a message is an answer; a crash, a hang or memory past the limit is not."""
    status, result, _, _ = _in_child(_backplane_work(b"\x08"), 20, MEMORY_BUDGET)  # not a model
    assert status == "ok" and result["kind"] == "error" and result["error"] == "ModelError"
    assert _in_child(lambda post: os.kill(os.getpid(), signal.SIGSEGV), 10, MEMORY_BUDGET)[0] == "crash"
    status, _, _, posted = _in_child(lambda post: (post("loaded"), time.sleep(30)), 0.5, MEMORY_BUDGET)
    assert (status, posted) == ("hang", "loaded")
    assert _in_child(lambda post: bytearray(3 << 30), 10, MEMORY_BUDGET)[0] == "crash"  # MemoryError
    assert compare([np.ones(3, np.float32)], [np.ones(3, np.float32) * (1 + 1e-3)])
    assert not compare([np.ones(3, np.float32)], [np.ones(3, np.float32) * (1 + 1e-6)])
    assert compare([np.ones(3, np.float32)], [np.ones(3, np.float64)])  # dtype


def test_generation_is_deterministic() -> None:
    first = [(c.seed_name, c.mutations, c.blob) for c in generate(7, 20)]
    assert first == [(c.seed_name, c.mutations, c.blob) for c in generate(7, 20)]


@pytest.mark.slow  # a few hundred mutants, a forked child each: `python -m pytest -m slow`
def test_fuzz_slice() -> None:
    """A fixed seed and a few hundred mutants: every one an own error with a message or a right run."""
    results = fuzz(CI_SEED, CI_CASES, timeout=20)
    findings = [describe(case, outcome) for case, outcome in results if outcome.finding]
    assert not findings, f"{len(findings)} findings:\n\n" + "\n\n".join(findings[:5])
    counts = summarize(results)
    # the mutants must reach every stage: refused at import, loaded and run, compared with ORT
    assert counts["error ModelError"] >= CI_CASES // 10, counts
    assert counts["ran, matches ORT"] >= CI_CASES // 20, counts
    assert sum(v for k, v in counts.items() if k.startswith("error ") and k != "error ModelError") \
        >= 5, counts
