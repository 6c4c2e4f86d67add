"""Static shapes after folding: ONNX's own per-op shape inference, fed the folded constants.

The importer runs ONNX shape inference on the whole model, which leaves a dimension symbolic wherever it
is computed at run time (a mask expanded to a shape made by Shape -> Gather -> Concat). Once constant
folding has turned such computations into constants, the same per-op inference functions give static
shapes. Static shapes matter: backends fuse, prepack and capture only what they know the shape of.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from backplane.frontends.onnx_types import numpy_to_onnx_dtype
from backplane.ir.graph import Graph, Layer, TensorInfo

MAX_DATA_ELEMENTS = 1024  # constants passed to inference as values (shapes, axes, sizes), not weights


def refine(layer: Layer, graph: Graph) -> None:
    """Give ``layer``'s outputs static shapes where its inputs have them and ONNX can infer them."""
    from backplane.frontends.onnx_contrib import is_ort_op

    if all(graph.info(o).is_static for o in layer.outputs if o):
        return
    if layer.domain or is_ort_op(layer.domain, layer.op_type, layer.opset):  # LayerNormalization < 17
        _refine_ort(layer, graph)
        return
    infos = [graph.info(n) for n in layer.inputs if n]
    if not all(info.is_static and info.dtype is not None for info in infos):
        return
    try:
        node = _node(layer)
        schema = onnx.defs.get_schema(layer.op_type, layer.opset, layer.domain)
        types = {n: helper.make_tensor_type_proto(numpy_to_onnx_dtype(i.dtype), i.shape)  # type: ignore
                 for n, i in zip((n for n in layer.inputs if n), infos)}
        data = {n: numpy_helper.from_array(np.asarray(graph.constants[n]), n) for n in types
                if n in graph.constants and np.size(graph.constants[n]) <= MAX_DATA_ELEMENTS}
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node, types, data, opset_imports=[helper.make_opsetid("", layer.opset)])
    except Exception:  # noqa: BLE001 - no better shape is not an error; the run will tell
        return
    for name, type_proto in inferred.items():
        better = _static_info(type_proto)
        if better is not None and not graph.info(name).is_static:
            graph.tensors[name] = better


def _refine_ort(layer: Layer, graph: Graph) -> None:
    """ONNX Runtime's ops that keep or broadcast an input's shape (``onnx_contrib.OUTPUT_SHAPES``,
    which ONNX cannot infer): a free-dimension QOperator model's QLinearAdd outputs stayed free in
    each ``specialize`` build, and the QLinearConvs after them ran unfused, in float64."""
    from backplane.frontends.onnx_contrib import OUTPUT_SHAPES, is_ort_op

    shaped = OUTPUT_SHAPES.get(layer.op_type) if is_ort_op(layer.domain, layer.op_type,
                                                           layer.opset) else None
    if shaped is None or not layer.outputs or not layer.outputs[0]:
        return
    infos = [graph.info(n) if n else None for n in layer.inputs]
    known = [list(i.shape) if i is not None and i.is_static else None for i in infos]
    try:
        shape = shaped(_node(layer), known)
    except Exception:  # noqa: BLE001 - no better shape is not an error; the run will tell
        return
    out = layer.outputs[0]
    if shape is not None and all(isinstance(d, int) for d in shape):
        graph.tensors[out] = TensorInfo(tuple(shape), graph.info(out).dtype)  # type: ignore[arg-type]


def _node(layer: Layer) -> onnx.NodeProto:
    attrs = {}
    for key, value in layer.attrs.items():
        if isinstance(value, np.ndarray):
            value = numpy_helper.from_array(value)
        attrs[key] = value  # a sub-graph makes make_node fail: such layers keep their shapes
    return helper.make_node(layer.op_type, layer.inputs, layer.outputs, name=layer.name, **attrs)


def _static_info(type_proto: onnx.TypeProto) -> TensorInfo | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = type_proto.tensor_type.shape.dim
    if not all(d.HasField("dim_value") and d.dim_value >= 0 for d in dims):
        return None
    dtype = onnx.helper.tensor_dtype_to_np_dtype(type_proto.tensor_type.elem_type)
    return TensorInfo(tuple(int(d.dim_value) for d in dims), np.dtype(dtype))
