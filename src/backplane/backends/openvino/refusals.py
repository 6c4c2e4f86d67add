"""Reasons to leave a layer to CpuRef that its attributes and constants alone give (checks.py's
``refusal`` asks these first): recurrent weights that contradict their attributes, a Compress
condition longer than its axis, an integer division by a divisor that may be zero, a reduction over
an axis that may be empty. Each is a way OpenVINO 2026.4's CPU plugin answers silently wrong where
CpuRef refuses or answers ONNX's value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.ir.graph import Graph, Layer

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def compress_reason(layer: Layer, graph: Graph) -> str | None:
    """OpenVINO fills zeros for a condition longer than its axis, where CpuRef raises."""
    condition = np.asarray(graph.constants[layer.inputs[1]]).reshape(-1)
    shape = graph.info(layer.inputs[0]).shape
    axis = layer.attrs.get("axis")
    size = None if shape is None else int(np.prod([d if isinstance(d, int) else -1 for d in shape])) \
        if axis is None else shape[int(axis) % len(shape)] if shape else None
    if isinstance(size, int) and 0 <= size and condition.size <= size:
        return None
    return (f"Compress '{layer.name}': a condition of {condition.size} values on an axis of size "
            f"{size if isinstance(size, int) and size >= 0 else 'unknown before the run'}: OpenVINO "
            f"fills zeros for a condition longer than its axis; CpuRef checks it")


def integer_division_reason(layer: Layer, graph: Graph) -> str | None:
    """OpenVINO answers the most negative integer for an integer division or modulo by zero,
    where CpuRef answers 0 and ONNX Runtime refuses (bench/hostile.py): an integer divisor must be
    a constant without a zero (shape arithmetic's, as ``Div(Shape, 8)``, is)."""
    dtype = graph.info(layer.inputs[0]).dtype
    if dtype is None or dtype.kind not in "iu":
        return None
    divisor = graph.constants.get(layer.inputs[1])
    if divisor is not None and np.all(np.asarray(divisor) != 0):
        return None
    return (f"{layer.op_type} '{layer.name}': an integer divisor that is not a constant without "
            f"a zero; OpenVINO answers the most negative integer for a division by zero")


def empty_reduction_reason(layer: Layer, graph: Graph) -> str | None:
    """OpenVINO's ReduceMax over an empty axis gives float32's lowest where ONNX gives -inf (and
    ArgMax of an empty axis answers 0, where there is no element): a reduction of an axis of size
    0, or of axes or a shape not known before the run, goes to CpuRef (which answers -inf, or
    refuses ArgMax's); an axis of a free dimension is checked at run time."""
    shape = graph.info(layer.inputs[0]).shape
    axes = reduced_axes(layer, graph, shape)
    if shape is not None and axes is not None and all(
            not isinstance(shape[axis], int) or shape[axis] > 0 for axis in axes):
        return None  # free dimensions: checked at run time (``_plan_reduction``)
    given = "an input of unknown shape" if shape is None else list(shape)
    over = "known only at run time" if axes is None else axes
    return (f"{layer.op_type} '{layer.name}' of {given} over axes {over}: one may be empty, where "
            f"OpenVINO answers float32's lowest (ONNX: -inf) or an index where there is no "
            f"element")


def reduced_axes(layer: Layer, graph: Graph, shape: tuple[Any, ...] | None) -> list[int] | None:
    """The axes ``layer`` reduces (ArgMax/Min, ReduceMax/Min), or None where not known now."""
    if shape is None:
        return None
    rank = max(len(shape), 1)
    if layer.op_type in ("ArgMax", "ArgMin"):
        return [int(layer.attrs.get("axis", 0)) % rank]
    axes: Any = layer.attrs.get("axes")
    if len(layer.inputs) > 1 and layer.inputs[1]:
        if layer.inputs[1] not in graph.constants:
            return None
        axes = np.asarray(graph.constants[layer.inputs[1]]).reshape(-1).tolist()
    if not axes:
        return [] if layer.attrs.get("noop_with_empty_axes", 0) else list(range(len(shape)))
    return sorted({int(axis) % rank for axis in axes})


def recurrent_reason(layer: Layer, graph: Graph) -> str | None:
    """OpenVINO reads the weights by their own shapes: they must agree with the attributes."""
    gates = GATES[layer.op_type]
    directions = 2 if layer.attrs.get("direction", "forward") == "bidirectional" else 1
    w, r = (graph.info(n).shape for n in layer.inputs[1:3])
    x = graph.info(layer.inputs[0]).shape
    hidden = layer.attrs.get("hidden_size")
    if w is None or r is None or len(w) != 3 or len(r) != 3 \
            or not all(isinstance(d, int) for d in (*w, *r)):
        return (f"{layer.op_type} '{layer.name}': the shapes of its weights W and R ({w}, {r}) "
                f"are not known before the run; OpenVINO reads them unchecked")
    hidden = int(hidden) if hidden is not None else r[2]
    inputs = x[2] if x and len(x) == 3 and isinstance(x[2], int) else None
    want = {"W": (w, [directions, gates * hidden, inputs]),
            "R": (r, [directions, gates * hidden, hidden])}
    optional = {3: ("B", [directions, 2 * gates * hidden]), 5: ("initial_h", [directions, None, hidden]),
                6: ("initial_c", [directions, None, hidden]), 7: ("P", [directions, 3 * hidden])}
    for index, (what, dims) in optional.items():
        if len(layer.inputs) > index and layer.inputs[index]:
            want[what] = (graph.info(layer.inputs[index]).shape, dims)  # type: ignore[assignment]
    for what, (shape, dims) in want.items():
        if shape is None or len(shape) != len(dims) or any(
                d is not None and s != d for s, d in zip(shape, dims)):
            return (f"{layer.op_type} '{layer.name}': {what} has shape {shape}, which contradicts "
                    f"hidden_size {hidden} and direction {layer.attrs.get('direction', 'forward')} "
                    f"(expected {['?' if d is None else d for d in dims]}); OpenVINO would read "
                    f"past it")
    return None
