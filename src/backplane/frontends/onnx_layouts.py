"""ONNX Runtime's layout ops, in the models it saves at its layout optimization levels
(``ORT_ENABLE_LAYOUT`` and ``ORT_ENABLE_ALL``, its sessions' default).

- Its NHWC transformer runs a quantized model's convolutions and max pools channels last: a
  ``com.microsoft`` QLinearConv with ``channels_last`` and an NhwcMaxPool, between Transposes it
  inserts (the QLinear* ops it adds elsewhere take ``channels_last`` themselves). Their weights keep
  ONNX's layout, so each is unfolded here into ONNX's op between two Transposes (the one before it
  then cancels against ONNX Runtime's own, by the optimizer's transpose pass).
- Its NCHWc transformer (``com.microsoft.nchwc``) stores convolution weights blocked by 8 or 16
  channels, as the saving CPU's kernels want them, and records the block nowhere in the file:
  refused, naming the fix, rather than guessed.
"""

from __future__ import annotations

from collections.abc import Iterator

from onnx import GraphProto, ModelProto, NodeProto, helper

from backplane.frontends.onnx_file import ModelError
from backplane.frontends.onnx_shapes import copy_model

CONTRIB_DOMAIN = "com.microsoft"
NCHWC_DOMAIN = "com.microsoft.nchwc"
CHANNELS_LAST_OPS = {"QLinearConv": ("QLinearConv", 10), "NhwcMaxPool": ("MaxPool", 12)}
"""com.microsoft op -> ONNX's op it is, channels first, and the opset from which ONNX's takes its
(8-bit) inputs."""


def unfold_layouts(proto: ModelProto) -> ModelProto:
    """``proto`` with ONNX Runtime's channels-last ops as ONNX's between Transposes (a copy where
    there is any: a ModelProto given is the caller's); a ModelError for an NCHWc model."""
    found = [node for graph in _graphs(proto.graph) for node in graph.node
             if node.domain == NCHWC_DOMAIN or
             node.domain == CONTRIB_DOMAIN and node.op_type in CHANNELS_LAST_OPS]
    if not found:
        return proto
    nchwc = next((node for node in found if node.domain == NCHWC_DOMAIN), None)
    if nchwc is not None:
        raise ModelError(
            f"node '{nchwc.name}' ({nchwc.op_type}, domain '{NCHWC_DOMAIN}'): the model was saved "
            f"by ONNX Runtime at ORT_ENABLE_LAYOUT or ORT_ENABLE_ALL, in its NCHWc layout, whose "
            f"convolution weights are blocked for the CPU that saved it (by 8 or 16 channels, "
            f"recorded nowhere in the file; ONNX Runtime warns such a file is for that machine "
            f"only). Save it at ORT_ENABLE_EXTENDED (SessionOptions.graph_optimization_level) or "
            f"give the model before optimization")
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    proto = copy_model(proto)
    names = {name for graph in _graphs(proto.graph) for node in graph.node
             for name in (*node.input, *node.output, node.name)}
    for graph in _graphs(proto.graph):
        nodes: list[NodeProto] = []
        for node in graph.node:
            if node.domain != CONTRIB_DOMAIN or node.op_type not in CHANNELS_LAST_OPS:
                nodes.append(node)
                continue
            try:
                nodes += _channels_first(node, graph, opset, names)
            except (ValueError, TypeError, IndexError) as exc:  # attributes onnx cannot write
                raise ModelError(f"node '{node.name}' ({node.op_type}, domain "
                                 f"'{CONTRIB_DOMAIN}'): {exc}") from exc
        del graph.node[:]
        graph.node.extend(nodes)
    return proto


def _graphs(graph: GraphProto) -> Iterator[GraphProto]:
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                yield from _graphs(body)


def _channels_first(node: NodeProto, graph: GraphProto, opset: int,
                    names: set[str]) -> list[NodeProto]:
    """``node`` as ONNX's op, between Transposes where it is channels last."""
    op, since = CHANNELS_LAST_OPS[node.op_type]
    where = f"node '{node.name}' ({node.op_type}, domain '{CONTRIB_DOMAIN}')"
    if opset < since:
        raise ModelError(f"{where}: ONNX's {op} takes its 8-bit inputs from opset {since}; the "
                         f"model imports opset {opset} of the default domain")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    last = attrs.pop("channels_last", 1 if node.op_type == "NhwcMaxPool" else 0)
    rank = _rank(node, attrs, graph)
    if rank is None:
        raise ModelError(f"{where}: its kernel's rank is not known (no kernel_shape, and its "
                         f"weight is no initializer)")
    if not last:
        return [helper.make_node(op, list(node.input), list(node.output), node.name, **attrs)]
    x, y = _fresh(f"{node.input[0]}_nchw", names), _fresh(f"{node.output[0]}_nchw", names)
    to_first = [0, rank - 1, *range(1, rank - 1)]
    to_last = [0, *range(2, rank), 1]
    return [helper.make_node("Transpose", [node.input[0]], [x],
                             _fresh(f"{node.name}_to_nchw", names), perm=to_first),
            helper.make_node(op, [x, *node.input[1:]], [y], node.name, **attrs),
            helper.make_node("Transpose", [y], [node.output[0]],
                             _fresh(f"{node.name}_to_nhwc", names), perm=to_last)]


def _rank(node: NodeProto, attrs: dict, graph: GraphProto) -> int | None:
    if attrs.get("kernel_shape"):
        return len(attrs["kernel_shape"]) + 2
    if node.op_type == "QLinearConv" and len(node.input) > 3:
        weight = next((t for t in graph.initializer if t.name == node.input[3]), None)
        return len(weight.dims) if weight is not None else None
    return None


def _fresh(name: str, names: set[str]) -> str:
    unique, k = name, 1
    while unique in names:
        unique, k = f"{name}_{k}", k + 1
    names.add(unique)
    return unique
