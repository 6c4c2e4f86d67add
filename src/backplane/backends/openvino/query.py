"""OpenVINO's own answers: whether its ONNX frontend converts an op, which ops its CPU plugin takes.

Three questions, each with a reason when the answer is no:

- ``no_conversion_rule``: has the ONNX frontend a rule for this op at all? Asked once per op type and
  opset per process, on a one-node model of the layer (what ``is_layer_supported`` can ask: it sees
  no constants). Any other failure of that one-node model is left to the next question, since an
  input that is a constant in the real graph (Unsqueeze's axes) may be what the conversion needs.
- ``refused_ops``: the ops of a converted model that ``Core.query_model`` does not put on the CPU.
- ``layer_refusal``: the same for one layer, its constant inputs as initializers: what
  ``optimize_subgraph`` asks of each layer when a whole partition is not taken.
- ``shape_contradiction``: an output whose shape, as OpenVINO infers it, is not the graph's (a
  conversion that computes something else).
"""

from __future__ import annotations

import functools
import io
import re
import threading
from collections.abc import Sequence
from typing import Any

from backplane.backends.openvino import onnx_model
from backplane.ir.graph import Graph, Layer, TensorInfo

DEVICE = "CPU"
BOUNDARY_OPS = ("Parameter", "Result", "Constant")
"""Refused only with the ops they feed or drain: not named in a reason when a computing op is."""
_lock = threading.Lock()
_rules: dict[tuple[str, str, int], str | None] = {}  # (domain, op, opset) -> why not, or None


@functools.cache
def core() -> Any:
    """One OpenVINO Core per process (it loads the plugins once)."""
    import openvino

    return openvino.Core()


def read(proto: Any) -> Any:
    """An ``openvino.Model`` read from an ONNX ModelProto in memory by OpenVINO's ONNX frontend."""
    return core().read_model(io.BytesIO(proto.SerializeToString()))


def no_conversion_rule(layer: Layer, inputs: Sequence[TensorInfo],
                       outputs: Sequence[TensorInfo]) -> str | None:
    """Why OpenVINO's ONNX frontend has no rule for ``layer``'s op, or None when it has one."""
    key = (layer.domain, layer.op_type, layer.opset)
    with _lock:
        if key in _rules:
            return _rules[key]
    names_in = [n for n in layer.inputs if n]  # the infos are those of the named inputs
    names_out = [n for n in layer.outputs if n]
    tensors = {**dict(zip(names_in, inputs)), **dict(zip(names_out, outputs))}
    graph = Graph("layer", [layer], list(dict.fromkeys(names_in)), names_out, tensors)
    try:
        read(onnx_model.model([layer], graph.inputs, graph.outputs, graph))
        reason = None
    except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError and others
        text = str(exc)
        reason = (f"OpenVINO's ONNX frontend has no conversion rule for {layer.op_type}-"
                  f"{layer.opset}" if "No conversion rule found" in text else None)
    with _lock:
        _rules[key] = reason
    return reason


def refused_ops(model: Any) -> list[str]:
    """The ops of ``model`` (type and name) that OpenVINO's CPU plugin does not take."""
    taken = core().query_model(model, DEVICE)
    refused = [op for op in model.get_ops() if op.get_friendly_name() not in taken]
    computing = [op for op in refused if op.get_type_name() not in BOUNDARY_OPS]
    return [f"{op.get_type_name()} '{op.get_friendly_name()}'" for op in computing or refused]


def shape_contradiction(model: Any, outputs: Sequence[str], graph: Graph) -> str | None:
    """Where OpenVINO's shape of an output contradicts the graph's (OpenVINO 2026.4 reduces a
    ReduceLogSumExp of opset 17 over all axes, not its ``axes``), or None."""
    for port, name in zip(model.outputs, outputs):
        theirs, ours = port.get_partial_shape(), graph.info(name).shape
        if ours is None or theirs.rank.is_dynamic:
            continue
        dims = [d.get_length() if d.is_static else None for d in theirs]
        if len(dims) != len(ours) or any(isinstance(a, int) and b is not None and a != b
                                         for a, b in zip(ours, dims)):
            shown = ", ".join("?" if d is None else str(d) for d in dims)
            return (f"OpenVINO infers shape [{shown}] for '{name}', which the graph has as "
                    f"{graph.info(name)}")
    return None


def layer_refusal(layer: Layer, graph: Graph) -> str | None:
    """Why OpenVINO does not take ``layer`` of ``graph`` (its constants as initializers), or None."""
    inputs = [n for n in dict.fromkeys(layer.inputs) if n and n not in graph.constants]
    try:
        outputs = [n for n in layer.outputs if n and graph.info(n).dtype is not None]
        model = read(onnx_model.model([layer], inputs, outputs, graph))
    except Exception as exc:  # noqa: BLE001
        return f"OpenVINO's ONNX frontend cannot convert it: {frontend_message(exc)}"
    contradiction = shape_contradiction(model, outputs, graph)
    if contradiction:
        return contradiction
    try:
        refused = refused_ops(model)
    except Exception as exc:  # noqa: BLE001 - query_model validates shapes too
        return f"OpenVINO's {DEVICE} plugin cannot query it: {frontend_message(exc)}"
    if refused:
        return f"OpenVINO's {DEVICE} plugin does not take {', '.join(refused[:4])}" + \
            (f" and {len(refused) - 4} more ops" if len(refused) > 4 else "")
    return None


def frontend_message(exc: BaseException) -> str:
    """The lines of an OpenVINO error that say what failed, without its source locations."""
    lines = [line.strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and not re.match(r"(Exception from|Check ')", line)
             and not line.startswith(("FrontEnd API failed", "Model wasn't fully converted",
                                      "Summary:", "To facilitate"))]
    message = "; ".join(lines) or type(exc).__name__
    return message if len(message) <= 300 else message[:297] + "..."
