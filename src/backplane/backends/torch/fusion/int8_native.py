"""A static int8 CNN subgraph run by backplane's own C (``native/qcnn.c``): the route "native int8".

Why: on this AVX2 EPYC torch's int8 kernels (FBGEMM, oneDNN, oneDNN Graph's int8) are slower than
its float ones, so the corpus's int8 CNNs ran slower than ONNX Runtime's int8 and than
backplane's own float32 of the same model (resnet_qlinear_ort15 0.387 ms against ONNX Runtime's
0.090). ONNX Runtime's MLAS multiplies uint8 by int8 into int32 and requantizes in float; the
native plan (``native.qcnn``) does the same arithmetic in one ctypes call a run, its outputs
ONNX Runtime's bit for bit on the corpus's QOperator and QDQ ResNets (tests/native/test_qcnn.py).

On a CPU with AVX-512 VNNI (this session's AMD EPYC family 26) torch's int8 kernels are exact
(``int8_exact.exact_kernels``), so its traced int8 route is the other choice. The twentieth
session kept it for the full tier's MobileNet (224x224, four depthwise convolutions, hard-swishes
in float between: the plan 5.3-5.6 ms a run at 1 thread, torch's 3.8-4.3, ONNX Runtime's 4.0);
since its hard-swishes are 256-byte tables, its residual Adds one pass (``native.qcnn_lookup``),
its 1x1 convolutions read their input in place and the plan runs on the session's threads
(``native/qcnn_pool.h``), the plan is the faster one at every size measured (1 thread, thread CPU
of ``session.run``, two processes each alternating, load 7-9, ms, plan / torch's int8 / ONNX
Runtime's: mobilenet_dw_ts13 QDQ 2.96-3.13 / 3.80-4.04 / 3.84-3.85, QOperator 2.82-3.04 /
3.78-3.92 / 3.67-3.86; resnet_basic_dyn21 QDQ 1.62-1.66 / 1.74-1.92 / 1.81-1.93, QOperator
1.55-1.65 / 2.00-2.03 / 1.77-1.86), so every plan is taken.

Taken, before CpuAcc's fusions, for a whole subgraph: static float32 inputs and outputs, every
layer one ``native.qcnn_layers`` plans, at least one quantized convolution or product. Under
``CpuAcc.native`` "auto" (the default) and ``CpuAcc.compile`` auto, never with ``CpuAcc.int8``
asked "exact" (CpuRef's values bit for bit: its requantization is its own) or a reduced
``CpuAcc.precision``;
"off", or no C compiler (``NativeUnavailable``): today's routes exactly.
"""

from __future__ import annotations

import logging
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
    infos = [graph.info(n) for n in view.inputs]  # the outputs' shapes are the plan's own
    if not all(info.is_static and str(info.dtype) == "float32" for info in infos) or not all(
            str(graph.info(n).dtype) == "float32" for n in view.outputs):
        return None
    names = {n for layer in view.layers for n in layer.inputs if n}
    constants = {n: graph.constants[n] for n in names if n in graph.constants}
    try:
        planned = plan(view.layers, constants, view.inputs,
                       [graph.info(n).shape for n in view.inputs], view.outputs)
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
    from backplane.backends.torch.fusion.native_cnn import _workload
    from backplane.native import library
    from backplane.native.qcnn import Executor, plan

    a = layer.attrs
    planned = plan(a["layers"], a["constants"], a["inputs"], [i.shape for i in inputs],
                   a["outputs"])
    executor = Executor(planned, library("qcnn"))
    return _workload(executor, planned.names,
                     f"{ROUTE}: the whole subgraph planned ({len(planned.records)} records, "
                     f"{planned.macs} multiply-adds)", route=ROUTE)
