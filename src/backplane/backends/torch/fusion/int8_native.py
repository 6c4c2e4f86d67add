"""A static int8 CNN subgraph run by backplane's own C (``native/qcnn.c``): the route "native int8".

Why: on this AVX2 EPYC torch's int8 kernels (FBGEMM, oneDNN, oneDNN Graph's int8) are slower than
its float ones, so the corpus's int8 CNNs ran slower than ONNX Runtime's int8 and than
backplane's own float32 of the same model (resnet_qlinear_ort15 0.387 ms against ONNX Runtime's
0.090). ONNX Runtime's MLAS multiplies uint8 by int8 into int32 and requantizes in float; the
native plan (``native.qcnn``) does the same arithmetic in one ctypes call a run, its outputs
ONNX Runtime's bit for bit on the corpus's QOperator and QDQ ResNets (tests/native/test_qcnn.py).

Taken, before CpuAcc's fusions, for a whole subgraph: static float32 inputs and outputs, every
layer one ``native.qcnn_layers`` plans, at least one quantized convolution or product. Under
``CpuAcc.native`` "auto" (the default) and ``CpuAcc.compile`` auto, never with ``CpuAcc.int8``
asked "exact" (CpuRef's values bit for bit: its requantization is its own) or a reduced
``CpuAcc.precision``;
"off", or no C compiler (``NativeUnavailable``): today's routes exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.ir.graph import Layer, SubgraphView, TensorInfo

log = logging.getLogger("backplane.torch")
ROUTE = "native int8"
OP = "NativeInt8"


def _allowed(options: Any) -> bool:
    """``CpuAcc.native`` not off, ``CpuAcc.compile`` auto, ``CpuAcc.int8`` not asked "exact"
    (its "auto" resolves to exact on a CPU without VNNI: that is torch's kernels' matter, not
    this route's, whose sums are exact everywhere)."""
    from backplane.native import build

    return (build.mode(options) != "off" and options.get("CpuAcc.compile", "auto") == "auto"
            and str(options.get("CpuAcc.int8", "auto")).strip().lower() != "exact")


def whole(view: SubgraphView, options: Any) -> OptimizationViews | None:
    """The view as one NativeInt8 layer, or None where the native int8 plan does not take it all
    (or is not allowed: see above)."""
    from backplane.native import NativeUnavailable, library
    from backplane.native.qcnn import Unplannable, plan

    graph = view.graph
    if graph is None or not view.inputs or not any(
            layer.op_type in ("QuantizeLinear", "QLinearConv") for layer in view.layers):
        return None
    if not _allowed(options):
        return None
    infos = [graph.info(n) for n in (*view.inputs, *view.outputs)]
    if not all(info.is_static and str(info.dtype) == "float32" for info in infos):
        return None
    names = {n for layer in view.layers for n in layer.inputs if n}
    constants = {n: graph.constants[n] for n in names if n in graph.constants}
    try:
        plan(view.layers, constants, view.inputs, [graph.info(n).shape for n in view.inputs],
             view.outputs)
        library("qcnn")
    except Unplannable as why:
        log.debug("%s..: not native int8 (%s)", view.layers[0].name, why)
        return None
    except NativeUnavailable:
        return None
    attrs = {"layers": list(view.layers), "constants": constants, "inputs": list(view.inputs),
             "outputs": list(view.outputs)}
    first, last = view.layers[0].name, view.layers[-1].name
    from backplane.backends.torch.backend import FUSED_DOMAIN

    layer = Layer(f"{OP}[{first}..{last}]({len(view.layers)} layers)", OP, list(view.inputs),
                  list(view.outputs), attrs, FUSED_DOMAIN, 1)
    return OptimizationViews(substitutions=[Substitution(view, [layer])])


def native_int8_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload:
    """The layer's plan for its inputs' shapes, bound to the library: one C call a run."""
    from backplane.native import library
    from backplane.native.qcnn import Executor, plan

    a = layer.attrs
    planned = plan(a["layers"], a["constants"], a["inputs"], [i.shape for i in inputs],
                   a["outputs"])
    executor = Executor(planned, library("qcnn"))
    return _workload(executor, planned.names,
                     f"{ROUTE}: the whole subgraph planned ({len(planned.records)} records, "
                     f"{planned.macs} multiply-adds)")


def _workload(executor: Any, names: Sequence[tuple[str, str]], why: str) -> Workload:
    """The executor's call on torch tensors: fresh outputs each run (the caller's alone)."""
    import torch

    from backplane.runtime.fresh_outputs import Made

    shapes, call, empty = executor.plan.output_shapes, executor.run, torch.empty

    def run(*values: Any) -> tuple[Any, ...]:
        values = tuple(v if v.is_contiguous() else v.contiguous() for v in values)
        outputs = [empty(shape) for shape in shapes]
        call([v.data_ptr() for v in values] + [o.data_ptr() for o in outputs])
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

    run.route = ROUTE  # type: ignore[attr-defined]
    run.why = why  # type: ignore[attr-defined]
    run.profiled = profiled  # type: ignore[attr-defined]
    run.executor = executor  # type: ignore[attr-defined]
    return run
