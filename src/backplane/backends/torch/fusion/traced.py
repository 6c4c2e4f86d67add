"""A CpuAcc subgraph that oneDNN Graph does not take, as one ``Traced`` layer: its layers traced
into one frozen TorchScript graph, run by TorchScript's interpreter instead of a Python call each.

Why: a subgraph without convolutions (a transformer, a detector's head, a tagger of hundreds of
small layers) ran layer by layer, and at batch 1 the cost per layer (a Python call, its argument
checks, torch's dispatch) is most of its time. Traced, the same kernels run as one graph: on the
corpus's ``encoder4_plain_dyn18`` (140 layers) 1.15 -> 0.45 ms, ``char_tagger_ts14`` (157 layers)
1.20 -> 0.55 ms (this 2-core AMD EPYC, 2 threads). Free-dimension partitions get it per input
signature (``specialize``: each signature's build is a static subgraph).

A trace keeps every value the layers read on the host (a shape, an axis, a count) as it was on the
sample. That is right only where those values cannot change between runs: the boundary's shapes
are static, the kernels' host inputs (``cuda.HOST_INPUTS``) are constants, no layer makes sizes
from data (``cuda.NOT_CAPTURABLE``), as for a CUDA graph; and, checked by running the layers once
under ``HostReads`` before tracing, no kernel turns a value computed from the inputs into a Python
number, list or bool (a branch on data would be frozen into the trace). A subgraph that fails any
of this, fails to trace, or whose traced outputs differ from the layers' own on two samples, runs
layer by layer. On a CPU without float16 arithmetic (``native_half``) a float16 subgraph is
traced computing in float32 (its inputs and constants widened, each float16 result inside too, its
float16 outputs rounded once), as ONNX Runtime's CPU runs such models. With ``CpuAcc.compile``
"auto" the faster of the two on the sample is kept (and remembered in the route cache);
"onednn_graph" keeps the trace whenever there is one; "layers" never traces. The trace uses the
routes TorchScript can hold (``onednn_graph.TRACEABLE_ROUTES``), without oneDNN Graph's fuser; a
packed oneDNN weight is no TorchScript constant, so the linears that take oneDNN's product get
theirs as inputs of the frozen graph (``prepacked.TraceInputs``). A recurrent
layer whose kernel runs on one thread (``recurrent.runs_alone``) is left out of traces on a busy
machine: a trace keeps its ops, not the thread count its kernel sets around them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import OptionError, Workload
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.host_inputs import HOST_INPUTS, NOT_CAPTURABLE
from backplane.backends.torch.fusion import host_chain, native_cnn, onednn_graph, recurrent_net
from backplane.backends.torch import prepacked, static_runtime, threads
from backplane.backends.torch.fusion.patterns import DEFERRED, because, deferred, fastest, remembered
from backplane.backends.torch.fusion.reduced import cpu_flags, mark
from backplane.backends.torch.fusion.host_reads import HostReads
from backplane.backends.torch.fusion.index_glue import fold_index_glue
from backplane.backends.torch.fusion.static_sizes import fold_sizes, fold_views, outputs_made
from backplane.backends.torch.fusion.trace_epilogues import fold_means, fold_relus
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

log = logging.getLogger("backplane.torch")
HALF = np.dtype(np.float16)
MIN_LAYERS = 3  # fewer: the trace saves less than its call costs
UNTIMED_LAYERS = 8
"""On a busy machine a load (at the first run: ``_deferred``) and CpuAcc's background
(``threads.UNTIMED``) trace a subgraph without timing it only from this many layers:
cond_nested_dyn18's 4-layer Linear partition ran 0.064 ms a run traced against 0.052 layer by layer
(this 2-core AMD EPYC, load 4.4); the corpus's transformers, hundreds of layers, run faster traced
(left layer by layer on a busy machine, encoder_padmask_ts17 0.763 ms a run against 0.308 traced,
encoder4_plain_dyn18 1.05 against 0.52, load 4-5)."""
FUSED_TRACEABLE = frozenset({"FusedConv", "Linear", "LinearSiblings", "SqueezeExcite",
                             "QuantDequant", "QLinearConv", "QLinearMatMul", "DynamicQuantMatMul", "QGemm", "HardSwishChain",
                             "GeluChain", "Lookup", "ScaledDotAttention", "WindowedConv",
                             "GroupNorm", "AffineChain", "GruStack", "LstmStack"})
"""The fused layers a trace may hold: their routes have TorchScript forms (``TRACEABLE_ROUTES``)."""
NOT_TRACED = NOT_CAPTURABLE | {"If", "Loop", "Scan", "SequenceMap", "Multinomial", "RandomNormal",
                               "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                               "Dropout"}
"""Ops never traced: sizes from data, bodies of their own, fresh random draws each run (a trace
keeps the seed's draws of torch's generator as they are made, but not NumPy's), Dropout's
training mode read from an input."""


def whole(view: SubgraphView, views: OptimizationViews, native: str = "off") -> OptimizationViews:
    """``views`` (``fusion.fuse``'s of ``view``) with the view as one Traced layer where it is not
    one compiled layer already and ``wrap`` takes it; else each longest run of layers that can be
    traced (between a NonZero, a NonMaxSuppression or a shape read from data) as one. ``native``:
    ``CpuAcc.native`` (``_alone``)."""
    from backplane.backends.torch.fusion import _in_order

    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    subs = views.substitutions
    if views.failed or (len(subs) == 1 and len(subs[0].substitutable.layers) == len(view.layers)):
        return views
    ordered = _in_order(list(view.layers), subs)
    layer = wrap(view, graph, ordered, native)
    if layer is not None:
        return OptimizationViews(substitutions=[Substitution(view, [layer])])
    return host_chain.chained(view, _segments(view, views, ordered, native))  # post-NMS: one step


def _segments(view: SubgraphView, views: OptimizationViews,
              ordered: Sequence[Layer], native: str = "off") -> OptimizationViews:
    """Each longest run of ``ordered`` (the view's layers after fusion, in order: a run of them is
    a convex subgraph) that ``wrap`` takes, as one Traced layer; the rest as ``views`` has it."""
    graph = view.graph
    assert graph is not None
    fused = {id(lay): sub for sub in views.substitutions for lay in sub.replacement}
    split = {id(lay) for sub in views.substitutions if len(sub.replacement) > 1
             for lay in sub.replacement}  # a replacement of several layers stays as it is
    result = OptimizationViews(reasons=dict(views.reasons))
    taken: set[int] = set()

    def originals(run: Sequence[Layer]) -> list[Layer]:
        found = []
        for lay in run:
            sub = fused.get(id(lay))
            found += sub.substitutable.layers if sub is not None else [lay]
        return found

    def close(run: list[Layer]) -> None:
        if len(run) < MIN_LAYERS:
            return
        inner = originals(run)
        part = SubgraphView.of(graph, inner)
        layer = wrap(part, graph, run, native)
        if layer is not None:
            result.substitutions.append(Substitution(part, [layer]))
            taken.update(map(id, run))

    run: list[Layer] = []
    for lay in ordered:
        if id(lay) not in split and _traceable(lay, graph, native):
            run.append(lay)
        else:
            close(run)
            run = []
    close(run)
    result.substitutions += [sub for sub in views.substitutions
                             if id(sub.replacement[-1]) not in taken]
    rest = [lay for lay in ordered if id(lay) not in taken and id(lay) not in fused]
    if rest:
        result.untouched.append(SubgraphView.of(graph, rest))
    return result


def wrap(view: SubgraphView, graph: Graph, layers: Sequence[Layer],
         native: str = "off") -> Layer | None:
    """``layers`` (the view's layers after fusion, in order) as one Traced layer, or None where
    the subgraph is too small or a trace could hold a value that changes between runs."""
    if len(layers) < MIN_LAYERS or not view.inputs:
        return None
    if not all(graph.info(n).is_static for n in view.inputs):
        return None
    if not all(_traceable(layer, graph, native) for layer in layers):
        return None
    names = {n for layer in layers for n in (*layer.inputs, *layer.outputs) if n}
    half = any(graph.info(n).dtype == HALF for n in names)
    if half and native_half():
        return None  # float16 kernels of its own: left as they run
    constants = {n: graph.constants[n] for layer in layers for n in layer.inputs
                 if n in graph.constants}
    shapes = [[layer.op_type, *(list(graph.info(n).shape or ()) for n in layer.inputs[:1])]
              for layer in layers]
    attrs = {"layers": list(layers), "constants": constants, "inputs": list(view.inputs),
             "outputs": list(view.outputs), "shapes": shapes}
    if half:  # float16 computed in float32, rounded to float16 at the outputs
        attrs.update(layers=mark(layers, "float32"), compute="float32", source="float16",
                     output_dtypes=[graph.info(n).dtype for n in view.outputs])
    first, last = layers[0].name.split("+")[0], layers[-1].name.split("+")[-1]
    name = f"Traced{'[float32]' if half else ''}[{first}..{last}]({len(layers)} layers)"
    return Layer(name, "Traced", list(view.inputs), list(view.outputs), attrs, FUSED_DOMAIN, 1)


@functools.lru_cache(maxsize=1)
def native_half() -> bool:
    """Whether this CPU computes float16 itself (AVX512-FP16, AMX-FP16, Arm's FP16 arithmetic):
    elsewhere torch's float16 kernels convert each value, slower than float32 (a float16 CNN of the
    corpus 2.3 ms a run layer by layer on the project's AVX2 machine; its float32 twin 0.3)."""
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16", "asimdhp"})


def _traceable(layer: Layer, graph: Graph, native: str = "off") -> bool:
    """Whether a trace of ``layer`` keeps nothing that changes between runs (as far as the op and
    its constant host inputs tell: ``compile_traced`` checks the kernels' reads too)."""
    if layer.domain == FUSED_DOMAIN and layer.op_type not in FUSED_TRACEABLE:
        return False
    if layer.op_type in NOT_TRACED or any(isinstance(v, Graph) for v in layer.attrs.values()):
        return False
    if layer.op_type in RECURRENT and not layer.domain and _alone(layer, graph, native):
        return False
    host = HOST_INPUTS.get(layer.op_type, ())
    return not any(i < len(layer.inputs) and layer.inputs[i] and layer.inputs[i] not in graph.constants
                   for i in host)


RECURRENT = frozenset({"RNN", "GRU", "LSTM"})


def _busy() -> bool:
    """Whether more tasks are runnable than this process has CPUs (the load average), read
    whatever path this load takes (a background build on a busy machine reads False from
    ``threads.crowded``); never where ``threads.CROWDED_CHECK`` is off (the tests' conftest)."""
    from backplane.backends.torch import threads

    if not threads.CROWDED_CHECK:
        return False
    try:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return os.getloadavg()[0] > (cpus or 1)
    except OSError:
        return False


def _alone(layer: Layer, graph: Graph, native: str = "off") -> bool:
    """Whether a recurrent layer runs its steps on one thread (``recurrent.runs_alone``): a trace
    holds its ops but not the thread count its kernel sets around them, and at two threads each
    step waits for both (crnn_paddle_ts12's and lstm_bi2_ts14's traced LSTMs, 2 threads, load 5:
    2.7 ms a layer against 0.6-1.2 on one). Unknown shapes count as alone; one step (a cell, no
    thread change) does not, nor any where this thread runs one (the kernel changes nothing there,
    and the trace saves a call: the small tier's CRNN 1.25-1.34 ms a run traced whole, 1.49-1.50
    with its LSTM apart, 1 thread), nor on a machine not busy (``_busy``), where the partner thread
    is not preempted and the trace is faster: lstm_bi2_ts14 at 2 threads, load 1.4, small tier
    0.37 ms a run traced whole against 0.55-0.60 apart, full tier 2.32 against 3.05). Nor a layer
    whose steps run in backplane's C under ``native`` (``CpuAcc.native``; ``recurrent.steps_in_c``):
    that loop runs on the calling thread whatever torch's count, and left out of the trace it lost
    its one native call (2 threads, a warm route cache, load 4.4: lstm_bi2_ts14 283 us a run
    against 8.8 traced, crnn_paddle_ts12 549 against 187)."""
    import torch

    from backplane.backends.torch.kernels.recurrent import runs_alone

    if torch.get_num_threads() == 1 or not _busy():
        return False
    from backplane.native import recurrent

    if recurrent.steps_in_c(layer, graph, native):
        return False
    shape = graph.info(layer.inputs[0]).shape
    weight = graph.constants.get(layer.inputs[2]) if len(layer.inputs) > 2 else None
    if shape is None or weight is None or any(not isinstance(d, int) for d in shape):
        return True
    layout = int(layer.attrs.get("layout", 0))
    if shape[layout] == 1:
        return False
    return runs_alone(shape[1 - layout], weight.shape[1], weight.shape[2])


def traced_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload:
    """The traced subgraph or its layers one by one, as ``CpuAcc.compile`` says (see above)."""
    mode = backend.options.get("CpuAcc.compile", "auto")
    if mode not in onednn_graph.MODES:
        raise OptionError(f"CpuAcc.compile {mode!r} is not one of {', '.join(onednn_graph.MODES)}")
    whole = recurrent_net.traced_whole(layer, backend, inputs)
    if whole is not None:  # CpuAcc.native: recurrent layers and their moves, one C call
        return whole
    native = native_cnn.traced_prefix(layer, backend, inputs, traced_workload)
    if native is not None:  # CpuAcc.native: its first layers (a CNN) in C, the others traced
        return native
    description = {"traced": layer.attrs["shapes"], "compute": layer.attrs.get("compute")}

    def layers() -> Workload:
        return _named(onednn_graph.layers_run(layer, backend), "layers")

    def chosen() -> Workload:
        known = remembered("traced", description, backend) if mode == "auto" else None
        later = mode == "auto" and known != "layers" and threads.deferring()
        # (a fused layer that says so counts as the layers it replaced: a GruStack's; the rest of
        # a partition whose first layers run natively counts those: native_cnn.traced_prefix)
        many = sum(lay.attrs.get("replaced", 1) for lay in layer.attrs["layers"]) + \
            layer.attrs.get("after_native", 0) >= UNTIMED_LAYERS
        crowded = mode == "auto" and known is None and threads.crowded()
        if crowded and many and threads.making() is None and not later:
            return because(_deferred(layer, backend, inputs, layers),
                           "a busy machine: traced at the first run, untimed")
        busy = crowded or (mode == "auto" and known is None and
                           threads.making() == threads.UNTIMED and not many)
        if mode == "layers" or known == "layers" or busy or later:  # not traced, timed nor kept
            return deferred(because(layers(), "CpuAcc.compile=layers" if mode == "layers" else
                                    "kept in the route cache" if known == "layers" else
                                    DEFERRED if later else
                                    "a busy machine: not traced, unmeasured"), later)
        if known == "traced":  # an artifact's load, or measured before: traced at the first run
            return because(_deferred(layer, backend, inputs, layers),
                           "kept in the route cache: traced at the first run")
        sample = _sample(layer, inputs)
        fused = onednn_graph._compiled(layer, backend, sample) if known == "llga" else None
        if fused is not None:  # no trace made for nothing
            return because(fused, "llga: kept in the route cache")
        compiled = compile_traced(layer, backend, sample)
        if compiled is None:
            return because(layers(), "could not be traced")
        if mode == "onednn_graph":
            return because(compiled, "CpuAcc.compile=onednn_graph")
        routes = {"traced": lambda: compiled, "layers": layers}
        if _fusable(layer):
            routes["llga"] = lambda: onednn_graph._compiled(layer, backend, sample) or compiled
        return fastest("traced", description, routes, lambda: sample, backend)

    run = chosen()
    return deferred(onednn_graph.edges(layer, run), getattr(run, "deferred", False))


def _fusable(layer: Layer) -> bool:
    """Whether the trace is also measured compiled by oneDNN Graph's fuser (route "llga"): its 2-d
    convolutions become partitions (10-20 us a call of the bridge) and the rest stays in
    TorchScript's interpreter, where a Traced layer's packed convolution cost 40-100 us a call
    beyond its kernel. crnn_paddle_ts12 (small tier, CNN, LSTMs and head in one trace), 1 thread,
    thread CPU, both in one process, alternating: 0.86-0.89 of the trace's time; detect_nms_ts14
    1.30 (its small convolutions on torch's im2col path cost less than a partition)."""
    return not layer.attrs.get("compute") and any(
        lay.op_type == "FusedConv" and not lay.attrs.get("line") for lay in layer.attrs["layers"])


def _sample(layer: Layer, inputs: Sequence[TensorInfo]) -> list[Any]:
    """Random inputs as the layers take them (float16 ones in float32 where they compute so)."""
    return onednn_graph._sample(inputs, None, layer.attrs.get("compute"),
                                layer.attrs.get("source", "float32"))


def compile_traced(layer: Layer, backend: Any, sample: list[Any]) -> Workload | None:
    """The layers traced and frozen, or None where they read a value of the inputs on the host,
    fail to trace, or give other outputs traced than their own (on ``sample`` and one more)."""
    import torch
    from backplane.native.recurrent import natively  # (LSTM, GRU in C: CpuAcc.native)

    traceable = onednn_graph.layers_run(layer, onednn_graph._Forced(backend,
                                                                     onednn_graph.TRACEABLE_ROUTES))
    packing = prepacked.TraceInputs()
    try:
        with torch.no_grad(), warnings.catch_warnings(), _packing(packing), natively(backend):
            warnings.simplefilter("ignore")  # TorchScript's deprecation, the tracer's warnings
            with HostReads(sample) as reads:
                expected = traceable(*sample)  # packs the weights the trace takes as inputs
            if reads.found:
                log.debug("%s runs layer by layer: a kernel reads %s of a computed value on the "
                          "host", layer.name, reads.found[0])
                return None
            packed, count = packing.packed, len(sample)
            trace = onednn_graph._trace(lambda *values: traceable(*values[:count]),
                                        [*sample, *packed], fusion=False)
            fold_sizes(trace.graph)  # static shapes: the size arithmetic done once, here
            fold_views(trace.graph)  # and each chain of views one view
            fold_index_glue(trace.graph)  # idle casts, wraps of indices never negative
            fold_relus(trace.graph)  # a product's Relu done in place by it
            fold_means(trace.graph)  # a mean's 1 / n in the weight of the product reading it
            module = onednn_graph._freeze(trace, fusion=False)
            other = onednn_graph._sample([TensorInfo(tuple(v.shape), _numpy(v.dtype))
                                          for v in sample])
            checks = [(sample, expected), (other, traceable(*other))]
            for values, wanted in checks:
                got = module(*values, *packed)
                got = got if isinstance(got, tuple) else (got,)
                if len(got) != len(wanted) or not all(map(onednn_graph._close, got, wanted)):
                    log.debug("%s runs layer by layer: its trace computes otherwise", layer.name)
                    return None
    except Exception as exc:  # noqa: BLE001  # any failure to trace: the layers run instead
        log.debug("%s runs layer by layer: no trace (%s: %s)", layer.name, type(exc).__name__, exc)
        return None
    call = static_runtime.forward(module, checks, packed, backend, trace.inlined_graph)
    return _named(_traced_run(module, sample, packed, call), "traced")


@contextlib.contextmanager
def _packing(inputs: prepacked.TraceInputs) -> Iterator[None]:
    token = prepacked.TRACED.set(inputs)
    try:
        yield
    finally:
        prepacked.TRACED.reset(token)


def below_autograd() -> Any:
    """The context a frozen trace runs in: dispatched below autograd and ``ADInplaceOrView``
    (torch's ``AutoDispatchBelowADInplaceOrView``, what its own inference-only kernels run under;
    ``no_grad`` where a torch lacks it). Under ``no_grad`` each op still passes both keys, which
    track views and bump the version counters of in-place results, and a trace is all small ops,
    most of them views and in-place activations (the full-tier VAD's: 151 -> 121 us a call at 1
    thread, this 2-core AMD EPYC, load 4.5). The values are the same ops' on the same tensors;
    nothing a run returns requires grad, and the runtime tells an output's memory by its storage,
    not by view metadata (``runtime/ownership.py``)."""
    return below_autograd_guard()()


def below_autograd_guard() -> Any:
    """What ``below_autograd`` makes its context of, to be called at each run without the
    function in between (a run's own Python frames: ``compiled_run``, ``_traced_run``)."""
    import torch

    return getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None) or torch.no_grad


def _traced_run(module: Any, sample: Sequence[Any], packed: Sequence[Any] = (),
                call: Callable[..., Any] | None = None) -> Workload:
    """The frozen ``module``'s call (or ``call``, ``static_runtime``'s): the inputs in their
    sample's layout, then the packed weights (``prepacked.TraceInputs``), below autograd."""
    from backplane.runtime.fresh_outputs import Made

    conform = onednn_graph._layout_guard(sample)
    strides = [tuple(value.stride()) for value in sample]
    forward = call or module._c._get_method("forward")  # C++: no nn.Module call in between
    made = Made if outputs_made(module.graph) else tuple  # each output an op's own result
    guard = below_autograd_guard()

    def run(*values: Any) -> tuple[Any, ...]:
        for value, expected in zip(values, strides):  # conform's check, without its generator
            if value.stride() != expected:
                values = tuple(conform(values))
                break
        with guard():
            outputs = forward(*values, *packed)
        return made(outputs) if type(outputs) is tuple else made((outputs,))

    run.relayouts = conform.relayouts  # type: ignore[attr-defined]
    run.module = module  # type: ignore[attr-defined]  # for tests and debugging
    run.static = getattr(call, "static", None)  # type: ignore[attr-defined]
    run.weights = tuple(packed)  # type: ignore[attr-defined]  # the packed ones it keeps
    return run


AT_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("backplane_traced_at_run",
                                                              default=False)
"""Set while workloads are made at a run (a Specialized signature's build, ``specialize``): a
Traced layer ``_deferred`` would trace at its first run is traced then, at once."""


def _deferred(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
              layers: Callable[[], Workload]) -> Workload:
    """A Traced layer whose route is known: traced at its first run, which a load need not wait
    for; the layers run where the trace fails there. Made at a run (``AT_RUN``), it is traced now:
    the first run is this one, and its calls then reach the trace without this wrapper. It is
    traced on one thread, where the build's first calls ran it before (``small.fewer_threads``'
    untimed calls): at two threads on a busy machine each op of the tracing waits for the second
    (the full-tier VAD's first run 0.25-0.29 -> 0.66-0.77 s at load 5-6, bench/wild.py)."""
    if AT_RUN.get():
        from backplane.backends.torch.small import at_threads

        with at_threads(1):
            return compile_traced(layer, backend, _sample(layer, inputs)) or layers()
    made: list[Workload] = []
    lock = threading.Lock()

    def run(*values: Any) -> tuple[Any, ...]:
        if not made:
            with lock:
                if not made:
                    sample = _sample(layer, inputs)
                    made.append(compile_traced(layer, backend, sample) or layers())
        return made[0](*values)

    run.route = "traced"  # type: ignore[attr-defined]
    return run


def _named(run: Callable[..., Any], route: str) -> Workload:
    run.route = route  # type: ignore[attr-defined]  # which one was kept, for tests and debugging
    return run


def _numpy(dtype: Any) -> Any:
    from backplane.backends.torch.kernels.common import NUMPY_TO_TORCH

    return next(n for n, t in NUMPY_TO_TORCH.items() if t == dtype)
