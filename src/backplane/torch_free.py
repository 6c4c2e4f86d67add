"""A default session's runs without torch where CpuAcc would run the whole model in backplane's C.

Why: importing torch is 2.4-3.2 s of a cold session's 2.8-4.8 s to its first output (thread CPU,
this 2-core EPYC; ONNX Runtime's 0.05-0.2 s: issue 27, item 5), and a small CNN that CpuAcc plans
whole for ``native/cnn.c`` (route "native") or ``native/qcnn.c`` ("native int8") never calls a
torch kernel: torch only carried its tensors. So for a model of float32 inputs (or float16: the C
converts its edges) whose layers are all ops those plans (and the CpuAcc fusions before them) take,
a default session
(``deferred_load``) does not import torch at its load. The first run with a signature (the inputs'
shapes) builds, for those shapes, what the default session's CpuAcc builds: the optimizer's passes,
then ``CpuAcc.optimize_subgraph`` itself (its fusions import no torch) on a stand-in that holds the
options (``_Options``), which must give one OneDnnGraph or NativeInt8 layer for the whole model;
then ``native_cnn.native_executor`` (its rules: ``CpuAcc.native``, the 16e6 multiply-add rule, the
library) or the int8 plan, run on NumPy arrays. The same plan, the same C: the outputs are those of
the session with torch (tests/test_load_torch_free.py asserts it bit for bit).

Anything else, at load or at a run (a layer outside the plans, a signature whose build is not one
native layer, a partition above the rule, a feed not of the input's NumPy type, a read of the
placement), starts the default backends' load as before (``deferred_load.Later``), and the session
is the one with torch from then on; its runs until that load is done bridge it (on the plan where
it is above the rule only, ``TorchFree.bridge``; else on CpuRef, ``Later.bridged``). What is not
taken: float16 partitions where the library does not convert their edges (torch converted them),
Specialized builds beyond the first signatures (``SIGNATURES``), models with control flow, a
``CpuAcc.*`` option other than the defaults this reads.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

log = logging.getLogger("backplane.session")

DEFAULT_BACKENDS = ("CpuAcc", "CpuRef")
"""A default session's backend list (``deferred_load.deferrable``'s): the preferences of the
session with torch, whose report a read of the placement would otherwise wait for."""
SIGNATURES = 8
"""Input signatures planned without torch per session (CpuAcc.specialize's default count)."""

_FOLDED = {"Constant", "Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Identity",
           "Dropout", "Slice", "ConstantOfShape", "Range"}
"""Ops of the shape computations a static signature folds away (dynamo's Reshape sizes)."""
_FUSED_AWAY = {"BatchNormalization", "Gemm", "MatMul", "HardSigmoid", "HardSwish", "Erf",
               "QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "Relu"}
"""Ops CpuAcc's fusions or the int8 plan take into the layers the native plans read."""
_EDGES = (np.float32, np.float16)
"""The models' input and output types: float16 where the plan converts its edges in C
(``native_cnn``: a float16 partition computed in float32, as CpuAcc's native route runs it)."""
_QUANTIZED = {"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul"}
"""A model without them gets CpuAcc.int8 "exact" on the stand-in: its "auto" probes torch's int8
kernels (``int8_exact.exact_kernels``), and the modes differ only in the matchers of quantized
layers (``fusion.INT8_MATCHERS``); a quantized model is taken only by the int8 plan
(``int8_native.whole``), tried before that probe."""


def _ops() -> frozenset[str]:
    from backplane.native.cnn_layers import PLANNERS as FLOAT
    from backplane.native.qcnn_layers import PLANNERS as INT8

    return frozenset({*FLOAT, *INT8, *_FOLDED, *_FUSED_AWAY})


def candidate(graph: Graph, options: Mapping[str, Any]) -> bool:
    """Whether a session of ``graph`` may run without torch: float32 (or float16) inputs and
    outputs, every layer an op the native plans (or the fusions and folds before them) take,
    ``CpuAcc.native`` not off, no option that changes CpuAcc's route."""
    from backplane.native import build

    if os.environ.get(build.SWITCH, "1").strip().lower() in ("0", "off", "false", "no") \
            or build.compiler() is None:  # no library can be built: torch's routes, at once
        return False
    if build.mode(options) == "off" or any(
            options.get(k, v) != v for k, v in (("CpuAcc.compile", "auto"),
                                                ("CpuAcc.precision", "fp32"),
                                                ("CpuAcc.background", False))):
        return False
    ops = _ops()
    if not graph.layers or any(lay.op_type not in ops or lay.domain not in ("", "ai.onnx")
                               for lay in graph.layers):
        return False
    return all(graph.info(n).dtype in _EDGES for n in (*graph.inputs, *graph.outputs))


class _Options:
    """What ``CpuAcc.optimize_subgraph`` and ``native_executor`` read of their backend: its id,
    options and capabilities; never its kernel table (torch's)."""

    id = "CpuAcc"
    missing = None

    def __init__(self, options: Mapping[str, Any]) -> None:
        from backplane.backends.api.backend import BackendOptions

        self.options = BackendOptions(dict(options))

    def capabilities(self) -> dict[str, Any]:
        return {"HostThreads": "openmp"}

    def optimize_subgraph(self, view: SubgraphView) -> Any:
        from backplane.backends.torch.backend import CpuAcc

        return CpuAcc.optimize_subgraph(self, view)  # type: ignore[arg-type]


def build(graph: Graph, options: Mapping[str, Any], shapes: Sequence[tuple[int, ...]],
          rule: bool = True) -> Callable[..., list[np.ndarray]] | None:
    """The model for inputs of ``shapes`` as one native call on NumPy arrays (fresh outputs), or
    None where CpuAcc would not run it whole in C (the reason in the debug log). ``rule`` False:
    a float32 plan above the native size rule is built too, its run marked ``above_rule``
    (a bridge until torch's load is done: ``TorchFree``)."""
    from backplane.backends.torch import specialize
    from backplane.backends.torch.backend import FUSED_DOMAIN

    quantized = any(lay.op_type in _QUANTIZED for lay in graph.layers)
    stand = _Options(options if quantized else {**options, "CpuAcc.int8": "exact"})
    static = all(graph.info(n).is_static for n in graph.inputs)
    if static:  # CpuAcc's optimize_subgraph on the model as placed (the optimizer's passes done)
        built = graph
        for lay in built.layers:
            lay.backend = stand.id
        views = stand.optimize_subgraph(SubgraphView.of(built, built.layers))
        if views.failed or len(views.substitutions) != 1 or len(
                views.substitutions[0].substitutable.layers) != len(built.layers):
            log.debug("torch-free: CpuAcc's subgraph is not one layer")
            return None
        layers = list(views.substitutions[0].replacement)
        infos = [graph.info(n) for n in graph.inputs]
    else:  # a Specialized layer's build for these shapes (``specialize.built_graph``)
        wrapped = specialize.wrap(SubgraphView.of(graph, graph.layers), graph, stand)
        if wrapped is None:
            return None
        fed = [np.empty(s, graph.info(n).dtype) for n, s in zip(graph.inputs, shapes)]
        made = specialize.built_graph(wrapped, stand, fed)
        if made is None:
            return None
        layers = list(made.layers)
        infos = [made.info(n) for n in made.inputs]
    if len(layers) != 1 or layers[0].domain != FUSED_DOMAIN or \
            sorted(layers[0].outputs) != sorted(graph.outputs) or \
            list(layers[0].inputs) != list(graph.inputs):
        log.debug("torch-free: %d layers built, not one native partition (%s)", len(layers),
                  [(lay.op_type, lay.inputs, lay.outputs) for lay in layers][:3])
        return None
    run = _native(layers[0], stand, infos, rule)
    if run is None or list(layers[0].outputs) == list(graph.outputs):
        return run
    order = [list(layers[0].outputs).index(n) for n in graph.outputs]

    def ordered(*values: np.ndarray) -> list[np.ndarray]:
        made = run(*values)
        return [made[i] for i in order]

    ordered.executor = run.executor  # type: ignore[attr-defined]
    ordered.above_rule = run.above_rule  # type: ignore[attr-defined]
    return ordered


def _native(layer: Layer, stand: _Options, infos: Sequence[TensorInfo],
            rule: bool = True) -> Callable[..., list[np.ndarray]] | None:
    from backplane.native import NativeUnavailable, library

    above = False
    if layer.op_type == "OneDnnGraph" and not rule:
        executor = _unruled(layer, infos)
        if executor is None:
            return None
        from backplane.backends.torch.fusion.native_cnn import SMALL

        above = executor.plan.flops > SMALL
    elif layer.op_type == "OneDnnGraph":
        from backplane.backends.torch.fusion.native_cnn import native_executor

        found = native_executor(layer, stand, infos)
        if found is None or found[2] and not found[3]:  # float16 edges torch would convert
            return None
        executor = found[0]
    elif layer.op_type == "NativeInt8":
        from backplane.native import qcnn

        a = layer.attrs
        try:
            planned = qcnn.plan(a["layers"], a["constants"], a["inputs"],
                                [i.shape for i in infos], a["outputs"])
            executor = qcnn.Executor(planned, library("qcnn"))
        except (qcnn.Unplannable, NativeUnavailable):
            return None
    else:
        return None

    def run(*values: np.ndarray) -> list[np.ndarray]:
        return executor.numpy(*values)

    run.executor, run.above_rule = executor, above  # type: ignore[attr-defined]
    return run


def _unruled(layer: Layer, infos: Sequence[TensorInfo]) -> Any:
    """``native_executor``'s plan of a float32 OneDnnGraph without its size rule (the candidate's
    options are the defaults it reads), or None where the plan does not cover it."""
    from backplane.native import NativeUnavailable, library
    from backplane.native.cnn import Executor, Unplannable, plan

    a = layer.attrs
    if a.get("compute") or a.get("source") or not all(
            info.is_static and str(info.dtype) == "float32" for info in infos):
        return None
    try:
        planned = plan(a["layers"], a["constants"], a["inputs"], [i.shape for i in infos],
                       a["outputs"])
        return Executor(planned, library("cnn"))
    except (Unplannable, NativeUnavailable) as why:
        log.debug("torch-free: %s not planned (%s)", layer.name, why)
        return None


class TorchFree:
    """A default session's stand-in for its background load (``deferred_load.Later``) while its
    runs need no torch: ``adopt`` with the run's feeds runs them natively where a plan is built
    for their signature; otherwise it starts the background load (``make``) and hands over. A
    model of static inputs is built at once in a thread of its own, which starts the background
    load where the build fails. A plan above the native size rule (the demo, 33.6e6
    multiply-adds: torch's route is the faster at steady state) is a bridge: the background load
    starts, and runs of that signature take the plan until the load is done (``bridge``; torch's
    import is 2-3 s of the demo's first output otherwise), then the session with torch."""

    def __init__(self, graph: Graph, options: Mapping[str, Any],
                 make: Callable[[], Any]) -> None:
        self.graph, self.options, self.make = graph, dict(options), make
        self.names = list(graph.inputs)
        self.runners: dict[tuple[tuple[int, ...], ...], Any] = {}
        self.bridge: tuple[tuple[tuple[int, ...], ...], Any] | None = None
        """The static signature's plan above the rule, run while torch's load is under way."""
        self.lock = threading.Lock()
        self.later: Any = None
        self.cancelled = False
        self.ready = threading.Event()
        infos = [graph.info(n) for n in self.names]
        if all(info.is_static for info in infos):
            import contextvars

            shapes = tuple(tuple(int(d) for d in info.shape) for info in infos)
            self.thread = threading.Thread(target=contextvars.copy_context().run,
                                           args=(self._first, shapes), daemon=True,
                                           name="backplane-torch-free")
            BUILDING.add(self)
            self.thread.start()
        else:
            self.ready.set()

    def _first(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        try:
            with self.lock:
                run = self._built(shapes, rule=False)
                if run is None or run.above_rule:
                    self.runners.pop(shapes, None)
                    self.bridge = None if run is None else (shapes, run)
                    self._start()  # torch's import begins once the plan is made
        finally:
            self.ready.set()
            BUILDING.discard(self)

    def _built(self, shapes: tuple[tuple[int, ...], ...], rule: bool = True) -> Any:
        """The runner of ``shapes``, built now where it is not (under ``lock``), or None."""
        run = self.runners.get(shapes)
        if run is not None or len(self.runners) >= SIGNATURES or any(
                not _fits(self.graph.info(n), s) for n, s in zip(self.names, shapes)):
            return run
        try:
            run = build(self.graph.private_copy(), self.options, shapes, rule)
        except Exception as exc:  # noqa: BLE001  # the session with torch runs it
            log.debug("torch-free: no build for %s (%s: %s)", shapes, type(exc).__name__, exc)
            run = None
        if run is not None:
            self.runners[shapes] = run
        return run

    def _start(self) -> None:
        """The default backends' load begun (under ``lock``), where it is not and not cancelled."""
        if self.later is None and not self.cancelled:
            from backplane import deferred_load

            log.info("the default backends' load starts: this model's runs need torch")
            self.later = deferred_load.Later(self.make)

    def _values(self, feeds: Mapping[str, Any]) -> list[np.ndarray] | None:
        """The feeds in the inputs' order where all are NumPy arrays of the inputs' types
        (float32, float16), else None."""
        if len(feeds) != len(self.names):
            return None
        values = []
        for name in self.names:
            value = feeds.get(name)
            if type(value) is not np.ndarray or value.dtype != self.graph.info(name).dtype:
                return None
            values.append(value)
        return values

    def runner(self, feeds: Mapping[str, Any]) -> Any:
        """The native run of ``feeds`` (built at their signature's first), or None."""
        values = self._values(feeds)
        if values is None:
            return None
        shapes = tuple(v.shape for v in values)
        run = self.runners.get(shapes)
        if run is None:
            with self.lock:
                run = self._built(shapes)
            if run is None:
                return None
        return lambda: run(*values)

    def bridged(self, feeds: Mapping[str, Any]) -> list[np.ndarray] | None:
        """The bridge's outputs of ``feeds`` while torch's load is under way (its signature's),
        the feeds handed to that load for a first run of its own (``Later.warm``), else None."""
        later, bridge = self.later, self.bridge
        if bridge is None or later is None or later.done.is_set():
            return None
        values = self._values(feeds)
        if values is None or tuple(v.shape for v in values) != bridge[0]:
            return None
        later.warm(dict(zip(self.names, values)))
        return bridge[1](*values)

    def adopt(self, session: Any, feeds: Mapping[str, Any] | None = None) -> list[Any] | None:
        """The run's outputs where ``feeds`` run natively (the bridge's too, while torch's load
        is under way); else the background load started (or taken where started) and adopted
        (``Later.adopt``: its bridge's outputs, or None, the session the one with torch)."""
        self.ready.wait()
        if feeds is not None and self.later is None:
            found = self.runner(feeds)
            if found is not None:
                return found()
        if feeds is not None:
            outputs = self.bridged(feeds)
            if outputs is not None:
                return outputs
        with self.lock:
            self._start()
        session._later = self.later
        return self.later.adopt(session, feeds)  # bridged on CpuRef, or the session with torch

    def providers(self) -> tuple[str, ...]:
        """The backend list a default session's runs have (``get_providers``), where its runs
        need no torch (a model of static inputs: once its plan is made); () where the background
        load has begun (the session then reads its report, as a deferred session does)."""
        self.ready.wait()
        return () if self.later is not None else DEFAULT_BACKENDS

    def wait(self, timeout: float | None = None) -> bool:
        if not self.ready.wait(timeout):
            return False
        return True if self.later is None else self.later.wait(timeout)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
        if self.later is not None:
            self.later.cancel()


BUILDING: set[TorchFree] = set()
"""The sessions whose static build runs in its thread (``deferred_load.wait`` waits for them)."""


def _fits(info: TensorInfo, shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is one the input's declared shape allows (its fixed sizes kept)."""
    declared = info.shape
    if declared is None:
        return True
    return len(declared) == len(shape) and all(
        not isinstance(d, int) or d < 0 or d == s for d, s in zip(declared, shape))
