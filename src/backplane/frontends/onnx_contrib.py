"""The ops ONNX Runtime adds to ONNX that backplane knows: its ``com.microsoft`` domain (written by
its quantizer, its transformer optimizer and its 4-bit weight quantizer) and the one op it adds to
the default domain (SimplifiedLayerNormalization, RMS normalization).

onnx has no schemas for them, so their arity is kept here as data, from ONNX Runtime's contrib-op
documentation (``docs/ContribOperators.md``); their attributes are checked against the kernels.
CpuRef has a kernel for each (``backends/reference/kernels/contrib_*.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import onnx
from onnx import ModelProto, TensorProto, helper

CONTRIB_DOMAIN = "com.microsoft"


class Arity(NamedTuple):
    since_version: int
    min_inputs: int
    max_inputs: int
    min_outputs: int
    max_outputs: int


ANY = 2**31 - 1  # a variadic input

ORT_OPS: dict[str, dict[str, Arity]] = {
    CONTRIB_DOMAIN: {
        # quantized (QOperator format)
        "QLinearAdd": Arity(1, 7, 8, 1, 1),
        "QLinearMul": Arity(1, 7, 8, 1, 1),
        "QLinearSigmoid": Arity(1, 4, 5, 1, 1),
        "QLinearLeakyRelu": Arity(1, 4, 5, 1, 1),
        "QLinearConcat": Arity(1, 3, ANY, 1, 1),
        "QLinearWhere": Arity(1, 9, 9, 1, 1),
        "QLinearGlobalAveragePool": Arity(1, 5, 5, 1, 1),
        "QLinearAveragePool": Arity(1, 4, 5, 1, 1),
        "QLinearSoftmax": Arity(1, 5, 5, 1, 1),
        "QGemm": Arity(1, 6, 9, 1, 1),
        "DynamicQuantizeMatMul": Arity(1, 3, 5, 1, 1),
        "MatMulIntegerToFloat": Arity(1, 4, 7, 1, 1),
        "MatMulNBits": Arity(1, 3, 6, 1, 1),
        "GatherBlockQuantized": Arity(1, 3, 4, 1, 1),
        "DynamicQuantizeLSTM": Arity(1, 12, 12, 0, 3),
        # transformer fusions
        "SkipLayerNormalization": Arity(1, 3, 5, 1, 4),
        "SkipSimplifiedLayerNormalization": Arity(1, 3, 4, 1, 4),
        "EmbedLayerNormalization": Arity(1, 7, 9, 1, 3),
        "BiasGelu": Arity(1, 2, 2, 1, 1),
        "FastGelu": Arity(1, 1, 2, 1, 1),
        "Gelu": Arity(1, 1, 1, 1, 1),
        "QuickGelu": Arity(1, 1, 1, 1, 1),
        "BiasAdd": Arity(1, 3, 3, 1, 1),
        "Attention": Arity(1, 2, 7, 1, 2),
        "QAttention": Arity(1, 5, 9, 1, 2),
        "MultiHeadAttention": Arity(1, 1, 10, 1, 4),
        "GroupQueryAttention": Arity(1, 7, 17, 1, 4),
        "RotaryEmbedding": Arity(1, 4, 4, 1, 1),
        "FusedMatMul": Arity(1, 2, 2, 1, 1),
        "FusedConv": Arity(1, 2, 4, 1, 1),
        "FusedGemm": Arity(1, 2, 3, 1, 1),
        # its quantizer's Q/DQ where ONNX's opset has not the type (int4 weights, 16-bit
        # activations below opset 21) or where asked (``UseQDQContribOps``): ONNX's at 21
        "QuantizeLinear": Arity(1, 2, 3, 1, 1),
        "DequantizeLinear": Arity(1, 2, 3, 1, 1),
    },
    "": {"SimplifiedLayerNormalization": Arity(1, 2, 2, 1, 2),
         # ONNX's from opset 17; ONNX Runtime's own before it (its optimizer writes it into an
         # opset-15 GPT-2 export, fusing the layer norm written out)
         "LayerNormalization": Arity(1, 2, 3, 1, 3)},
}
"""domain -> op -> its since-version and how many inputs and outputs it takes."""

ONNX_EQUIVALENTS: dict[tuple[str, str], int] = {
    (CONTRIB_DOMAIN, "QuantizeLinear"): 21,
    (CONTRIB_DOMAIN, "DequantizeLinear"): 21,
}
"""ONNX Runtime's ops that compute what ONNX's op of the same name computes at this opset (its
contrib Q/DQ: per tensor or per axis, ``axis`` their one attribute; ONNX's from opset 21 take the
same types, int4 to int16), imported as that op of the default domain: every backend's QDQ
kernels and fusions then take them."""


FLOAT, INT32 = TensorProto.FLOAT, TensorProto.INT32

OUTPUT_TYPES: dict[str, tuple[tuple[int, ...], ...]] = {
    "QLinearAdd": ((7, 0),), "QLinearMul": ((7, 0),),
    "QLinearSigmoid": ((4, 0),), "QLinearLeakyRelu": ((4, 0),),
    "QLinearConcat": ((1,),), "QLinearWhere": ((8,),), "QLinearGlobalAveragePool": ((4, 0),),
    "QLinearAveragePool": ((4, 0),), "QLinearSoftmax": ((4, 0),),
    "QGemm": ((8, -FLOAT),), "DynamicQuantizeMatMul": ((-FLOAT,),),
    "MatMulIntegerToFloat": ((2,),), "MatMulNBits": ((2, 0),), "GatherBlockQuantized": ((2,),),
    "DynamicQuantizeLSTM": ((8, 0),) * 3,
    "SkipLayerNormalization": ((2, 0), (-FLOAT,), (-FLOAT,), (2, 0)),
    "SkipSimplifiedLayerNormalization": ((2, 0), (-FLOAT,), (-FLOAT,), (2, 0)),
    "SimplifiedLayerNormalization": ((1, 0), (-FLOAT,)),
    "LayerNormalization": ((0,), (-FLOAT,), (-FLOAT,)),
    "EmbedLayerNormalization": ((2,), (-INT32,), (2,)),
    "Gelu": ((0,),), "BiasGelu": ((1, 0),), "FastGelu": ((1, 0),), "QuickGelu": ((0,),),
    "BiasAdd": ((1, 0),), "Attention": ((1, 0), (1, 0)), "QAttention": ((2,), (2,)),
    "MultiHeadAttention": ((3, 0, 1),) * 3, "RotaryEmbedding": ((2, 0),),
    "GroupQueryAttention": ((7, 3, 0), (3, 0), (3, 0)),
    "FusedMatMul": ((1, 0),), "FusedConv": ((1, 0),), "FusedGemm": ((1, 0),),
    "DequantizeLinear": ((1,),), "QuantizeLinear": ((2, -TensorProto.UINT8),),
}
"""op -> per output, where its element type comes from: the type of the first of these inputs
that is present and typed, or (a negative number) that TensorProto type. Inputs that are mostly
weights come first, so that one pass of inference types a whole chain of these ops."""


def annotate_ort_types(proto: ModelProto) -> int:
    """Declare, in ``proto`` (an inferred copy, the importer's own), the element types of the
    outputs of ONNX Runtime's ops where their sources are typed, and the shapes of those that
    keep an input's shape or broadcast two (``OUTPUT_SHAPES``) where their inputs' are known;
    onnx's shape inference cannot, and the ops after them would stay untyped (or unshaped: a
    QOperator ResNet's convolutions after its first QLinearAdd). Returns how many it declared."""
    graph = proto.graph
    infos = {vi.name: vi for vi in (*graph.input, *graph.value_info, *graph.output)}
    types = {name: vi.type.tensor_type.elem_type for name, vi in infos.items()}
    types.update((init.name, init.data_type) for init in graph.initializer)
    shapes = {name: _dims(vi) for name, vi in infos.items()}
    shapes.update((init.name, list(init.dims)) for init in graph.initializer)
    outputs = {vi.name for vi in graph.output}
    opsets = {"" if o.domain == "ai.onnx" else o.domain: o.version for o in proto.opset_import}
    added = 0
    for node in graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if node.op_type not in OUTPUT_TYPES or not is_ort_op(domain, node.op_type,
                                                             opsets.get(domain, 1)):
            continue
        for k, (name, sources) in enumerate(zip(node.output, OUTPUT_TYPES[node.op_type])):
            shaped = OUTPUT_SHAPES.get(node.op_type) if k == 0 and name not in outputs else None
            shape = shaped(node, [shapes.get(i) for i in node.input]) if shaped else None
            if not name or types.get(name) and (shape is None or shapes.get(name) is not None):
                continue
            elem = types.get(name) or _source_type(list(node.input), sources, types)
            if elem and name in outputs:  # a graph output declared untyped: its type given
                infos[name].type.tensor_type.elem_type = elem
                types[name], added = elem, added + 1
            elif elem:
                if name in infos:  # typed before, its shape found now
                    graph.value_info.remove(infos[name])
                infos[name] = helper.make_tensor_value_info(name, elem, shape)
                graph.value_info.append(infos[name])
                types[name], shapes[name], added = elem, shape, added + 1
    return added


Shape = list[int | str | None]


def _dims(info: onnx.ValueInfoProto) -> Shape | None:
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim]


def _broadcast(a: Shape | None, b: Shape | None) -> Shape | None:
    """Two shapes broadcast, where each pair of dimensions is known to agree."""
    if a is None or b is None:
        return None
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + a, [1] * (rank - len(b)) + b
    if any(x != y and x != 1 and y != 1 or x is None or y is None for x, y in zip(a, b)):
        return None
    return [y if x == 1 else x for x, y in zip(a, b)]


def _pooled(node: onnx.NodeProto, shapes: list[Shape | None]) -> Shape | None:
    x = shapes[0]
    if x is None or len(x) < 3:
        return None
    last = any(a.name == "channels_last" and a.i for a in node.attribute)
    return [x[0], *[1] * (len(x) - 2), x[-1]] if last else [*x[:2], *[1] * (len(x) - 2)]


def _average_pooled(node: onnx.NodeProto, shapes: list[Shape | None]) -> Shape | None:
    """QLinearAveragePool's output (NCHW): AveragePool's, by ONNX's inference on X's known shape
    (its free-batch QOperator ResNet's pooled features, then the Reshape and QGemm after them,
    stayed unshaped in each Specialized build, and the QGemm ran unfused, its weight converted at
    every call)."""
    x = shapes[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if x is None or not all(isinstance(d, int) for d in x) or attrs.pop("channels_last", 0):
        return None
    pool = helper.make_node("AveragePool", ["x"], ["y"], **attrs)
    schema = onnx.defs.get_schema("AveragePool", 19)
    typed = {"x": helper.make_tensor_type_proto(TensorProto.FLOAT, x)}
    dims = onnx.shape_inference.infer_node_outputs(schema, pool, typed)["y"].tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def _attended(node: onnx.NodeProto, shapes: list[Shape | None]) -> Shape | None:
    """Attention's output: (B, S, the values' width), from its input and packed weights."""
    x, w = shapes[0], shapes[1]
    sizes = next((list(a.ints) for a in node.attribute if a.name == "qkv_hidden_sizes"), [])
    width = sizes[2] if len(sizes) == 3 else \
        w[1] // 3 if w is not None and len(w) == 2 and isinstance(w[1], int) else None
    return None if x is None or len(x) != 3 or width is None else [*x[:2], width]


def _convolved(node: onnx.NodeProto, shapes: list[Shape | None]) -> Shape | None:
    """FusedConv's output: Conv's, by ONNX's inference on X's and W's known shapes (the saved
    tiny MobileNet's FusedConvs were unshaped, and every convolution after the first of them ran
    unfused: 2.3x the plain file's time on CpuAcc)."""
    x, w = shapes[0], shapes[1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
             if a.name not in ("activation", "activation_params")}
    if x is None or w is None or not all(isinstance(d, int) for d in (*x, *w)):
        return None
    conv = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    typed = {name: helper.make_tensor_type_proto(TensorProto.FLOAT, dims)
             for name, dims in (("x", x), ("w", w))}
    dims = onnx.shape_inference.infer_node_outputs(onnx.defs.get_schema("Conv", 11), conv,
                                                   typed)["y"].tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def _product(node: onnx.NodeProto, a: Shape | None, b: Shape | None) -> Shape | None:
    """FusedMatMul's and FusedGemm's output: MatMul's of the operands transposed as told."""
    flags = {x.name: x.i for x in node.attribute}
    if a is None or b is None or len(a) < 2 or len(b) < 2 or \
            flags.get("transBatchA") or flags.get("transBatchB"):
        return None
    a = [*a[:-2], a[-1], a[-2]] if flags.get("transA") else a
    b = [*b[:-2], b[-1], b[-2]] if flags.get("transB") else b
    batch = _broadcast(a[:-2], b[:-2]) if len(a) > 2 or len(b) > 2 else []
    return None if batch is None else [*batch, a[-2], b[-1]]


OUTPUT_SHAPES = {
    "QLinearAdd": lambda node, shapes: _broadcast(shapes[0], shapes[3]),
    "QLinearMul": lambda node, shapes: _broadcast(shapes[0], shapes[3]),
    **{op: lambda node, shapes: shapes[0] for op in ("QLinearSigmoid", "QLinearLeakyRelu",
                                                     "QLinearSoftmax")},
    "QLinearGlobalAveragePool": _pooled, "QLinearAveragePool": _average_pooled,
    # the transformer fusions: a free-dimension model's MatMuls after them stayed unfused (no
    # static input shape in its Specialized build) and ran as plain products
    **{op: lambda node, shapes: shapes[0] for op in (
        "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
        "Gelu", "FastGelu", "QuickGelu", "BiasAdd", "QuantizeLinear", "DequantizeLinear")},
    "BiasGelu": lambda node, shapes: _broadcast(shapes[0], shapes[1]),
    "Attention": lambda node, shapes: _attended(node, shapes),
    "FusedMatMul": lambda node, shapes: _product(node, shapes[0], shapes[1]),
    "FusedGemm": lambda node, shapes: _product(node, shapes[0], shapes[1]),
    "FusedConv": _convolved,
}
"""op -> its first output's shape from its node and its inputs' shapes (None: unknown)."""


def _source_type(inputs: Sequence[str], sources: tuple[int, ...], types: dict[str, int]) -> int:
    for source in sources:
        if source < 0:
            return -source
        if source < len(inputs) and inputs[source] and types.get(inputs[source]):
            return types[inputs[source]]
    return 0


def ort_arity(domain: str, op_type: str) -> Arity | None:
    """The arity of an op ONNX Runtime adds that backplane knows, or None."""
    return ORT_OPS.get(domain, {}).get(op_type)


def is_ort_op(domain: str, op_type: str, opset: int) -> bool:
    """Whether a node is one of the ops ONNX Runtime adds to ONNX that backplane knows, where ONNX
    has none of that name at ``opset`` (ONNX Runtime's LayerNormalization, in the models it
    optimizes below opset 17; from 17 it is ONNX's, its schema's)."""
    if ort_arity(domain, op_type) is None:
        return False
    try:
        onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return True
    return False


def check_ort_node(domain: str, op_type: str, opset: int, n_inputs: int, n_outputs: int,
                   ) -> str | None:
    """Why a node of ONNX Runtime's ops cannot be imported, or None."""
    arity = ORT_OPS[domain][op_type]
    if opset < arity.since_version:
        return f"{op_type} exists from opset {arity.since_version} of '{domain}'"
    for kind, count, low, high in (("input", n_inputs, arity.min_inputs, arity.max_inputs),
                                   ("output", n_outputs, arity.min_outputs, arity.max_outputs)):
        if not low <= count <= high:
            takes = f"exactly {low}" if low == high else \
                f"at least {low}" if high == ANY else f"{low} to {high}"
            return f"{count} {kind}(s); {op_type} takes {takes}"
    return None


def known_ops(domain: str) -> str:
    """The ops of ``domain`` backplane knows, for error messages."""
    return ", ".join(sorted(ORT_OPS.get(domain, {}))) or "none"
