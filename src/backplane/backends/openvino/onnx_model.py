"""Layers of a backplane graph back into an ONNX model, in memory, for OpenVINO's ONNX frontend.

Attributes are Python values in the IR (``frontends/onnx_types.attribute_value``); the op's schema
gives each one's ONNX type back (an empty list has no type of its own). Constants the layers read
become initializers, the tensors crossing the boundary the graph's inputs and outputs, each with the
shape and type the IR knows (free dimensions as ``dim_param``, unknown ones left open).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper

from backplane.backends.openvino import nan_forms
from backplane.frontends.onnx_types import numpy_to_onnx_dtype
from backplane.ir.graph import Graph, Layer, TensorInfo


def value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    """``name`` as an ONNX graph input or output of ``info``'s type and shape."""
    if info.dtype is None:
        raise ValueError(f"tensor '{name}' has no known element type")
    shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None
                                             for d in info.shape]
    return helper.make_tensor_value_info(name, numpy_to_onnx_dtype(info.dtype), shape)


def node(layer: Layer) -> onnx.NodeProto:
    """The ONNX node of ``layer``, its attributes typed by the op's schema."""
    try:
        schema = onnx.defs.get_schema(layer.op_type, layer.opset, layer.domain)
        types = {name: attr.type for name, attr in schema.attributes.items()}
    except onnx.defs.SchemaError:
        types = {}
    made = helper.make_node(layer.op_type, layer.inputs, layer.outputs, name=layer.name,
                            domain=layer.domain or None)
    made.attribute.extend(_attribute(name, value, types.get(name)) for name, value
                          in layer.attrs.items())
    return made


def _attribute(name: str, value: object, kind: int | None) -> onnx.AttributeProto:
    if isinstance(value, np.ndarray):
        return helper.make_attribute(name, numpy_helper.from_array(value))
    if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
        return helper.make_attribute(name, [numpy_helper.from_array(v) for v in value])
    if kind == AttributeProto.FLOAT:
        value = float(value)  # type: ignore[arg-type]
    return helper.make_attribute(name, value, attr_type=kind)


def _nan_keeping(layer: Layer, graph: Graph, opset: int) -> list[onnx.NodeProto]:
    """``layer``'s node, in the form that keeps NaN where OpenVINO's kernel drops it (nan_forms)."""
    types = {n: numpy_to_onnx_dtype(info.dtype) for n in layer.inputs
             if n and (info := graph.info(n)).dtype is not None}
    first = graph.info(layer.inputs[0]) if layer.inputs and layer.inputs[0] else None
    rank = len(first.shape) if first is not None and first.shape is not None else None
    return nan_forms.nan_keeping(node(layer), types, opset, rank)


def drops_nan(layers: Sequence[Layer], graph: Graph) -> bool:
    """Whether some layer of ``layers`` has a NaN-keeping form other than its plain node."""
    opset = graph.opsets.get("", 0) or 17
    return any(len(forms := _nan_keeping(layer, graph, opset)) > 1
               or forms[0].op_type != layer.op_type for layer in layers)


def model(layers: Sequence[Layer], inputs: Sequence[str], outputs: Sequence[str],
          graph: Graph, name: str = "partition", nan_keeping: bool = False,
          shapes: Sequence[str] = ()) -> onnx.ModelProto:
    """An ONNX model running ``layers`` (in order) from ``inputs`` to ``outputs``, then the Shape
    of each of ``shapes`` (for the checks: ``checks.Plan``); the constants the layers read from
    ``graph`` are its initializers. ``nan_keeping``: the ops OpenVINO computes with NaN-dropping
    min/max in the forms of ``nan_forms``."""
    read = {n for layer in layers for n in layer.inputs if n}
    constants = [numpy_helper.from_array(np.asarray(graph.constants[n]), n)
                 for n in sorted(read) if n in graph.constants]
    opsets = {"": graph.opsets.get("", 0)}
    for layer in layers:
        opsets[layer.domain] = max(opsets.get(layer.domain, 0), layer.opset)
    if not opsets[""]:
        opsets[""] = max(layer.opset for layer in layers if not layer.domain) \
            if any(not layer.domain for layer in layers) else 17
    nodes = [made for layer in layers for made in _nan_keeping(layer, graph, opsets[""])] \
        if nan_keeping else [node(layer) for layer in layers]
    results = [value_info(n, graph.info(n)) for n in outputs]
    for tensor in shapes:
        rank = graph.info(tensor).shape
        nodes.append(helper.make_node("Shape", [tensor], [f"{tensor}/shape"],
                                      name=f"{tensor}/shape"))
        results.append(helper.make_tensor_value_info(
            f"{tensor}/shape", onnx.TensorProto.INT64, None if rank is None else [len(rank)]))
    body = helper.make_graph(nodes, name, [value_info(n, graph.info(n)) for n in inputs],
                             results, constants)
    return helper.make_model(body, producer_name="backplane",
                             opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
