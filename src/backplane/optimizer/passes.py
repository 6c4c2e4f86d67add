"""Generic passes that run before assignment: constant folding, identity / dropout removal, dead layers.

Each pass takes and returns a Graph; they never touch the user's Graph object (``optimize`` copies it).
"""

from __future__ import annotations

import numpy as np

from backplane.backends.api.kernels import UnsupportedError, bind_kernel, select_kernel
from backplane.ir.graph import Graph, Layer, TensorInfo
from backplane.optimizer import dequantized, shapes

# Ops whose output is not a function of their inputs: never folded.
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                              "Bernoulli", "Multinomial"})
MAX_FOLDED_BYTES = 64 << 20  # folding must not turn a small model into a huge one


def fold_constants(graph: Graph) -> Graph:
    """Evaluate, with CpuRef's kernels, every layer whose inputs are all known at load time.

    ``Shape`` of a tensor whose shape is static counts as known too. On the way, layers whose inputs
    have static shapes get static output shapes (``shapes.refine``), which lets more Shapes fold.
    """
    from backplane.backends.reference.kernels import KERNELS

    kept: list[Layer] = []
    for layer in graph.layers:
        shapes.refine(layer, graph)
        values = _fold(layer, graph, KERNELS)
        if values is None:
            kept.append(layer)
            continue
        for name, value in zip(layer.outputs, values):
            if name:
                graph.constants[name] = value
                graph.tensors[name] = TensorInfo(value.shape, value.dtype)
        if layer.op_type == "DequantizeLinear" and not layer.domain:  # its step kept aside
            dequantized.note(values[0], graph.constants[layer.inputs[1]], graph.constants.get(
                layer.inputs[2]) if len(layer.inputs) > 2 and layer.inputs[2] else None,
                int(layer.attrs.get("axis", 1)))
    graph.layers = kept
    return graph


def _fold(layer: Layer, graph: Graph, kernels) -> tuple[np.ndarray, ...] | None:
    if layer.op_type == "Shape" and not layer.domain:
        info = graph.info(layer.inputs[0])
        if info.shape is not None and info.is_static and layer.inputs[0] not in graph.constants:
            start, end = layer.attrs.get("start", 0), layer.attrs.get("end")
            return (np.array(info.shape[start:end], dtype=np.int64),)
    if layer.domain or layer.op_type in NONDETERMINISTIC or not layer.outputs:
        return None
    if any(name and name not in graph.constants for name in layer.inputs):
        return None
    if any(isinstance(v, Graph) for v in layer.attrs.values()):
        return None
    kernel = select_kernel(kernels, layer.op_type, layer.opset)
    if kernel is None:
        return None
    inferred = [graph.info(n) for n in layer.outputs if n]
    if all(info.is_static for info in inferred) and \
            sum(info.nbytes or 0 for info in inferred) > MAX_FOLDED_BYTES:
        return None  # too large to keep as a constant: not computed at all
    try:
        workload = bind_kernel(kernel, layer.attrs, len(layer.outputs))
        values = workload(*(graph.constants[n] if n else None for n in layer.inputs))
    except (UnsupportedError, ValueError, TypeError, IndexError, ArithmeticError, MemoryError):
        return None  # left to run time, where a real error is reported with its layer
    values = tuple(np.asarray(v) for v in values)
    if sum(v.nbytes for v in values) > MAX_FOLDED_BYTES:
        return None
    return values


def remove_identities(graph: Graph) -> Graph:
    """Drop Identity layers and inference-mode Dropout whose mask is unused; consumers read the input."""
    keep_names = set(graph.outputs)
    rename: dict[str, str] = {}
    kept: list[Layer] = []
    for layer in graph.layers:
        layer.inputs = [rename.get(n, n) for n in layer.inputs]
        if _is_identity(layer, graph) and layer.outputs[0] not in keep_names:
            rename[layer.outputs[0]] = layer.inputs[0]
            continue
        kept.append(layer)
    graph.layers = kept
    return graph


def _is_identity(layer: Layer, graph: Graph) -> bool:
    if layer.domain or not layer.inputs or not layer.inputs[0]:
        return False
    if layer.op_type == "Identity":
        return graph.info(layer.inputs[0]).dtype is not None  # sequences keep their Identity
    if layer.op_type == "Cast":  # to the type its input has: the values as they are
        return _casts_to_itself(layer, graph)
    if layer.op_type != "Dropout":
        return False
    mask_used = len(layer.outputs) > 1 and bool(layer.outputs[1])
    training = layer.inputs[2] if len(layer.inputs) > 2 else ""
    in_training = bool(training) and (training not in graph.constants
                                      or bool(np.asarray(graph.constants[training])))
    return not mask_used and not in_training


def _casts_to_itself(layer: Layer, graph: Graph) -> bool:
    """Whether ``layer`` (a Cast) casts to its input's own element type, known (a Loop body's Cast of
    a comparison's bool to bool, run per iteration); never for strings or a type NumPy lacks."""
    from onnx.helper import tensor_dtype_to_np_dtype

    dtype = graph.info(layer.inputs[0]).dtype
    to = layer.attrs.get("to")
    if dtype is None or to is None or dtype == object:
        return False
    try:
        return bool(tensor_dtype_to_np_dtype(int(to)) == dtype)
    except (KeyError, TypeError, ValueError):
        return False


def remove_dead_layers(graph: Graph) -> Graph:
    """Drop layers none of whose outputs is read by another layer or is a graph output."""
    needed = set(graph.outputs)
    kept: list[Layer] = []
    for layer in reversed(graph.layers):
        if any(o in needed for o in layer.outputs):
            kept.append(layer)
            needed.update(n for n in layer.inputs if n)
            needed.update(_outer_reads(layer))
    graph.layers = kept[::-1]
    return graph


def _outer_reads(layer: Layer) -> set[str]:
    """Names a control-flow body reads from the enclosing scope."""
    reads: set[str] = set()
    for value in layer.attrs.values():
        for body in value if isinstance(value, list) else [value]:
            if isinstance(body, Graph):
                for inner in body.layers:
                    reads.update(n for n in inner.inputs if n)
                    reads |= _outer_reads(inner)
    return reads
