"""CpuAcc's Specialized layers as flat kernel calls, for builtin's control-flow bodies.

A Specialized layer (``specialize.py``) builds, per input signature, what a static partition gets
(constant folding, fusion, a oneDNN Graph) and runs it as a loaded network of its own: worth it
for a partition run once per model run, dear inside an If branch or a Loop body, where its few
small layers run once per branch taken or per iteration. There each call paid the signature lookup,
the nested network's run and the compiled subgraph's own loop: a VAD's If branch (Unsqueeze, Conv,
Relu) took 80 us through it for 28 us of kernels.

``flat_layers`` gives builtin (``builtin/flat.py``) the layer's own layers instead, constant-folded
once at load, each bound to its shape-generic kernel: a body then runs as one flat list of kernel
calls, whatever the shapes of an iteration (a Slice whose starts come from the iteration number
included).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.kernels import bind_kernel
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.threads import Governed
from backplane.ir.graph import Layer

log = logging.getLogger("backplane.torch")


@dataclass(frozen=True)
class FlatLayers:
    """A Specialized layer's layers as calls: ``(kernel bound to its attributes, names read,
    names written, the layer)`` in order; ``inputs`` and ``outputs``: the names they give the
    layer's inputs and outputs, in order; ``constants``: the values folded at load that they read,
    in the backend's memory."""

    calls: tuple[tuple[Workload, tuple[str, ...], tuple[str, ...], Layer], ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    constants: dict[str, Any]


def flat_layers(layer: Layer, backend: Any, workload: Workload,
                constants: Mapping[str, np.ndarray]) -> FlatLayers | None:
    """``layer``'s layers as kernel calls on ``backend``, or None where it is not a Specialized
    layer or one of its layers has no shape-generic kernel (it then runs as it is). ``workload``:
    the layer's own; where it ticks the thread governor (``threads.Governed``), the first call
    does. ``constants``: the values of the network's constants, by name; the layer's inputs among
    them are folded with its layers (a Loop body's Slice bounds read from the enclosing graph)."""
    if layer.domain != FUSED_DOMAIN or layer.op_type != "Specialized":
        return None
    from backplane.backends.torch.specialize import _graph
    from backplane.optimizer import passes

    try:
        graph = _graph(layer)
        graph.constants.update({inner: constants[outer] for inner, outer
                                in zip(layer.attrs["inputs"], layer.inputs) if outer in constants})
        graph = passes.remove_dead_layers(passes.fold_constants(graph))
        passed = set(graph.inputs)
        if not graph.layers or any(name in passed for name in graph.outputs):
            return None  # an input given back: as it is
        copy_in = backend.tensor_handle_factories()[0].copy_in
        calls = [(_made(copy_in(graph.constants[name])), (), (name,), layer)
                 for name in graph.outputs if name in graph.constants]  # outputs folded
        # each call an object of its own (a kernel bound to no attributes is the table's
        # function): errors and profiles find a call's layer by the call
        calls += [(functools.partial(_bound(lay, backend)), tuple(lay.inputs), tuple(lay.outputs),
                   lay) for lay in graph.layers]
        read = {name for lay in graph.layers for name in lay.inputs}
        folded = {name: copy_in(value) for name, value in graph.constants.items()
                  if name in read and name not in passed}
    except Exception as exc:  # noqa: BLE001  # any failure: the Specialized layer runs as it is
        log.info("%s: not flattened in its body (%s: %s)", layer.name, type(exc).__name__, exc)
        return None
    for lay in graph.layers:
        lay.backend = backend.id
    if isinstance(workload, Governed):  # the thread governor's tick, once per call as before
        first, reads, writes, lay = calls[0]
        calls[0] = (Governed(first, workload.governor), reads, writes, lay)
    return FlatLayers(tuple(calls), tuple(graph.inputs), tuple(graph.outputs), folded)


def folded_inputs(layer: Layer, known: Mapping[str, np.ndarray]) -> Layer:
    """``layer`` (a Specialized layer of a control-flow body) with its inputs among ``known``
    (outer constants the body reads) made its own constants, folded with its layers at each
    signature's build: a Loop body's Slice bounds then are constants and the body is captured as
    one CUDA graph, where as inputs they came as tensors at every call, read on the host (its
    layers ran one by one: loop_scripted_ts16's recurrence on GpuAcc). ``layer`` itself where it is
    no Specialized layer or reads none of them."""
    positions = [i for i, name in enumerate(layer.inputs) if name in known]
    if layer.domain != FUSED_DOMAIN or layer.op_type != "Specialized" or not positions:
        return layer
    inner = layer.attrs["inputs"]
    constants = {**layer.attrs["constants"],
                 **{inner[i]: np.asarray(known[layer.inputs[i]]) for i in positions}}
    kept = [i for i in range(len(layer.inputs)) if i not in positions]
    attrs = {**layer.attrs, "inputs": [inner[i] for i in kept], "constants": constants}
    return dataclasses.replace(layer, inputs=[layer.inputs[i] for i in kept], attrs=attrs)


def _bound(layer: Layer, backend: Any) -> Workload:
    """``layer``'s shape-generic kernel on ``backend`` bound to its attributes."""
    kernel = None if layer.domain == FUSED_DOMAIN else backend.kernel_for(layer)
    if kernel is None:
        raise LookupError(f"no shape-generic kernel for {layer.describe()} on {backend.id}")
    return bind_kernel(kernel, layer.attrs, len(layer.outputs))


def _made(value: Any) -> Workload:
    """A call giving a copy of ``value`` (an output folded to a constant: each run's its own)."""
    return lambda: (value.clone(),)
