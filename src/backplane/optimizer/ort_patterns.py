"""Patterns ONNX Runtime's graph optimizer writes into the models it saves, undone where the plain
form runs better on every backend.

ONNX Runtime's MatMul + Add fusion turns a product of a 3-D (or higher) activation by a constant
weight into a Gemm between two Reshapes: (B, S, K) -> (B*S, K), Gemm, (B*S, N) -> (B, S, N). Its own
Gemm kernel wants 2-D operands; backplane's product kernels take the N-D activation (CpuAcc packs
the MatMul + Add into one Linear), and each Reshape is one more call a run (an ORT-saved tiny BERT:
24 of them, 21 views and reshapes more a run than the plain export). ``unfold_gemm_reshapes``
rewrites the sandwich as the MatMul and Add it was.

Its saved GPT-2 moves each tanh GELU's last factor (0.5) into the product after it (FusedMatMul's
alpha), which leaves a GELU no fusion knows; ``half_back_in_gelus`` puts it back. Its transformer
optimizer's SkipLayerNormalization and Attention are written back as the plain ops they fused
(``ort_lowered``). ``plain_forms`` does all three.
"""

from __future__ import annotations

import numpy as np

from backplane.ir.graph import Graph, Layer, TensorInfo
from backplane.optimizer import ort_lowered


def unfold_gemm_reshapes(graph: Graph) -> Graph:
    """Reshape(X, (M, K)) -> Gemm(W, bias) -> Reshape to X's leading dimensions and N, for an X of
    rank 3 or more with a static shape, a constant W and bias, transA 0 and alpha and beta 1, the
    two intermediate tensors read by nothing else: MatMul(X, W) and Add(bias), writing the second
    Reshape's output. Returns ``graph``, rewritten in place."""
    producers, consumers = graph.producers(), graph.consumers()
    outputs, names = set(graph.outputs), {layer.name for layer in graph.layers}
    replaced: dict[int, list[Layer]] = {}
    dropped: set[int] = set()
    for gemm in graph.layers:
        match = _sandwich(gemm, graph, producers, consumers, outputs)
        if match is None:
            continue
        first, last, x, weight, bias = match
        replaced[id(last)] = _unfolded(gemm, last, x, weight, bias, graph, names)
        dropped.update((id(first), id(gemm)))
    if replaced:
        graph.layers = [new for layer in graph.layers if id(layer) not in dropped
                        for new in replaced.get(id(layer), [layer])]
    return graph


def _sandwich(gemm, graph, producers, consumers, outputs):
    if gemm.op_type != "Gemm" or gemm.domain or len(gemm.inputs) < 2:
        return None
    attrs = gemm.attrs
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    first, readers = producers.get(gemm.inputs[0]), consumers.get(gemm.outputs[0], [])
    if first is None or first.op_type != "Reshape" or first.domain or len(readers) != 1:
        return None
    last = readers[0]
    if last.op_type != "Reshape" or last.domain or last.inputs[0] != gemm.outputs[0]:
        return None
    if len(consumers.get(first.outputs[0], [])) != 1 or \
            {first.outputs[0], gemm.outputs[0]} & outputs:
        return None
    x, weight = first.inputs[0], graph.constants.get(gemm.inputs[1])
    bias = graph.constants.get(gemm.inputs[2]) if len(gemm.inputs) > 2 and gemm.inputs[2] else None
    info = graph.info(x)
    if weight is None or weight.ndim != 2 or not info.is_static or len(info.shape) < 3:
        return None
    if len(gemm.inputs) > 2 and gemm.inputs[2] and bias is None:
        return None  # a bias computed at run time
    weight = weight.T if attrs.get("transB", 0) else weight
    k, n = weight.shape
    rows = int(np.prod(info.shape[:-1]))
    if info.shape[-1] != k or graph.info(first.outputs[0]).shape != (rows, k):
        return None
    if bias is not None and (bias.size != n or bias.ndim > 2 or bias.ndim == 2 and bias.shape[0] != 1):
        return None
    if graph.info(last.outputs[0]).shape != (*info.shape[:-1], n):
        return None
    return first, last, x, weight, bias


def _unfolded(gemm: Layer, last: Layer, x: str, weight: np.ndarray, bias: np.ndarray | None,
              graph: Graph, names: set[str]) -> list[Layer]:
    """MatMul (and Add) writing ``last``'s output, their constants and the product's info added."""
    out, info = last.outputs[0], graph.info(last.outputs[0])
    w_name = _fresh(f"{gemm.name}/weight", graph)
    graph.constants[w_name] = np.ascontiguousarray(weight)
    graph.tensors[w_name] = TensorInfo(weight.shape, weight.dtype)
    if bias is None:
        return [Layer(gemm.name, "MatMul", [x, w_name], [out], {}, "", gemm.opset)]
    product = _fresh(f"{gemm.name}/product", graph)
    graph.tensors[product] = info
    b_name = _fresh(f"{gemm.name}/bias", graph)
    graph.constants[b_name] = bias.reshape(-1)
    graph.tensors[b_name] = TensorInfo((bias.size,), bias.dtype)
    add = _fresh(f"{gemm.name}/bias", graph, names)
    return [Layer(gemm.name, "MatMul", [x, w_name], [product], {}, "", gemm.opset),
            Layer(add, "Add", [product, b_name], [out], {}, "", gemm.opset)]


def _fresh(name: str, graph: Graph, taken: set[str] = frozenset()) -> str:
    """A name no tensor, constant nor (in ``taken``, then added to it) layer has."""
    unique, k = name, 1
    while unique in graph.tensors or unique in graph.constants or unique in taken:
        unique, k = f"{name}_{k}", k + 1
    if isinstance(taken, set):
        taken.add(unique)
    return unique


def half_back_in_gelus(graph: Graph) -> Graph:
    """FusedMatMul(G, W, alpha 0.5), W a constant (K, N) float32, no transposes, G = x * (1 +
    Tanh(...)) read by it alone: ONNX Runtime's saved GPT-2 moves the tanh GELU's last factor,
    0.5, into the product after it, which leaves a GELU no fusion knows (eight elementwise ops
    over the widest activation, the product after them a plain one). Written back as
    Mul(G, 0.5) then MatMul(., W): the GELU as the exporters write it, which the Linear before
    it takes as its post-op, and the product a Linear. The same values: a product of G scaled by
    0.5 is the product scaled by 0.5, bit for bit (a power of two). Returns ``graph``, in place."""
    producers, consumers = graph.producers(), graph.consumers()
    opset, names = graph.opsets.get("", 0) or 17, {layer.name for layer in graph.layers}
    replaced: dict[int, list[Layer]] = {}
    for layer in graph.layers:
        a = layer.attrs
        weight = graph.constants.get(layer.inputs[1]) if len(layer.inputs) == 2 else None
        if layer.op_type != "FusedMatMul" or layer.domain != "com.microsoft" \
                or float(a.get("alpha", 1.0)) != 0.5 or weight is None or weight.ndim != 2 \
                or weight.dtype != np.float32 or any(a.get(flag, 0) for flag in (
                    "transA", "transB", "transBatchA", "transBatchB")):
            continue
        gelu = layer.inputs[0]
        if not _tanh_gelu_end(producers.get(gelu), graph, producers) \
                or len(consumers.get(gelu, [])) != 1 or gelu in graph.outputs:
            continue
        half, halved = _fresh(f"{layer.name}/half", graph), _fresh(f"{gelu}/half", graph)
        graph.constants[half] = np.array(0.5, np.float32)
        graph.tensors[half] = TensorInfo((), np.dtype(np.float32))
        graph.tensors[halved] = graph.info(gelu)
        replaced[id(layer)] = [
            Layer(_fresh(f"{layer.name}/half", graph, names), "Mul", [gelu, half], [halved], {},
                  "", opset),
            Layer(layer.name, "MatMul", [halved, layer.inputs[1]], list(layer.outputs), {}, "",
                  opset)]
    if replaced:
        graph.layers = [new for layer in graph.layers for new in replaced.get(id(layer), [layer])]
    return graph


def _tanh_gelu_end(mul: Layer | None, graph: Graph, producers: dict[str, Layer]) -> bool:
    """Whether ``mul`` is Mul(x, 1 + Tanh(...)) (either order), the end of a tanh GELU without
    its 0.5 (the rest of the GELU is for the Linear's fusion to find, or not)."""
    if mul is None or mul.op_type != "Mul" or mul.domain or len(mul.inputs) != 2:
        return False
    for name in mul.inputs:
        add = producers.get(name)
        if add is None or add.op_type != "Add" or add.domain:
            continue
        one = [graph.constants.get(n) for n in add.inputs]
        tanh = [producers.get(n) for n in add.inputs]
        if any(c is not None and c.size == 1 and float(c.reshape(-1)[0]) == 1.0 for c in one) \
                and any(t is not None and t.op_type == "Tanh" for t in tanh):
            return True
    return False


def gathers_from_splits(graph: Graph) -> Graph:
    """Split(X, all parts of size 1, axis a) whose every part one Squeeze(axes [a]) reads alone:
    ONNX Runtime's saved models make the Gathers of one tensor's indices 0, 1, ... on one axis
    (torch's packed multi-head attention taking Q, K and V from one product) this Split; each
    Squeeze written back as the Gather it was, ``Gather(X, i, axis a)``, which CpuAcc's traces
    fold into a view of the product (``index_glue``): the saved encoder's trace held a split
    and a squeeze a part, 128 layers against the plain file's 124. Returns ``graph``, in place."""
    consumers, opset = graph.consumers(), graph.opsets.get("", 0) or 17
    replaced: dict[int, list[Layer]] = {}
    for split in graph.layers:
        squeezes = _part_squeezes(split, graph, consumers)
        if squeezes is None:
            continue
        replaced[id(split)] = []
        for index, squeeze in enumerate(squeezes):
            at = _fresh(f"{split.name}/index{index}", graph)
            graph.constants[at] = np.array(index, np.int64)
            graph.tensors[at] = TensorInfo((), np.dtype(np.int64))
            replaced[id(squeeze)] = [Layer(squeeze.name, "Gather", [split.inputs[0], at],
                                           list(squeeze.outputs), {"axis": split.attrs["axis"]},
                                           "", opset)]
    if replaced:
        graph.layers = [new for layer in graph.layers for new in replaced.get(id(layer), [layer])]
    return graph


def _part_squeezes(split: Layer, graph: Graph, consumers: dict[str, list[Layer]],
                   ) -> list[Layer] | None:
    """The Squeeze reading each part of ``split`` (in order), where the parts are all of size 1
    on its axis and each Squeeze takes that axis alone; else None."""
    if split.op_type != "Split" or split.domain:
        return None
    shape = graph.info(split.inputs[0]).shape
    if shape is None or not shape:
        return None
    axis = int(split.attrs.get("axis", 0)) % len(shape)
    sizes = graph.constants.get(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] \
        else split.attrs.get("split")
    parts = len(split.outputs)
    if sizes is not None and list(np.asarray(sizes).reshape(-1)) != [1] * parts \
            or sizes is None and shape[axis] != parts:
        return None
    squeezes = []
    for part in split.outputs:
        readers = consumers.get(part, [])
        if not part or part in graph.outputs or len(readers) != 1:
            return None
        squeeze = readers[0]
        axes = graph.constants.get(squeeze.inputs[1]) if len(squeeze.inputs) > 1 \
            else squeeze.attrs.get("axes")
        if squeeze.op_type != "Squeeze" or squeeze.domain or axes is None \
                or [int(a) % len(shape) for a in np.asarray(axes).reshape(-1)] != [axis]:
            return None
        squeezes.append(squeeze)
    return squeezes


def plain_forms(graph: Graph) -> Graph:
    """``graph`` with ONNX Runtime's patterns undone (in place): its Reshape -> Gemm -> Reshape
    sandwiches, its GELUs' 0.5 moved into the products after them, its Gathers made a Split,
    and its SkipLayerNormalization, Attention, FusedGemm and FusedConv where they can be written
    as the ops they fused (``ort_lowered``)."""
    return ort_lowered.lower(gathers_from_splits(half_back_in_gelus(unfold_gemm_reshapes(graph))))
