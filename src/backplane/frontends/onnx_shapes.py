"""ONNX's own type and shape inference over a model, as the importer runs it.

On a copy of the model without its large weights (``onnx_file.LARGE_INITIALIZER``: inference
serializes the model, and needs only their shapes), its nodes in topological order; strict first,
then leniently where strict inference trips on something the model is not refused for.
"""

from __future__ import annotations

import math

import onnx
from onnx import GraphProto, ModelProto, NodeProto

from backplane.frontends.onnx_file import LARGE_INITIALIZER


def copy_model(proto: ModelProto) -> ModelProto:
    copy = ModelProto()
    copy.CopyFrom(proto)
    return copy


def infer_shapes(proto: ModelProto) -> tuple[ModelProto, dict[str, onnx.TensorProto], str | None]:
    """Infer shapes on a copy of the model without its large weights (inference serializes the model:
    on BERT-base that was 4 s of 5), its nodes in order. Returns the annotated copy, the weights it
    left out, and where ONNX's own inference functions refuse a node (as ONNX Runtime, which runs
    them, refuses such a model), else None: raised after the importer's own checks, which name
    problems better. Shapes the model declares for its intermediate tensors that its ops contradict
    are dropped, not trusted; a model is not refused for them (ORT only warns)."""
    light, weights = _without_large_initializers(proto)
    light = _for_inference(light, proto)
    infer = onnx.shape_inference.infer_shapes
    propagate = _propagation_is_safe(light)
    try:
        return infer(light, strict_mode=True, data_prop=propagate), weights, None
    except Exception:  # noqa: BLE001 - which of the reasons below?
        pass
    try:  # data propagation trips on some models where plain inference works
        infer(light, strict_mode=True)
        return _infer_leniently(light), weights, None
    except Exception:  # noqa: BLE001
        pass
    undeclared = copy_model(light)  # the shapes of the model's ops alone: do they refuse a node?
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
    without = copy_model(light)  # the ops are fine with each other; the declared shapes are not
    without.graph.ClearField("value_info")
    return _infer_leniently(without), weights, None


EXTREME_STEP = 1 << 62
"""A Slice step at least this large: onnx 1.23's data propagation crashed the interpreter (SIGSEGV)
on a step of +-(2**63 - 1) and looped forever on one of -2**63, where plain shape inference and
ONNX Runtime run the model. Such a model is inferred without data propagation. (Bounds of INT64_MAX,
"to the end" as exporters write it, are common and harmless.)"""


def _propagation_is_safe(model: ModelProto) -> bool:
    """Whether ONNX's data propagation may run on ``model``: no Slice of an extreme constant step."""
    constants = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    constants[node.output[0]] = attr.t
    for node in _nodes(model.graph):
        if node.op_type == "Slice" and len(node.input) > 4 and node.input[4] in constants:
            steps = onnx.numpy_helper.to_array(constants[node.input[4]]).reshape(-1)
            if any(abs(int(step)) >= EXTREME_STEP for step in steps.tolist()):
                return False
    return True


def _nodes(graph: GraphProto) -> list[NodeProto]:
    """The nodes of ``graph`` and of the graphs its nodes hold, at any depth."""
    found = []
    for node in graph.node:
        found.append(node)
        for attr in node.attribute:
            for body in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found += _nodes(body)
    return found


def _infer_leniently(light: ModelProto) -> ModelProto:
    infer = onnx.shape_inference.infer_shapes
    if not _propagation_is_safe(light):
        try:
            return infer(light, strict_mode=False)
        except Exception:  # noqa: BLE001
            return light
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
    light = copy_model(light) if light is original else light
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
