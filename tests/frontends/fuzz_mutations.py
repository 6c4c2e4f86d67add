"""The loader fuzzer's mutations (tests/frontends/test_fuzz_loader.py): by fields (dims, names,
dtypes, domains, opsets, attributes, duplicate outputs, cycles, empty graphs, initializers whose data
disagrees with their dims, ...) and by bytes of the serialized protobuf."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper


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


