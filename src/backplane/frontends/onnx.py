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
    proto, _ = load_model(model)
    opsets = _check_opsets(proto)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    if input_shapes:
        proto = _bind_input_shapes(proto, input_shapes)
    proto, weights = _infer_shapes(proto)
    importer = _Importer(opsets)
    return importer.graph(proto.graph, top_level=True, weights=weights)


def _check_opsets(proto: ModelProto) -> dict[str, int]:
    if not proto.HasField("graph"):
        raise ModelError("the model has no graph")
    opsets = {(o.domain or ""): int(o.version) for o in proto.opset_import}
    if "ai.onnx" in opsets:
        opsets[""] = opsets.pop("ai.onnx")
    if "" not in opsets:
        return opsets  # a node of the default domain is then refused by name (no opset_import)
    default = opsets[""]
    if not MIN_OPSET <= default <= max_opset():
        raise ModelError(f"the model uses opset {default} of the default ONNX domain; "
                         f"supported opsets are {MIN_OPSET} to {max_opset()}")
    return opsets


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


def _infer_shapes(proto: ModelProto) -> tuple[ModelProto, dict[str, onnx.TensorProto]]:
    """Infer shapes on a copy of the model without its large weights (inference serializes the model:
    on BERT-base that was 4 s of 5). Returns the annotated copy and the weights it left out."""
    light, weights = _without_large_initializers(proto)
    try:
        return onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True), weights
    except Exception:
        try:  # data propagation trips on some models where plain inference still works
            return onnx.shape_inference.infer_shapes(light, strict_mode=False), weights
        except Exception:
            return light, weights  # shapes stay unknown; kernels do not need them


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
    def __init__(self, opsets: dict[str, int]) -> None:
        self.opsets = opsets
        self.names: set[str] = set()

    def graph(self, g: GraphProto, top_level: bool = False,
              weights: Mapping[str, onnx.TensorProto] | None = None) -> Graph:
        tensors: dict[str, TensorInfo] = {}
        for vi in (*g.input, *g.value_info, *g.output):
            tensors[vi.name] = _tensor_info(vi.type)
        constants: dict[str, np.ndarray] = {}
        for init in (*g.initializer, *(weights or {}).values()):
            constants[init.name] = self._initializer(init)
            tensors[init.name] = TensorInfo(constants[init.name].shape, constants[init.name].dtype)
        layers: list[Layer] = []
        for index, node in enumerate(g.node):
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and len(node.output) == 1:
                value = self._constant(node)
                constants[node.output[0]] = value
                tensors[node.output[0]] = TensorInfo(value.shape, value.dtype)
            else:
                layers.append(self.layer(node, index))
        inputs = [vi.name for vi in g.input if vi.name not in constants]
        graph = Graph(g.name or "main", layers, inputs, [vi.name for vi in g.output], tensors,
                      constants, dict(self.opsets))
        if top_level:
            self._check_outputs(graph)
        return graph

    def _initializer(self, init: onnx.TensorProto) -> np.ndarray:
        try:
            return tensor_to_array(init)
        except Exception as exc:
            raise ModelError(f"initializer '{init.name}' cannot be read: {exc}") from exc

    def _constant(self, node: NodeProto) -> np.ndarray:
        layer = self.layer(node, 0)
        for key, value in layer.attrs.items():
            if key == "value" or key == "sparse_value":
                return np.asarray(value)
            if key in ("value_float", "value_int", "value_string"):
                dtype = {"value_float": np.float32, "value_int": np.int64}.get(key, object)
                return np.array(value, dtype=dtype)
            if key in ("value_floats", "value_ints", "value_strings"):
                dtype = {"value_floats": np.float32, "value_ints": np.int64}.get(key, object)
                return np.array(value, dtype=dtype)
        raise ModelError(f"{layer.describe()} has no value attribute")

    def layer(self, node: NodeProto, index: int) -> Layer:
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        opset = self.opsets.get(domain)
        name = self._unique_name(node.name or f"{node.op_type}_{index}")
        where = f"node '{name}' ({node.op_type}, opset {opset})"
        if opset is None:
            raise ModelError(f"{where}: its domain '{domain}' has no opset_import in the model; "
                             f"the model imports {sorted(self.opsets)}")
        if not onnx.defs.has(node.op_type, domain):
            raise ModelError(f"{where}: unknown op '{node.op_type}' in domain "
                             f"'{domain or 'ai.onnx'}'")
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, domain)
        except onnx.defs.SchemaError as exc:
            raise ModelError(f"{where}: the op does not exist at opset {opset}") from exc
        unknown = [a.name for a in node.attribute if a.name not in schema.attributes]
        if unknown:  # a kernel would bind them over its inputs
            raise ModelError(f"{where}: attribute(s) {unknown} are not attributes of "
                             f"{node.op_type}-{schema.since_version}; it has "
                             f"{sorted(schema.attributes) or 'none'}")
        try:
            attrs: dict[str, Any] = {a.name: attribute_value(a, self.graph) for a in node.attribute}
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"{where}: an attribute cannot be read: {exc}") from exc
        return Layer(name, node.op_type, list(node.input), list(node.output), attrs, domain, opset)

    def _unique_name(self, name: str) -> str:
        unique, k = name, 1
        while unique in self.names:
            unique, k = f"{name}_{k}", k + 1
        self.names.add(unique)
        return unique

    @staticmethod
    def _check_outputs(graph: Graph) -> None:
        available = set(graph.inputs) | set(graph.constants)
        available |= {o for layer in graph.layers for o in layer.outputs}
        for layer in graph.layers:
            absent = [name for name in layer.inputs if name and name not in available]
            if absent:
                raise ModelError(f"{layer.describe()} reads {absent}, which no node, input or "
                                 f"initializer of the graph provides")
        missing = [o for o in graph.outputs if o not in available]
        if missing:
            raise ModelError(f"the graph's output(s) {missing} are produced by no node")
        try:
            graph.toposort()
        except ValueError as exc:
            raise ModelError(str(exc)) from exc
