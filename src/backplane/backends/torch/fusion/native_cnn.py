"""A OneDnnGraph partition run by backplane's own C (``native/cnn.c``): the route "native".

Why: a small CNN's partition spends most of its time in torch's per-call costs, not in its
arithmetic: a oneDNN Graph partition costs 6-9 us of its own beyond its primitive, the fuser never
puts two ungrouped convolutions in one partition (resnet_basic_ts16 runs 7), torch's bridge adds
1-3 us a partition; ONNX Runtime spends ~5 us a layer, kernel included. The native plan
(``native.cnn``) runs the whole partition in one ctypes call, every layer a loop of C over one
arena planned at load.

``CpuAcc.native``: "auto" (the default) takes it, under ``CpuAcc.compile=auto`` (a pinned compile
mode keeps its route), for a float32 partition (or a float16 one computed in float32, as
ONNX Runtime's CPU and oneDNN's route here compute it: converted at its edges) the plan covers whole
(every layer a kind ``native.cnn_layers`` plans) and small (at most ``SMALL`` multiply-adds, one
thread's work); "off" keeps today's routes exactly. Without a C compiler
(``NativeUnavailable``) the partition keeps its torch route too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.ir.graph import Layer, TensorInfo
from backplane.runtime import host_route

log = logging.getLogger("backplane.torch")

SMALL = 16_000_000
"""The most multiply-adds a partition runs natively under "auto", at any thread count: the native
kernels win by oneDNN Graph's fixed costs, which a large image outgrows. At two threads the plan's
large records are shared by the pool (``native/cnn_pool.h``), but on this 2-vCPU EPYC oneDNN
Graph's two threads still ran the full tier's CNNs as fast or faster at their best runs (native
over oneDNN, load 2-4: unet_resize 1.13, yolo_v8 1.64, layout_hswish 0.99, resnet_basic 1.69,
mobilenet_dw 1.47; docs/torch-backends.md, "The native CNN route")."""
ROUTE = "native"


def session_threads(backend: Any) -> int:
    """The threads a session's runs may use: ``CpuAcc.threads`` where it gives a count (a fixed
    one or an ``AtMost``), else torch's count where torch is loaded (the loading thread's: the
    governor holds it at its most while a network loads), else the CPUs of the affinity (a
    torch-free session's)."""
    import os
    import sys

    given = backend.options.get("CpuAcc.threads")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return int(given)
    if isinstance(given, str) and given.isdigit() and int(given) > 0:
        return int(given)
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def native_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload | None:
    """The OneDnnGraph ``layer`` run natively, or None where ``CpuAcc.native`` is off, the plan
    does not cover it, it is larger than ``SMALL`` or no library can be built."""
    found = native_executor(layer, backend, inputs)
    if found is None:
        return None
    executor, why, half, edges = found
    run = _workload(executor, executor.plan.names, why)
    if half and not edges:  # float16 in and out, float32 inside: converted by torch
        from backplane.backends.torch.fusion.reduced import at_edges

        run = at_edges(run, "float32", layer.attrs["output_dtypes"], "float16")
    return run


def native_executor(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
                    ) -> tuple[Any, str, bool, bool] | None:
    """``native_workload``'s rules without torch: (the plan's executor, why, whether the
    partition is float16 computed in float32, whether the C converts its float16 edges), or None.
    ``backplane.torch_free`` runs the executor on NumPy arrays (issue 27 item 5)."""
    from backplane.native import NativeUnavailable, build, library
    from backplane.native.cnn import Executor, Unplannable, plan

    if build.mode(backend.options) == "off" or backend.options.get("CpuAcc.compile",
                                                                    "auto") != "auto":
        return None  # CpuAcc.compile pinned to onednn_graph or layers: that route
    a = layer.attrs
    half = a.get("compute") == "float32" and a.get("source") == "float16"
    if (a.get("compute") or a.get("source")) and not half or not all(
            info.is_static and str(info.dtype) in ("float32", "float16" if half else "")
            for info in inputs):
        return None  # bfloat16 (CpuAcc.precision) keeps oneDNN's kernels
    try:
        planned = plan(a["layers"], a["constants"], a["inputs"], [i.shape for i in inputs],
                       a["outputs"])
    except Unplannable as why:
        log.debug("%s: not native (%s)", layer.name, why)
        return None
    if planned.flops > SMALL:
        log.debug("%s: not native (%d multiply-adds, above %d)", layer.name, planned.flops, SMALL)
        return None
    try:
        built = library("cnn")
    except NativeUnavailable:
        return None
    edges = half and built.backplane_cnn_half()  # float16 converted by the C at the edges
    if edges:
        planned.halved([str(i.dtype) == "float16" for i in inputs],
                       [str(d) == "float16" for d in a["output_dtypes"]])
    return (Executor(planned, built, session_threads(backend)),
            f"{ROUTE}: CpuAcc.native={build.mode(backend.options)}, the whole partition "
            f"planned ({len(planned.records)} records, {planned.flops} multiply-adds)",
            bool(half), bool(edges))


CONVOLUTIONS = ("FusedConv", "Conv", "ConvTranspose", "WindowedConv")


def traced_float32(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
                   indices: bool = False) -> bool:
    """Whether a Traced ``layer`` may go to a native plan at all: the native route not off,
    ``CpuAcc.compile`` not pinned to another route, float32 computed as written (no reduced
    precision) and static float32 inputs (native_cnn's prefix and recurrent_net's whole plan);
    with ``indices``, int32, int64 and bool inputs too (``cnn_seq``: the CNN plan's)."""
    from backplane.native import build

    a, kinds = layer.attrs, INDICES if indices else ("float32",)
    return build.mode(backend.options) != "off" and backend.options.get(
        "CpuAcc.compile", "auto") == "auto" and not (a.get("compute") or a.get("source")) and all(
        info.is_static and str(info.dtype) in kinds for info in inputs)


INDICES = ("float32", "int32", "int64", "bool")
"""The input types the CNN plan reads (its integers as indices: ``cnn_seq``)."""


def traced_prefix(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
                  rest: Callable[[Layer, Any, Sequence[TensorInfo]], Workload]) -> Workload | None:
    """A Traced layer's longest run of first layers the plan covers, with a convolution among
    them, run natively, and its other layers as a Traced layer of their own (``rest``, traced's
    workload); or None (``native_workload``'s rules). Why: a detector's or a CRNN's backbone
    ends in layers the plan does not take (an NMS's glue, an LSTM), which kept the whole partition
    traced, its convolutions on torch's (detect_nms_ts14's on the im2col path: 270 us of 890)."""
    from backplane.native import NativeUnavailable, library
    from backplane.native.cnn import Executor, Unplannable, plan

    a = layer.attrs
    if not traced_float32(layer, backend, inputs, indices=True):
        return None
    layers, names, planners = a["layers"], list(a["inputs"]), _planners()
    first = next((i for i, lay in enumerate(layers) if lay.op_type not in planners), len(layers))
    planned = None
    for count in range(first, 0, -1):
        if not any(lay.op_type in CONVOLUTIONS for lay in layers[:count]):
            return None
        produced = {n for lay in layers[:count] for n in lay.outputs}
        read = {n for lay in layers[count:] for n in lay.inputs}
        made = [n for n in a["outputs"] if n in produced] + [
            n for lay in layers[:count] for n in lay.outputs
            if n in read and n not in a["outputs"]]
        used = [n for n in names if any(n in lay.inputs for lay in layers[:count])]
        try:
            planned = plan(layers[:count], a["constants"], used,
                           [inputs[names.index(n)].shape for n in used], made,
                           [inputs[names.index(n)].dtype for n in used])
            break
        except Unplannable as why:
            log.debug("%s: its first %d layers not native (%s)", layer.name, count, why)
    if planned is None:
        return None
    if planned.flops > SMALL:
        return None
    try:
        executor = Executor(planned, library("cnn"), session_threads(backend))
    except NativeUnavailable:
        return None
    head = _workload(executor, planned.names, f"{ROUTE}: the first {count} of {len(layers)} "
                     f"layers planned ({planned.flops} multiply-adds)")
    if count == len(layers) and used == names:
        return head
    return _then(layer, backend, inputs, head, used, made, planned.output_shapes, count, rest)


def _planners() -> dict[str, Any]:
    from backplane.native.cnn_layers import PLANNERS

    return PLANNERS


def _then(layer: Layer, backend: Any, inputs: Sequence[TensorInfo], head: Workload,
          used: list[str], made: list[str], shapes: Sequence[Sequence[int]], count: int,
          rest: Callable[[Layer, Any, Sequence[TensorInfo]], Workload]) -> Workload:
    """``head`` (the native first ``count`` layers) then the others as a Traced layer."""
    a, names = layer.attrs, list(layer.attrs["inputs"])
    infos = dict(zip(names, inputs))
    infos.update({n: TensorInfo(tuple(s), np.dtype(t)) for n, s, t in zip(
        made, shapes, head.executor.plan.output_dtypes)})  # float32, or int64 indices
    later = a["layers"][count:]
    read = [n for n in dict.fromkeys(n for lay in later for n in lay.inputs)
            if n in infos]
    outputs = [n for n in a["outputs"] if n not in made]
    tail = Layer(f"{layer.name}[after {count}]", "Traced", read, outputs,
                 {**a, "layers": later, "inputs": read, "outputs": outputs,
                  "shapes": a["shapes"][count:], "after_native": count,
                  "constants": {n: v for n, v in a["constants"].items()
                                if any(n in lay.inputs for lay in later)}},
                 layer.domain, layer.opset)
    after = rest(tail, backend, [infos[n] for n in read]) if later else lambda *values: ()
    take = [names.index(n) for n in used]
    where = [("made", made.index(n)) if n in made else ("input", names.index(n)) for n in read]
    back = [("made", made.index(n)) if n in made else ("rest", outputs.index(n))
            for n in a["outputs"]]

    from backplane.runtime.fresh_outputs import Made

    def run(*values: Any) -> tuple[Any, ...]:
        # plain loops, no comprehension: each is a Python frame of its own a call (3.11)
        given = []
        for i in take:
            given.append(values[i])
        first = head(*given)
        given = []
        for kind, i in where:
            given.append(first[i] if kind == "made" else values[i])
        second = after(*given)
        joined = []
        for kind, i in back:
            joined.append(first[i] if kind == "made" else second[i])
        joined = tuple(joined)
        # the head's results are made in this call; the rest's where its trace says so: then the
        # outputs reach the caller without the search of the inputs (runtime/fresh_outputs.py)
        return Made(joined) if not outputs or type(second) is Made else joined

    host = host_route.chained(head, after if later else None, take, where, back)
    if host is not None:  # both parts run on NumPy arrays (a CNN head, then a recurrent plan)
        host_route.offer(run, host)
    run.route = f"{ROUTE}+{getattr(after, 'route', '?')}"  # type: ignore[attr-defined]
    run.why = f"{head.why}; then {getattr(after, 'why', '')}"  # type: ignore[attr-defined]
    run.executor = head.executor  # type: ignore[attr-defined]
    run.rest = after  # type: ignore[attr-defined]
    if getattr(after, "deferred", False):
        run.deferred = True  # type: ignore[attr-defined]
    return run


def _workload(executor: Any, names: Sequence[tuple[str, str]], why: str,
              route: str = ROUTE) -> Workload:
    """The executor's call on torch tensors: fresh outputs each run (the caller's alone). Also
    the int8 route's (``int8_native``: its plan's edges float32, the default here)."""
    import torch

    from backplane.runtime.fresh_outputs import Made

    TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.int64): torch.int64,
             np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}
    shapes, call, empty = executor.plan.output_shapes, executor.run, torch.empty
    plan, host = executor.plan, executor.host
    if getattr(executor, "splits", False):  # its threads: torch's count in the calling thread
        call, host = _asking(executor, executor.run), _asking(executor, executor.host)
    types = [TORCH.get(np.dtype(t), torch.float32)
             for t in getattr(plan, "output_dtypes", None) or [np.float32] * len(shapes)]
    kinds = [TORCH.get(np.dtype(t), torch.float32)
             for t in getattr(plan, "input_dtypes", None) or [np.float32] * len(plan.input_shapes)]

    made = list(zip(shapes, types))

    def run(*values: Any) -> tuple[Any, ...]:
        # plain loops, no comprehension: each is a Python frame of its own a call (3.11)
        pointers, held, outputs = [], [], []
        for v, k in zip(values, kinds):
            if v.dtype != k or not v.is_contiguous():
                v = v.contiguous().to(k)
                held.append(v)  # alive until the call has read it
            pointers.append(v.data_ptr())
        for shape, t in made:
            o = empty(shape, dtype=t)
            outputs.append(o)
            pointers.append(o.data_ptr())
        call(pointers)
        return Made(outputs)

    def profiled(*values: Any) -> tuple[tuple[Any, ...], list[tuple[str, str, float, int]]]:
        start = time.perf_counter()
        seconds = executor.profile([v.contiguous().numpy() for v in values])
        outputs = run(*values)
        total = max(sum(seconds), 1e-12)
        spent: dict[tuple[str, str], float] = {}
        for key, second in zip(names, seconds):
            spent[key] = spent.get(key, 0.0) + second
        wall = (time.perf_counter() - start) / 2  # two runs: each record's share of one
        return outputs, [(name, op, float(wall * s / total), 0) for (name, op), s in spent.items()]

    run.route = route  # type: ignore[attr-defined]
    run.why = why  # type: ignore[attr-defined]
    run.profiled = profiled  # type: ignore[attr-defined]
    run.executor = executor  # type: ignore[attr-defined]
    host_route.offer(run, host)  # the direct run's call on the caller's NumPy arrays
    return run


def _asking(executor: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` on the threads torch has in the calling thread (the session's count, or fewer
    where CpuAcc's governor holds fewer, ``threads.py``; one in a ``small.OneThread``)."""
    import torch

    ask, count = executor.ask, torch.get_num_threads

    def asking(*values: Any) -> Any:
        ask(count())
        return call(*values)

    return asking
