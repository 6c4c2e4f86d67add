"""ONNX ModelProto -> Graph.

Opsets 7 to the newest the installed onnx knows; initializers and Constant nodes become constants;
external data is read from beside the model file; local functions are inlined; If / Loop / Scan
bodies become sub-Graphs in the layer's attributes. Symbolic dimensions can be bound from the shapes
of the inputs the user will give. Every problem is a ModelError that names the node, its op and opset.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from onnx import GraphProto, ModelProto, NodeProto

from backplane.frontends.onnx_types import attribute_value, onnx_to_numpy_dtype, tensor_to_array
from backplane.ir.graph import Dim, Graph, Layer, TensorInfo

MIN_OPSET = 1  # kernels are versioned; an old op they cannot run is refused by name
DEFAULT_DOMAINS = ("", "ai.onnx")


class ModelError(ValueError):
    """The model cannot be imported: malformed, an unknown op, an unsupported opset."""


def max_opset() -> int:
    return onnx.defs.onnx_opset_version()


def load_model(model: str | os.PathLike | bytes | ModelProto) -> tuple[ModelProto, str | None]:
    """Parse a model from a path, bytes or a ModelProto; external data is loaded from its folder."""
    if isinstance(model, ModelProto):
        return model, None
    if isinstance(model, bytes):
        try:
            return onnx.load_model_from_string(model), None
        except Exception as exc:  # protobuf raises DecodeError and others
            raise ModelError(f"the bytes given are not an ONNX model: {exc}") from exc
    path = os.fspath(model)
    if os.path.isdir(path):
        raise ModelError(f"'{path}' is a directory: give the model's .onnx file")
    if not os.path.isfile(path):
        raise ModelError(f"model file '{path}' does not exist")
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as exc:
        raise ModelError(f"'{path}' is not a readable ONNX model: {exc}") from exc
    base_dir = os.path.dirname(os.path.abspath(path))
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, base_dir)
    except Exception as exc:  # OSError, onnx's ValidationError for a missing or unsafe file
        raise ModelError(f"'{path}': its external data could not be read: {exc}") from exc
    return proto, base_dir


def import_onnx(model: str | os.PathLike | bytes | ModelProto,
                input_shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """Import an ONNX model as a Graph; ``input_shapes`` binds symbolic input dimensions."""
    proto, base_dir = load_model(model)
    opsets = _check_opsets(proto)
    _check_messages(proto, from_path=base_dir is not None)
    if proto.functions:
        proto = _inline_functions(proto)
    if input_shapes:
        proto = _bind_input_shapes(proto, input_shapes)
    proto, weights, refusal = _infer_shapes(proto)
    importer = _Importer(opsets, proto.functions)
    graph = importer.graph(proto.graph, top_level=True, weights=weights)
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
    proto = _copy(proto)
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


def _copy(proto: ModelProto) -> ModelProto:
    copy = ModelProto()
    copy.CopyFrom(proto)
    return copy


LARGE_INITIALIZER = 1024  # elements; shape inference needs only the shapes of larger ones


def _infer_shapes(proto: ModelProto) -> tuple[ModelProto, dict[str, onnx.TensorProto], str | None]:
    """Infer shapes on a copy of the model without its large weights (inference serializes the model:
    on BERT-base that was 4 s of 5), its nodes in order. Returns the annotated copy, the weights it
    left out, and where ONNX's own inference functions refuse a node (as ONNX Runtime, which runs
    them, refuses such a model), else None: raised after the importer's own checks, which name
    problems better. Shapes the model declares for its intermediate tensors that its ops contradict
    are dropped, not trusted; a model is not refused for them (ORT only warns)."""
    light, weights = _without_large_initializers(proto)
    light = _for_inference(light, proto)
    infer = onnx.shape_inference.infer_shapes
    try:
        return infer(light, strict_mode=True, data_prop=True), weights, None
    except Exception:  # noqa: BLE001 - which of the reasons below?
        pass
    try:  # data propagation trips on some models where plain inference works
        infer(light, strict_mode=True)
        return _infer_leniently(light), weights, None
    except Exception:  # noqa: BLE001
        pass
    undeclared = _copy(light)  # the shapes of the model's ops alone: do they refuse a node?
    undeclared.graph.ClearField("value_info")
    for vi in undeclared.graph.output:
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    try:
        infer(undeclared, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:
        refusal = str(exc)
        if refusal.count("Inference error(s)") == 1:  # not from inside a function body, where
            # onnx's inference errs on valid models (MeanVarianceNormalization's at opset 7)
            return _infer_leniently(light), weights, refusal
        return _infer_leniently(light), weights, None
    except Exception:  # noqa: BLE001 - not an inference function's refusal: as before
        return _infer_leniently(light), weights, None
    without = _copy(light)  # the ops are fine with each other; the declared shapes are not
    without.graph.ClearField("value_info")
    return _infer_leniently(without), weights, None


def _infer_leniently(light: ModelProto) -> ModelProto:
    infer = onnx.shape_inference.infer_shapes
    try:
        return infer(light, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001
        try:
            return infer(light, strict_mode=False)
        except Exception:  # noqa: BLE001
            return light  # shapes stay unknown; kernels do not need them


def _for_inference(light: ModelProto, original: ModelProto) -> ModelProto:
    """``light`` with every graph's nodes in topological order (ONNX's inference reads them in the
    order given, as ONNX Runtime's does only after sorting) and the domain 'ai.onnx' written ''
    (which inference does not read as the default). A copy where anything changes."""
    def needs(graph: GraphProto) -> bool:
        if any(node.domain == "ai.onnx" for node in graph.node):
            return True
        if _sorted_nodes(graph) != list(range(len(graph.node))):
            return True
        return any(needs(g) for node in graph.node for a in node.attribute
                   for g in ([a.g] if a.HasField("g") else []) + list(a.graphs))

    def fix(graph: GraphProto) -> None:
        order = _sorted_nodes(graph)
        nodes = [graph.node[k] for k in order]
        graph.ClearField("node")
        graph.node.extend(nodes)
        for node in graph.node:
            if node.domain == "ai.onnx":
                node.domain = ""
            for a in node.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    fix(g)

    if not needs(light.graph) and not any(o.domain == "ai.onnx" for o in light.opset_import):
        return light
    light = _copy(light) if light is original else light
    fix(light.graph)
    for entry in light.opset_import:
        if entry.domain == "ai.onnx":
            entry.domain = ""
    return light


def _sorted_nodes(graph: GraphProto) -> list[int]:
    """The indices of ``graph``'s nodes in a topological order that keeps the given one where it can
    (a node after the producers of its inputs and of the outer names its sub-graphs read); the
    given order where there is a cycle, which the importer then names."""
    producer = {out: k for k, node in enumerate(graph.node) for out in node.output if out}
    reads = [[*node.input, *_outer_reads(node)] for node in graph.node]
    order: list[int] = []
    state = [0] * len(graph.node)  # 0 new, 1 on the stack, 2 done
    for root in range(len(graph.node)):
        if state[root]:
            continue
        stack = [(root, iter(reads[root]))]
        state[root] = 1
        while stack:
            k, pending = stack[-1]
            for name in pending:
                dep = producer.get(name)
                if dep is None or state[dep] == 2:
                    continue
                if state[dep] == 1:
                    return list(range(len(graph.node)))  # a cycle
                state[dep] = 1
                stack.append((dep, iter(reads[dep])))
                break
            else:
                stack.pop()
                state[k] = 2
                order.append(k)
    return order


def _outer_reads(node: NodeProto) -> set[str]:
    """The names a node's sub-graphs read that they do not define themselves."""
    names: set[str] = set()
    for attr in node.attribute:
        for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            defined = {vi.name for vi in g.input} | {i.name for i in g.initializer}
            defined |= {o for n in g.node for o in n.output}
            read = {i for n in g.node for i in (*n.input, *_outer_reads(n))} | {o.name for o in g.output}
            names |= read - defined
    return names


def _without_large_initializers(proto: ModelProto) -> tuple[ModelProto, dict[str, onnx.TensorProto]]:
    large = [init for init in proto.graph.initializer if math.prod(init.dims) > LARGE_INITIALIZER]
    if not large:
        return proto, {}
    light = ModelProto(ir_version=proto.ir_version)  # what inference reads, without the weights
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    graph, light_graph = proto.graph, light.graph
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(light_graph, field).extend(getattr(graph, field))
    light_graph.name, light_graph.doc_string = graph.name, graph.doc_string
    names = {init.name for init in large}
    light_graph.initializer.extend(i for i in graph.initializer if i.name not in names)
    declared = {vi.name for vi in graph.input}
    for init in large:  # a weight becomes an input of its type and shape, for inference only
        if init.name not in declared:
            light_graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type,
                                                                         list(init.dims)))
    return light, {init.name: init for init in large}


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
              outer: frozenset[str] = frozenset()) -> Graph:
        """Import ``g``; ``outer``: the names of the enclosing graphs a sub-graph may read."""
        where = "the graph" if top_level else f"sub-graph '{g.name}'"
        scope = outer | _check_definitions(g, where, weights or {})
        tensors: dict[str, TensorInfo] = {}
        for vi in (*g.value_info, *g.output):
            tensors[vi.name] = _tensor_info(vi.type)
        for vi in g.input:
            tensors[vi.name] = _input_info(vi, where) if top_level else _tensor_info(vi.type)
        constants: dict[str, np.ndarray] = {}
        for init in (*g.initializer, *(weights or {}).values()):
            constants[init.name] = self._initializer(init)
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
            _check_input_types(layer, graph)
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
        if not node.op_type or not onnx.defs.has(node.op_type, domain):
            raise ModelError(f"{where}: unknown op '{node.op_type}' in domain "
                             f"'{domain or 'ai.onnx'}'")
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, domain)
        except onnx.defs.SchemaError as exc:
            raise ModelError(f"{where}: the op does not exist at opset {opset}") from exc
        op = f"{node.op_type}-{schema.since_version}"
        _check_arity(node, schema, where, op)
        _check_attributes(node, schema, where, op)
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


def _check_arity(node: NodeProto, schema: onnx.defs.OpSchema, where: str, op: str) -> None:
    """The number of inputs and outputs, and no required input left empty."""
    for kind, count, low, high in (("input", len(node.input), schema.min_input, schema.max_input),
                                   ("output", len(node.output), schema.min_output,
                                    schema.max_output)):
        if not low <= count <= high:
            takes = f"exactly {low}" if low == high else \
                f"at least {low}" if high >= 2**31 - 1 else f"{low} to {high}"
            raise ModelError(f"{where}: {count} {kind}(s); {op} takes {takes}")
    formals = schema.inputs
    for k, name in enumerate(node.input):
        formal = formals[min(k, len(formals) - 1)]
        if not name and formal.option != onnx.defs.OpSchema.FormalParameterOption.Optional:
            raise ModelError(f"{where}: input {k} ('{formal.name}') is empty; {op} requires it")


def _check_input_types(layer: Layer, graph: Graph) -> None:
    """The element types of a layer's inputs, where known, are those its op takes, and the inputs
    of one type parameter share one type (ONNX Runtime refuses the model otherwise; NumPy would
    promote the mixture and run)."""
    schema = onnx.defs.get_schema(layer.op_type, layer.opset, layer.domain)
    formals = schema.inputs
    if not formals:
        return
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, tuple[str, int, str]] = {}
    op = f"{layer.op_type}-{schema.since_version}"
    for k, name in enumerate(layer.inputs):
        dtype = graph.info(name).dtype if name else None
        if dtype is None:
            continue
        formal = formals[min(k, len(formals) - 1)]
        try:
            elem = onnx.helper.np_dtype_to_tensor_dtype(dtype)
        except (KeyError, ValueError, TypeError):
            continue
        type_str = f"tensor({onnx.TensorProto.DataType.Name(elem).lower()})"
        takes = allowed.get(formal.type_str, {formal.type_str})
        if type_str not in takes:
            raise ModelError(f"{layer.describe()}: input {k} '{name}' is a {type_str}; {op} takes "
                             f"{', '.join(sorted(takes))} there")
        if not formal.is_homogeneous:
            continue
        first = bound.setdefault(formal.type_str, (type_str, k, name))
        if first[0] != type_str:
            raise ModelError(f"{layer.describe()}: type parameter {formal.type_str} of {op} is "
                             f"bound to {first[0]} by input {first[1]} '{first[2]}' and to "
                             f"{type_str} by input {k} '{name}'")


def _check_attributes(node: NodeProto, schema: onnx.defs.OpSchema, where: str, op: str) -> None:
    """Attributes the op has, each once and of its type; the required ones present."""
    unknown = [a.name for a in node.attribute if a.name not in schema.attributes]
    if unknown:  # a kernel would bind them over its inputs
        raise ModelError(f"{where}: attribute(s) {unknown} are not attributes of {op}; it has "
                         f"{sorted(schema.attributes) or 'none'}")
    seen: set[str] = set()
    for attr in node.attribute:
        if attr.name in seen:
            raise ModelError(f"{where}: attribute '{attr.name}' is given twice")
        seen.add(attr.name)
        if attr.ref_attr_name:
            raise ModelError(f"{where}: attribute '{attr.name}' refers to '{attr.ref_attr_name}', "
                             f"an attribute of a function, outside any function")
        expected = int(schema.attributes[attr.name].type)
        if attr.type != expected:
            raise ModelError(f"{where}: attribute '{attr.name}' is of type "
                             f"{_attribute_type(attr.type)}; {op} takes {_attribute_type(expected)}")
        if attr.name in FLAGS and attr.type == onnx.AttributeProto.INT and attr.i not in (0, 1):
            # a flag of another value means different things to different runtimes (ONNX Runtime
            # reads keepdims=2**40 as 0; a truthy test as 1): refused, not guessed
            raise ModelError(f"{where}: attribute '{attr.name}' is {attr.i}; it is a flag of "
                             f"{op}: 0 or 1")
    missing = [name for name, spec in schema.attributes.items() if spec.required and name not in seen]
    if missing:
        raise ModelError(f"{where}: required attribute(s) {sorted(missing)} of {op} missing")


FLAGS = frozenset({
    "keepdims", "select_last_index", "exclusive", "reverse", "ceil_mode", "count_include_pad",
    "transA", "transB", "noop_with_empty_axes", "detect_negative", "detect_positive", "upper",
    "center_point_box", "sorted", "largest", "onesided", "inverse", "periodic", "allowzero",
    "new_axis", "fmod", "linear_before_reset", "input_forget", "is_causal", "interleaved",
    "storage_order", "align_corners", "saturate", "antialias"})
"""Integer attributes the ONNX operators define as flags, 0 or 1."""


def _attribute_type(kind: int) -> str:
    try:
        return onnx.AttributeProto.AttributeType.Name(kind)
    except ValueError:
        return f"{kind} (not an ONNX attribute type)"


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
