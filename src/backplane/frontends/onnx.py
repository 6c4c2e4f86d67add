"""ONNX ModelProto -> Graph.

Opsets 7 to the newest the installed onnx knows; initializers and Constant nodes become constants;
external data is read from beside the model file; local functions are inlined; If / Loop / Scan
bodies become sub-Graphs in the layer's attributes. Symbolic dimensions can be bound from the shapes
of the inputs the user will give. Every problem is a ModelError that names the node, its op and opset.
Reading the file (its large weights apart from the proto) is ``onnx_file.py``; ONNX's own shape
inference over the model, ``onnx_shapes.py``; each node against its schema, ``onnx_checks.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from onnx import GraphProto, ModelProto, NodeProto

from backplane.frontends.onnx_file import (  # noqa: F401  # ModelError, load_model: from here too
    ModelError, ReadModel, load_model, read_model)
from backplane.frontends.onnx_checks import check_arity, check_attributes, check_input_types
from backplane.frontends.onnx_contrib import (
    CONTRIB_DOMAIN, ONNX_EQUIVALENTS, annotate_ort_types, check_ort_node, is_ort_op, known_ops)
from backplane.frontends.onnx_layouts import unfold_layouts
from backplane.frontends.onnx_shapes import copy_model, infer_shapes
from backplane.frontends.onnx_types import attribute_value, onnx_to_numpy_dtype, tensor_to_array
from backplane.ir.graph import Dim, Graph, Layer, TensorInfo

MIN_OPSET = 1  # kernels are versioned; an old op they cannot run is refused by name
DEFAULT_DOMAINS = ("", "ai.onnx")


def max_opset() -> int:
    return onnx.defs.onnx_opset_version()


def import_onnx(model: str | os.PathLike | bytes | ModelProto | ReadModel,
                input_shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """Import an ONNX model as a Graph; ``input_shapes`` binds symbolic input dimensions. A model
    read by ``read_model`` gives its arrays to the graph (its ``arrays`` are emptied)."""
    read = read_model(model)
    proto, arrays = read.proto, read.arrays
    read.arrays = {}
    opsets = _check_opsets(proto)
    _check_messages(proto, from_path=read.base_dir is not None)
    if proto.functions:
        proto = _inline_functions(proto)
    proto = unfold_layouts(proto)  # ONNX Runtime's channels-last ops, as ONNX's
    if input_shapes:
        proto = _bind_input_shapes(proto, input_shapes)
    proto, weights, refusal = infer_shapes(proto)
    for _ in proto.graph.node:  # ONNX Runtime's ops typed from their inputs, then onward
        if not annotate_ort_types(proto):
            break
        proto, more, refusal = infer_shapes(proto)
        weights.update(more)
    importer = _Importer(opsets, proto.functions)
    graph = importer.graph(proto.graph, top_level=True, weights=weights, arrays=arrays)
    if refusal:
        raise ModelError(f"ONNX's type and shape inference refuses the model: {refusal}")
    return graph


def _check_opsets(proto: ModelProto) -> dict[str, int]:
    if not proto.HasField("graph"):
        raise ModelError("the model has no graph")
    opsets: dict[str, int] = {}
    for entry in proto.opset_import:
        domain = "" if entry.domain in DEFAULT_DOMAINS else entry.domain
        if not isinstance(domain, str):
            raise ModelError(f"an opset_import's domain is not valid UTF-8 text: {domain!r}")
        version = int(entry.version)
        if domain and not 1 <= version <= MAX_VERSION:  # the default domain's range comes below
            raise ModelError(f"the model imports opset {version} of domain '{domain or 'ai.onnx'}'; "
                             f"an opset version is a number from 1 to {MAX_VERSION}")
        if opsets.get(domain, version) != version:
            raise ModelError(f"the model imports domain '{domain or 'ai.onnx'}' twice, at opsets "
                             f"{opsets[domain]} and {version}")
        opsets[domain] = version
    if "" not in opsets:
        return opsets  # a node of the default domain is then refused by name (no opset_import)
    default = opsets[""]
    if not MIN_OPSET <= default <= max_opset():
        raise ModelError(f"the model uses opset {default} of the default ONNX domain; "
                         f"supported opsets are {MIN_OPSET} to {max_opset()}")
    return opsets


MAX_VERSION = 2**31 - 1  # onnx's schema lookup takes a C int
MAX_INLINED_NODES = 1_000_000  # local functions calling each other several times grow exponentially
MAX_FUNCTION_DEPTH = 64


def _check_messages(proto: ModelProto, from_path: bool) -> None:
    """Every text field is UTF-8 (protobuf hands back bytes where it is not, and names must be text),
    and no tensor still keeps its data in an external file (read at load only beside a model file)."""
    stack: list[tuple[Message, str]] = [(proto, "model")]
    while stack:
        message, path = stack.pop()
        for field, value in message.ListFields():
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                single = isinstance(value, Message)
                for k, item in enumerate([value] if single else value):
                    name = getattr(item, "name", "")
                    label = f" '{name}'" if isinstance(name, str) and name else ""
                    where = f"{path}.{field.name}" + ("" if single else f"[{k}]")
                    stack.append((item, where + label))
            elif field.type == FieldDescriptor.TYPE_STRING:
                for text in ([value] if isinstance(value, (str, bytes)) else value):
                    if isinstance(text, bytes):
                        raise ModelError(f"{path}: its field '{field.name}' is not valid UTF-8 text: "
                                         f"{text[:80]!r}")
        if isinstance(message, onnx.TensorProto) and message.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in message.external_data}.get("location", "")
            how = ("it was not read beside the model file" if from_path else
                   "external data is read only for a model loaded from its path")
            raise ModelError(f"{path}: tensor '{message.name}' keeps its data in the external file "
                             f"'{where}'; {how}")


def _inline_functions(proto: ModelProto) -> ModelProto:
    """The model with its local functions inlined; a malformed or recursive function, or one that
    would inline to more than MAX_INLINED_NODES nodes, is a ModelError naming it."""
    functions = {(f.domain, f.name): f for f in proto.functions}
    sizes: dict[tuple[str, str], int] = {}
    visiting: set[tuple[str, str]] = set()

    def size(nodes: Sequence[NodeProto]) -> int:
        total = 0
        for node in nodes:
            key = (node.domain, node.op_type)
            if key in functions:
                if key in visiting:
                    raise ModelError(f"local function '{node.domain}::{node.op_type}' calls itself")
                if len(visiting) >= MAX_FUNCTION_DEPTH:
                    raise ModelError(f"local function '{node.domain}::{node.op_type}' is called "
                                     f"{MAX_FUNCTION_DEPTH} functions deep; that is the most")
                if key not in sizes:
                    visiting.add(key)
                    sizes[key] = size(functions[key].node)
                    visiting.discard(key)
                total += sizes[key]
            else:
                total += 1
            for attr in node.attribute:
                for graph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    total += size(graph.node)
            if total > MAX_INLINED_NODES:
                raise ModelError(f"the model's local functions would inline to more than "
                                 f"{MAX_INLINED_NODES} nodes")
        return total

    size(proto.graph.node)
    try:
        return onnx.inliner.inline_local_functions(proto)
    except Exception as exc:  # onnx's C++ checks: a function called with more inputs than it has, ...
        raise ModelError(f"the model's local functions cannot be inlined: {exc}") from exc


def _bind_input_shapes(proto: ModelProto, shapes: Mapping[str, Sequence[int]]) -> ModelProto:
    proto = copy_model(proto)
    for vi in proto.graph.input:
        if vi.name not in shapes or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        given = list(shapes[vi.name])
        if len(dims) != len(given):
            continue  # the run-time check reports the rank mismatch with the full context
        for dim, size in zip(dims, given):
            if not dim.HasField("dim_value"):
                dim.Clear()
                dim.dim_value = int(size)
    return proto


UNKNOWN_DIM_NAMES = frozenset({"?", "-1", "None", "unk", "unknown"})
"""``dim_param`` values that exporters write for "any size" (Paddle writes ``?`` for every free
height and width): each such dimension is free on its own. A real name (``batch``, ``N``) binds
every dimension that bears it to one size, as ONNX says; ONNX Runtime checks neither, and runs a
``[-1, 3, '?', '?']`` input of 48x192, which this name-binding refused."""


def _tensor_info(type_proto: onnx.TypeProto) -> TensorInfo:
    if not type_proto.HasField("tensor_type"):
        return TensorInfo(None, None)
    tensor = type_proto.tensor_type
    dtype = onnx_to_numpy_dtype(tensor.elem_type)
    if not tensor.HasField("shape"):
        return TensorInfo(None, dtype)
    dims: list[Dim] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value >= 0:
            dims.append(int(dim.dim_value))
        elif dim.dim_param in UNKNOWN_DIM_NAMES:  # "unknown", not a name two sizes share
            dims.append(None)
        else:  # a name, nothing, or a negative size (some exporters write -1): free, as in ORT
            dims.append(dim.dim_param or None)
    return TensorInfo(tuple(dims), dtype)


class _Importer:
    def __init__(self, opsets: dict[str, int], functions: Sequence[onnx.FunctionProto] = ()) -> None:
        self.opsets = opsets
        self.names: set[str] = set()
        self.functions = {(f.domain, f.name): f for f in functions}  # those left after inlining

    def graph(self, g: GraphProto, top_level: bool = False,
              weights: Mapping[str, onnx.TensorProto] | None = None,
              outer: frozenset[str] = frozenset(),
              arrays: Mapping[str, np.ndarray] | None = None) -> Graph:
        """Import ``g``; ``outer``: the names of the enclosing graphs a sub-graph may read;
        ``arrays``: initializers already read (``read_model``), whose tensors hold no data."""
        where = "the graph" if top_level else f"sub-graph '{g.name}'"
        scope = outer | _check_definitions(g, where, weights or {})
        tensors: dict[str, TensorInfo] = {}
        for vi in (*g.value_info, *g.output):
            tensors[vi.name] = _tensor_info(vi.type)
        for vi in g.input:
            tensors[vi.name] = _input_info(vi, where) if top_level else _tensor_info(vi.type)
        constants: dict[str, np.ndarray] = {}
        for init in (*g.initializer, *(weights or {}).values()):
            read = (arrays or {}).get(init.name)
            constants[init.name] = self._initializer(init) if read is None else read
            tensors[init.name] = TensorInfo(constants[init.name].shape, constants[init.name].dtype)
        layers: list[Layer] = []
        for index, node in enumerate(g.node):
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and len(node.output) == 1:
                value = self._constant(node, index, scope)
                constants[node.output[0]] = value
                tensors[node.output[0]] = TensorInfo(value.shape, value.dtype)
            else:
                layers.append(self.layer(node, index, scope))
        inputs = [vi.name for vi in g.input if vi.name not in constants]
        graph = Graph(g.name or "main", layers, inputs, [vi.name for vi in g.output], tensors,
                      constants, dict(self.opsets))
        self._check_reads(graph, outer, where)
        for layer in graph.layers:
            check_input_types(layer, graph)
        return graph

    def _initializer(self, init: onnx.TensorProto) -> np.ndarray:
        try:
            return tensor_to_array(init)
        except Exception as exc:
            raise ModelError(f"initializer '{init.name}' cannot be read: {exc}") from exc

    def _constant(self, node: NodeProto, index: int, scope: frozenset[str]) -> np.ndarray:
        layer = self.layer(node, index, scope)
        values = [key for key in layer.attrs if key in CONSTANT_VALUES]
        if len(values) != 1:
            raise ModelError(f"{layer.describe()} has {len(values)} value attributes "
                             f"({', '.join(values) or 'none'}); a Constant has exactly one")
        key, value = values[0], layer.attrs[values[0]]
        return np.asarray(value) if CONSTANT_VALUES[key] is None \
            else np.array(value, dtype=CONSTANT_VALUES[key])

    def layer(self, node: NodeProto, index: int, scope: frozenset[str] = frozenset()) -> Layer:
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        opset = self.opsets.get(domain)
        name = self._unique_name(node.name or f"{node.op_type}_{index}")
        where = f"node '{name}' ({node.op_type}, opset {opset})"
        if opset is None:
            raise ModelError(f"{where}: its domain '{domain}' has no opset_import in the model; "
                             f"the model imports {sorted(self.opsets)}")
        function = self.functions.get((node.domain, node.op_type))
        if function is not None:  # onnx's inliner leaves a function whose opsets differ
            differ = []
            for entry in function.opset_import:
                ours = self.opsets.get("" if entry.domain in DEFAULT_DOMAINS else entry.domain)
                if ours != entry.version:
                    differ.append(f"{entry.domain or 'ai.onnx'}: {entry.version} in the function, "
                                  f"{ours} in the model")
            raise ModelError(f"{where}: calls local function '{node.domain}::{node.op_type}', which "
                             f"could not be inlined, its opsets differing from the model's "
                             f"({'; '.join(differ) or 'none differ'})")
        if is_ort_op(domain, node.op_type, opset):  # no onnx schema: onnx_contrib's arity
            refusal = check_ort_node(domain, node.op_type, opset, len(node.input), len(node.output))
            if refusal:
                raise ModelError(f"{where}: {refusal}")
            if (domain, node.op_type) in ONNX_EQUIVALENTS:  # imported as ONNX's op
                domain, opset = "", ONNX_EQUIVALENTS[domain, node.op_type]
                check_attributes(node, onnx.defs.get_schema(node.op_type, opset), where,
                                  f"{node.op_type}-{opset}")
        elif not node.op_type or not onnx.defs.has(node.op_type, domain):
            known = f"; backplane knows these: {known_ops(domain)}" if domain == CONTRIB_DOMAIN else ""
            raise ModelError(f"{where}: unknown op '{node.op_type}' in domain "
                             f"'{domain or 'ai.onnx'}'{known}")
        else:
            try:
                schema = onnx.defs.get_schema(node.op_type, opset, domain)
            except onnx.defs.SchemaError as exc:
                raise ModelError(f"{where}: the op does not exist at opset {opset}") from exc
            op = f"{node.op_type}-{schema.since_version}"
            check_arity(node, schema, where, op)
            check_attributes(node, schema, where, op)
        try:
            attrs: dict[str, Any] = {
                a.name: attribute_value(a, lambda g: self.graph(g, outer=scope))
                for a in node.attribute}
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"{where}: an attribute cannot be read: {exc}") from exc
        layer = Layer(name, node.op_type, list(node.input), list(node.output), attrs, domain, opset)
        if node.op_type == "Loop" and not domain and not any(layer.inputs[:2]):
            raise ModelError(f"{where}: neither a trip count (M) nor a condition (cond) is given, "
                             f"so the loop never ends")
        return layer

    def _unique_name(self, name: str) -> str:
        unique, k = name, 1
        while unique in self.names:
            unique, k = f"{name}_{k}", k + 1
        self.names.add(unique)
        return unique

    @staticmethod
    def _check_reads(graph: Graph, outer: frozenset[str], where: str) -> None:
        """Every name read is defined in the graph or (a sub-graph) in an enclosing one, the outputs
        are produced, and the layers are ordered: by their inputs and what their bodies read."""
        available = set(graph.inputs) | set(graph.constants) | outer
        available |= {o for layer in graph.layers for o in layer.outputs}
        for layer in graph.layers:
            absent = [name for name in layer.inputs if name and name not in available]
            if absent:
                raise ModelError(f"{layer.describe()} reads {absent}, which no node, input or "
                                 f"initializer of {where} provides")
        missing = [o for o in graph.outputs if o not in available]
        if missing:
            raise ModelError(f"{where}'s output(s) {missing} are produced by no node")
        try:
            graph.toposort(_reads)
        except ValueError as exc:
            raise ModelError(f"{where}: {exc}") from exc


CONSTANT_VALUES: dict[str, Any] = {
    "value": None, "sparse_value": None, "value_float": np.float32, "value_int": np.int64,
    "value_string": object, "value_floats": np.float32, "value_ints": np.int64,
    "value_strings": object}
"""A Constant's value attributes and the dtype of the array each gives (None: the tensor's own)."""


def _reads(layer: Layer) -> list[str]:
    """What a layer reads: its inputs, and the outer names its bodies read (their captures)."""
    bodies = [v for value in layer.attrs.values()
              for v in (value if isinstance(value, list) else [value]) if isinstance(v, Graph)]
    return [*layer.inputs, *(name for body in bodies for name in _free_names(body))]


def _free_names(graph: Graph) -> set[str]:
    defined = set(graph.inputs) | set(graph.constants)
    defined |= {o for layer in graph.layers for o in layer.outputs if o}
    read = {n for layer in graph.layers for n in _reads(layer) if n} | set(graph.outputs)
    return read - defined


def _check_definitions(g: GraphProto, where: str, weights: Mapping[str, onnx.TensorProto]) -> set[str]:
    """Each name is defined once in ``g`` (static single assignment): by an input, an initializer
    (which may also be declared an input, its default), or one node's output. Returns the names."""
    defined: dict[str, str] = {}

    def define(name: str, what: str) -> None:
        if name in defined:
            raise ModelError(f"{where}: '{name}' is defined twice, as {defined[name]} and as {what}")
        defined[name] = what

    for init in (*g.initializer, *weights.values()):
        if not init.name:
            raise ModelError(f"{where}: an initializer has no name")
        define(init.name, "an initializer")
    initializers = set(defined)
    for vi in g.input:
        if not vi.name:
            raise ModelError(f"{where}: an input has no name")
        if vi.name in initializers:
            initializers.discard(vi.name)  # an input with a default; declared once only
            continue
        define(vi.name, "an input")
    for k, node in enumerate(g.node):
        for out in node.output:
            if out:
                define(out, f"an output of node '{node.name or f'{node.op_type}_{k}'}' "
                            f"({node.op_type})")
    return set(defined)


def _input_info(vi: onnx.ValueInfoProto, where: str) -> TensorInfo:
    """A graph input's type: a tensor of an element type backplane reads, or another kind."""
    if not vi.HasField("type") or vi.type.WhichOneof("value") is None:
        raise ModelError(f"{where}: input '{vi.name}' has no type")
    if vi.type.HasField("tensor_type"):
        elem = vi.type.tensor_type.elem_type
        if onnx_to_numpy_dtype(elem) is None:
            raise ModelError(f"{where}: input '{vi.name}' has element type {_elem_type(elem)}, "
                             f"which backplane cannot read")
    return _tensor_info(vi.type)


def _elem_type(elem: int) -> str:
    try:
        return f"{onnx.TensorProto.DataType.Name(elem)} ({elem})"
    except ValueError:
        return f"{elem} (not an ONNX element type)"
