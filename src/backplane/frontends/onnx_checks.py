"""A node against its ONNX schema, before any kernel sees it: the number of inputs and outputs, no
required input left empty, attributes the op has (each once, of its type, flags 0 or 1, the required
ones present), and the element types of its inputs, those its op takes with one type per type
parameter (ONNX Runtime refuses a model otherwise; NumPy would promote a mixture and run). Each
problem is a ModelError naming the node and the op's version.
"""

from __future__ import annotations

import onnx
from onnx import NodeProto

from backplane.frontends.onnx_contrib import is_ort_op
from backplane.frontends.onnx_file import ModelError
from backplane.ir.graph import Graph, Layer


def check_arity(node: NodeProto, schema: onnx.defs.OpSchema, where: str, op: str) -> None:
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


def check_input_types(layer: Layer, graph: Graph) -> None:
    """The element types of a layer's inputs, where known, are those its op takes, and the inputs
    of one type parameter share one type (ONNX Runtime refuses the model otherwise; NumPy would
    promote the mixture and run)."""
    if is_ort_op(layer.domain, layer.op_type, layer.opset):
        return  # no onnx schema; the kernels take the types ONNX Runtime's documentation gives
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


def check_attributes(node: NodeProto, schema: onnx.defs.OpSchema, where: str, op: str) -> None:
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
