"""A CpuAcc subgraph with convolutions as one ``OneDnnGraph`` layer, compiled at load by oneDNN Graph.

Why: every call of torch's oneDNN convolution builds its primitive descriptor again, about 20 us even
on a tiny tensor (``bench/bench_call_cost.py``), and a small CNN makes fifty such calls a run, each
on a cache left cold by the last. oneDNN Graph, the graph API of the same library, compiles the
subgraph's partitions (convolutions with their post-ops, pools, elementwise chains) once and then
only executes them. PyTorch reaches it through TorchScript: the layers' workloads, with the routes
it recognizes (``aten::conv2d`` and ``aten::linear``, not the prepacked ``torch.ops.mkldnn`` calls),
are traced into one frozen graph, and its fuser hands the partitions to oneDNN Graph at the second or
third call. Same process, this machine (2 threads, batch 1), layer by layer against compiled:
mobilenet_v3_large 7.3 -> 4.6 ms, efficientnet_b0 10.4 -> 8.2 ms, resnet50 43.6 -> 39.2 ms.

``CpuAcc.compile``: "auto" (the default) takes a float32 subgraph compiled by rule (``by_rule``)
and one in reduced precision where it runs a sample faster than its layers (the choice kept in the
route cache, ``route_cache``); "onednn_graph" keeps the compiled one whenever it compiles;
"layers" runs the layers one by one. A compile taken untimed (by rule, or "onednn_graph") happens
at the subgraph's first run, not at load (``at_first_run``): traced on a sample, frozen, compiled
and checked there, so a load compiles nothing. A subgraph that fails to trace or compile, or whose
outputs do not match its layers', runs traced without the fuser or layer by layer. oneDNN Graph
fusion is a process-wide TorchScript switch: it is on only for a trace or a call that compiles,
and put back as it was (a compiled module runs its partitions whatever it says). Each other
thread count compiles its own module at its first call (``CompiledPerThreads``). An artifact
keeps which OneDnnGraphs its load planned to compile, not the modules: each is compiled at its
first run in the same way (``backends/torch/delegate.py``).

Only subgraphs that tracing cannot get wrong are taken: static boundary shapes, no kernel that reads
a tensor's values on the host unless that tensor is a constant (a traced graph keeps the values it
saw), and only ops from ``TRACED_OPS``, which the fuser was seen to handle. TorchScript is deprecated
in PyTorch 2.x, and its warnings are silenced while tracing; should a later torch drop it, the
tracing fails and the layers run one by one.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from backplane import progress
from backplane.backends.api.backend import OptionError, Workload
from backplane.backends.api.kernels import bind_kernel
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.host_inputs import HOST_INPUTS, NOT_CAPTURABLE
from backplane.backends.torch import threads
from backplane.backends.torch.fusion.patterns import (DEFERRED, because, deferred, fastest,
                                                      named_type, remembered)
from backplane.backends.torch.fusion import quantized
from backplane.backends.torch.fusion.compiled import (  # noqa: F401  # importable from here too
    AtFirstRun, CompiledPerThreads, _close, _layout_guard, compiled_run, fusion_switch)
from backplane.backends.torch.fusion.traceable import TRACEABLE_KERNELS, Forced as _Forced  # noqa: F401
from backplane.backends.torch.fusion.reduced import at_edges, constants, lower, mark
from backplane.backends.torch.fusion.native_cnn import native_workload
from backplane.backends.torch.fusion.sequence import sequence_workload
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

MODES = ("auto", "onednn_graph", "layers")
TRACED_OPS = frozenset({
    "FusedConv", "SqueezeExcite", "Linear", "HardSwishChain", "MaxPool", "AveragePool", "GlobalAveragePool",
    "GlobalMaxPool", "BatchNormalization", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid",
    "HardSwish", "Clip", "Elu", "Add", "Sub", "Mul", "Div", "Flatten", "Reshape", "Squeeze",
    "Unsqueeze", "Concat", "Transpose", "Split", "Slice", "Softmax", "Identity", "ConvTranspose",
    "Resize", "ReduceMean"})
"""The ops a OneDnnGraph may hold: those of the CNNs it was measured and tested on (torchvision's,
the onnx package's light models, the corpus's U-Nets and dynamo-exported MobileNet: ConvTranspose,
Resize and ReduceMean, which the fuser leaves to TorchScript's interpreter). A matrix product whose weights are not constants is not among
them: oneDNN Graph's fuser aborted the process on light_bvlc_alexnet's Gemm with a computed
weight (double free), where no exception can be caught."""
TRACEABLE_ROUTES = {"CpuAcc.conv_route": "torch", "CpuAcc.linear_route": "mkl"}
"""The routes whose calls oneDNN Graph's fuser recognizes in a traced graph."""


def wrap(view: SubgraphView, graph: Graph, layers: Sequence[Layer],
         compute: str | None = None, int8: str = "auto") -> Layer | None:
    """``layers`` (the view's layers after fusion, in order) as one OneDnnGraph layer, or None where
    the subgraph has no convolution or tracing could get it wrong; computing float32 in ``compute``
    where given (``CpuAcc.precision``, ``reduced``). Fused QLinear layers only where ``int8``
    (``CpuAcc.int8``, resolved: ``int8_exact.mode``) keeps them on the float route."""
    half = compute is None and _widened_half(graph, layers)
    allowed = TRACED_OPS | (HALF_OPS if half else set())
    if not any(_convolution(layer) or half and layer.op_type == "Conv" for layer in layers):
        return None
    quantized_ops = {"QuantDequant"} if compute is None else set()  # reduced: a Reduced layer
    if compute is None and int8 == "exact":
        quantized_ops |= quantized.QLINEAR  # traced out of place (``qlinear_traced``)
    if any(layer.op_type not in allowed | quantized_ops
           or (layer.domain and layer.domain != FUSED_DOMAIN) for layer in layers):
        return None
    if half and any(lay.op_type in HALF_OPS and lay.inputs[1] not in graph.constants
                    for lay in layers):
        return None  # a product of computed weights: see TRACED_OPS
    if not view.inputs or not all(graph.info(n).is_static for n in view.inputs):
        return None
    for layer in layers:
        host = HOST_INPUTS.get(layer.op_type, ())
        if layer.op_type in NOT_CAPTURABLE or any(
                i < len(layer.inputs) and layer.inputs[i] and layer.inputs[i] not in graph.constants
                for i in host):
            return None
    constants = {n: graph.constants[n] for layer in layers for n in layer.inputs
                 if n in graph.constants}
    layers = quantized.fusable(list(layers), constants)  # QDQ round trips as the fuser takes them
    shapes = [[layer.op_type, *(list(graph.info(n).shape or ()) for n in layer.inputs[:1])]
              for layer in layers]
    attrs = {"layers": list(layers), "constants": constants, "inputs": list(view.inputs),
             "outputs": list(view.outputs), "shapes": shapes,
             "channels_last": _channels_last_inputs(view, graph, layers[0].backend)}
    if half:  # float16 computed in float32, rounded to float16 at the outputs
        compute = "float32"
        attrs.update(source="float16")
    if compute is not None:
        attrs.update(layers=mark(layers, compute), compute=compute,
                     output_dtypes=[graph.info(n).dtype for n in view.outputs])
    first, last = layers[0].name.split("+")[0], layers[-1].name.split("+")[-1]  # model node names
    name = f"OneDnnGraph{f'[{compute}]' if compute else ''}[{first}..{last}]({len(layers)} layers)"
    return Layer(name, "OneDnnGraph", list(view.inputs), list(view.outputs), attrs, FUSED_DOMAIN, 1)


HALF_OPS = frozenset({"Conv", "Gemm"})
"""Unfused ops a float16 OneDnnGraph may hold (the fusions take float32 weights only): the
subgraph's constants are widened to float32 at load, so their weights are float32 constants of
the trace, which the fuser takes as it takes FusedConv's and Linear's; their weights must be
constants (``TRACED_OPS``)."""


def _widened_half(graph: Graph, layers: Sequence[Layer]) -> bool:
    """Whether the subgraph holds float16 tensors on a CPU without float16 arithmetic: it is then
    computed in float32, as a Traced one is (``traced.native_half``), where oneDNN Graph's
    float32 partitions can take its convolutions (mobilenet_fp16_ts17 was a Traced partition)."""
    from backplane.backends.torch.fusion.traced import HALF, native_half

    names = {n for layer in layers for n in (*layer.inputs, *layer.outputs) if n}
    return any(graph.info(n).dtype == HALF for n in names) and not native_half()


def _convolution(layer: Layer) -> bool:
    """A FusedConv, a fused QLinearConv, or a QDQ round trip holding a FusedConv
    (``quantized.then_quant_dequant``)."""
    if layer.domain != FUSED_DOMAIN:
        return False
    if layer.op_type == "QLinearConv":
        return True
    held = layer.attrs.get("layers") or [] if layer.op_type == "QuantDequant" else [layer]
    return any(lay.op_type == "FusedConv" for lay in held)


def _channels_last_inputs(view: SubgraphView, graph: Graph, backend: str | None) -> list[bool]:
    """For each input, whether it is likely to come channels-last: a 4-D tensor made by a layer of
    the same backend (another partition of it, after a split), whose convolutions run channels-last.
    The trace is built for that layout; the guard (``_layout_guard``) copies an input that comes in
    another one all the same."""
    producers = graph.producers()
    return [len(graph.info(n).shape or ()) == 4 and n in producers
            and producers[n].backend == backend for n in view.inputs]


def onednn_graph_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload:
    """The compiled subgraph or its layers one by one, as ``CpuAcc.compile`` says (see above)."""
    mode = backend.options.get("CpuAcc.compile", "auto")
    if mode not in MODES:
        raise OptionError(f"CpuAcc.compile {mode!r} is not one of {', '.join(MODES)}")
    compute, source = layer.attrs.get("compute"), layer.attrs.get("source", "float32")
    native = native_workload(layer, backend, inputs)  # CpuAcc.native: the whole partition in C
    if native is not None:
        return native
    description = _description(layer)
    known = remembered("graph", description, backend) if mode == "auto" else None
    later = mode == "auto" and known != "layers" and threads.deferring()
    busy = mode == "auto" and known is None and threads.crowded() and not (
        by_rule(layer) and threads.making() is None)  # compiled by rule at its first run, untimed
    if mode == "layers" or known == "layers" or busy or later:  # nothing traced
        why = ("CpuAcc.compile=layers" if mode == "layers" else "kept in the route cache"
               if known == "layers" else DEFERRED if later
               else "a busy machine: not compiled, unmeasured")
        return deferred(edges(layer, because(_named(layers_run(layer, backend), "layers"), why)),
                        later)
    if threads.making() is None and (mode == "onednn_graph" or by_rule(layer)):
        return at_first_run(layer, backend, inputs, mode, known)
    progress.count("CpuAcc: subgraphs traced for oneDNN Graph")  # the background's Trials, or timed
    sample = _sample(inputs, layer.attrs.get("channels_last"), compute, source)
    compiled = _compiled(layer, backend, sample)
    if compiled is None:
        return edges(layer, _uncompiled(layer, backend, sample, mode, description))
    if mode == "onednn_graph":
        return edges(layer, because(compiled, "CpuAcc.compile=onednn_graph"))
    return edges(layer, fastest("graph", description,
                                {"onednn_graph": lambda: compiled,
                                 "layers": lambda: _named(layers_run(layer, backend), "layers")},
                                lambda: sample, backend))


def _description(layer: Layer) -> dict[str, Any]:
    """What the route cache keys a OneDnnGraph's choice by: its layers' ops and input shapes, and
    its compute and source types where not float32."""
    compute, source = layer.attrs.get("compute"), layer.attrs.get("source", "float32")
    return {"layers": layer.attrs["shapes"], **({"compute": compute} if compute else {}),
            **({"source": source} if source != "float32" else {})}


RULE = "compiled and checked, taken without timing it against its layers (by_rule)"
"""The ``why`` of a OneDnnGraph ``by_rule`` takes."""
AT_FIRST_RUN = "to be traced, compiled and checked at its first run"
"""The ``why`` of a OneDnnGraph before its first run (``at_first_run``), after the rule's."""


def at_first_run(layer: Layer, backend: Any, inputs: Sequence[TensorInfo], mode: str,
                 known: str | None) -> Workload:
    """The OneDnnGraph ``layer`` compiled at its first run (``AtFirstRun``): then traced on a
    sample, frozen, compiled by oneDNN Graph at that run's thread count and checked against its
    layers (``_compiled``), where that fails or differs, traced without the fuser or its layers
    (``_uncompiled``); in reduced precision, converted at its edges (``edges``). Its route until
    then is the one planned, "onednn_graph" (what an artifact's blob keeps: ``delegate``). "auto"
    writes its choice to the route cache once compiled, under the load's thread count (a later
    load looks it up there)."""
    from backplane.backends.torch import route_cache

    compute, source = layer.attrs.get("compute"), layer.attrs.get("source", "float32")
    description = _description(layer)
    key = route_cache.key("graph", description) if mode == "auto" else None

    def make() -> Workload:
        progress.count("CpuAcc: subgraphs traced for oneDNN Graph")
        sample = _sample(inputs, layer.attrs.get("channels_last"), compute, source)
        compiled = _compiled(layer, backend, sample)
        if compiled is None:
            return edges(layer, _uncompiled(layer, backend, sample, mode, description))
        why = "CpuAcc.compile=onednn_graph" if key is None else _kept_by_rule(key, backend, known)
        return edges(layer, because(compiled, why))
    why = ("CpuAcc.compile=onednn_graph" if key is None else "kept in the route cache"
           if known == "onednn_graph" else RULE)
    return AtFirstRun(make, route="onednn_graph", why=f"onednn_graph: {why}; {AT_FIRST_RUN}")


def by_rule(layer: Layer) -> bool:
    """Whether "auto" takes the OneDnnGraph ``layer`` compiled, once it compiles and its outputs
    match its layers', without timing it against them: a float32 subgraph, also one widened from
    float16 (one in reduced precision, ``CpuAcc.precision``, is timed).

    Timing it cost a build of the layers (each convolution's routes timed) and six calls of each:
    most of the demo model's load. And it always chose the same: run in one process, the two
    alternating in blocks (the best block medians; this 2-core AMD EPYC at load 6-14, 2 threads),
    the layers took 1.23-14.6 times the compiled graph's time on every model of the corpus with a
    OneDnnGraph (small tier: mobilenet_dw_ts13 2.52, mobilenet_dw_dyn18 2.85, mobilenet_fp16_ts17
    3.95, resnet_basic_ts16 2.47, resnet_basic_dyn21 2.44, unet_resize_dyn20 1.96, unet_resize_ts13
    2.32, fakequant_qdq_ts13 3.24, resnet_qdq_ort17 1.81, yolo_v8_ts17 1.23, layout_hswish_ts11
    14.6; full tier: mobilenet_dw_ts13 1.83, resnet_basic_dyn21 1.51, unet_resize_dyn20 1.65,
    yolo_v8_ts17 1.27), on the demo (1.30) and on a 2-convolution 16x16 CNN (1.68-1.90). Timed at
    load on that busy machine, the layers had won on yolo_v8_ts17, unet_resize_ts13,
    mobilenet_fp16_ts17 and that CNN: the load's bursts, not the routes."""
    return layer.attrs.get("compute") in (None, "float32")


def _kept_by_rule(key: str, backend: Any, known: str | None) -> str:
    """The ``why`` of a compiled graph ``by_rule`` takes; the choice written to the route cache
    under ``key`` where it is not there yet, as a measured one was (a later load on a busy machine
    then compiles it: ``known`` is not None there)."""
    from backplane.backends.torch import route_cache

    if known == "onednn_graph":
        return "onednn_graph: kept in the route cache"
    if backend.options.get("CpuAcc.route_cache", True):
        route_cache.store(key, "onednn_graph")
    return f"onednn_graph: {RULE}"


def _uncompiled(layer: Layer, backend: Any, sample: list[Any], mode: str,
                description: dict[str, Any]) -> Workload:
    """Where oneDNN Graph cannot compile the subgraph: its layers traced without the fuser
    (``traced.compile_traced``), kept where "auto" measures the trace faster or the mode is
    "onednn_graph", else the layers one by one. A U-Net's Resize once made the fuser fail, and its
    partition then ran layer by layer, slower than the trace that the same layers make elsewhere."""
    from backplane.backends.torch.fusion import traced

    def layers() -> Workload:
        return _named(layers_run(layer, backend), "layers")

    trace = traced.compile_traced(layer, backend, sample)
    if trace is None:
        return because(layers(), "oneDNN Graph could not compile it, nor could it be traced")
    why = "oneDNN Graph could not compile it: traced"
    if mode == "onednn_graph":
        return because(trace, why)
    run = fastest("graph", description, {"traced": lambda: trace, "layers": layers},
                  lambda: sample, backend)
    run.why = f"{why}; {getattr(run, 'why', '')}"  # type: ignore[attr-defined]
    return run


def edges(layer: Layer, run: Workload) -> Workload:
    """``run`` as the layer's workload: where it computes in reduced precision (its ``compute``),
    float32 converted to that type on entry and back on exit (``reduced.at_edges``)."""
    compute = layer.attrs.get("compute")
    return run if compute is None else at_edges(run, compute, layer.attrs["output_dtypes"],
                                                layer.attrs.get("source", "float32"))


def _named(run: Callable[..., Any], route: str) -> Workload:
    run.route = route  # type: ignore[attr-defined]  # which one was kept, for tests and debugging
    return run


SAMPLE_SEED = 1
"""The seed of ``_sample``'s values: the compile's check (``_compiled``) decides the same way at
every load. On a random sample it refused the full tier's QDQ MobileNet in about one load of 30
(its far share, ``quantized.within_steps``, over the 1% limit in 1 of 30 samples, mean 0.51%), and
each load drew from the caller's torch random state."""


def _sample(inputs: Sequence[TensorInfo], channels_last: Sequence[bool] | None = None,
            compute: str | None = None, source: str = "float32") -> list[Any]:
    """Seeded random inputs (``SAMPLE_SEED``) of the boundary's shapes and types (float32 ones,
    ``source`` ones where given, in ``compute`` where given), channels-last where
    ``channels_last`` says."""
    import torch

    from backplane.backends.torch.kernels.common import NUMPY_TO_TORCH

    values = []
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    for info, last in zip(inputs, channels_last or [False] * len(inputs)):
        dtype = NUMPY_TO_TORCH[info.dtype]  # type: ignore[index]
        if compute and dtype == named_type(source):
            dtype = named_type(compute)
        value = (torch.randn(info.shape, dtype=dtype, generator=generator)  # type: ignore
                 if dtype.is_floating_point  # type: ignore[union-attr]
                 else torch.zeros(info.shape, dtype=dtype))  # type: ignore[arg-type]
        values.append(value.contiguous(memory_format=torch.channels_last) if last else value)
    return values


def layers_run(layer: Layer, backend: Any) -> Callable[..., tuple[Any, ...]]:
    """The layers' workloads (``layer.attrs["layers"]``, of a OneDnnGraph or a Reduced layer) one
    after the other, each value dropped after its last reader; in ``attrs["compute"]`` where given
    (its constants, and each float32 result, converted: ``reduced``)."""
    import torch

    from backplane.backends.torch import fusion

    inner: list[Layer] = layer.attrs["layers"]
    steps = []
    for lay in inner:
        if lay.domain == FUSED_DOMAIN:
            workload = fusion.WORKLOADS[lay.op_type](lay, backend, ())
        else:
            workload = bind_kernel(backend.kernel_for(lay), lay.attrs, len(lay.outputs))
        steps.append((workload, lay.inputs, lay.outputs))
    compute, source = layer.attrs.get("compute"), layer.attrs.get("source")
    dtype = None if compute is None else named_type(compute)
    kind = None if source is None else named_type(source)  # what compute replaces: float32
    template = constants(inner, layer.attrs["constants"], dtype, kind)
    run = sequence_workload(inner, steps, template, layer.attrs["inputs"], layer.attrs["outputs"],
                            None if dtype is None else lambda t: lower(t, dtype, kind))
    run.inner = [(lay, workload) for lay, (workload, _, _) in zip(inner, steps)]  # type: ignore[attr-defined]
    return run


def _compiled(layer: Layer, backend: Any, sample: list[Any], nan_free: bool = True
              ) -> Workload | None:
    """The subgraph traced, frozen and compiled by oneDNN Graph, or None where that fails or its
    outputs on ``sample`` differ from the traced layers' own (by more than ``_close`` allows; an
    output of a QDQ round trip, by more than a quantized model does: ``quantized.within_steps``).
    Where ``nan_free`` and its inputs have a bound that keeps NaN out (``fusion/nan_free.py``),
    traced with oneDNN's own ReLU, clamp and max pool, and guarded by that bound: the NaN-keeping
    compile (``nan_free`` False) is made at the first call with inputs beyond it.

    The layers' own outputs are those the trace computed (a trace runs the layers on the sample),
    not a run of their own; the module is called twice: the profiling executor's profiled run
    (``torch._C._jit_get_num_profiled_runs()`` is 1), then the run that hands its partitions to
    oneDNN Graph, compiles and runs them, whose outputs are checked. It was a run of the layers
    and the trace's, then five calls of the module (two to warm it for a timing, which
    ``taking_turns`` warms itself).

    The trace, the freeze and the profiled call run the layers uncompiled, at one thread; only the
    compiling call runs at the caller's count, which the partitions keep. At two threads on a
    busy machine each of the layers' parallel regions waited for the second thread to get a CPU:
    the demo model's first run (its compile) took 0.27-3.3 s, median 2.9; at one thread
    0.20-0.85, median 0.31 (5 processes each, alternating, load 2.4-3.3, this 2-core AMD EPYC;
    its runs after that as fast)."""
    import torch

    from backplane.backends.torch.fusion import nan_free as free
    from backplane.backends.torch.fusion.static_sizes import fold_sizes
    from backplane.backends.torch.kernels.common import nan_free_trace

    limit = free.input_limit(layer, sample) if nan_free else None
    if limit is not None:
        with nan_free_trace():
            fast = _compiled(layer, backend, sample, nan_free=False)
        if fast is not None:
            return free.guarded(fast, limit, lambda: _compiled(layer, backend, sample, False)
                                or _named(layers_run(layer, backend), "layers"))
    traceable = layers_run(layer, _Forced(backend, TRACEABLE_ROUTES))
    seen: list[Any] = []

    def recorded(*values: Any) -> Any:
        outputs = traceable(*values)
        seen.append(outputs)
        return outputs

    count = torch.get_num_threads()
    try:
        with _fusion(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation and tracer warnings: checked just below
            torch.set_num_threads(1)  # what follows runs the layers, uncompiled: see above
            try:
                traced = _trace(recorded, sample)
                fold_sizes(traced.graph)  # static boundary: a Flatten's size arithmetic done once
                module = _freeze(traced)
                module(*sample)  # profiled: the types the fuser needs
            finally:
                torch.set_num_threads(count)
            got = module(*sample)  # the partitions compiled by oneDNN Graph at count, then run
    except Exception:  # noqa: BLE001  # any failure to trace or compile: the layers run instead
        return None
    got, expected = got if isinstance(got, tuple) else (got,), seen[0]
    steps = quantized.output_steps(layer.attrs["layers"], layer.attrs["outputs"])
    if len(got) != len(expected) or not all(
            _close(g, e) or step is not None and quantized.within_steps(g, e, step)
            for g, e, step in zip(got, expected, steps)):
        return None
    modules = CompiledPerThreads(lambda: _freeze(traced), {count: module})
    return _named(compiled_run(modules, sample), "onednn_graph")


@contextlib.contextmanager
def _fusion(on: bool = True) -> Iterator[None]:
    """oneDNN Graph fusion on (a process-wide TorchScript switch; off where not ``on``) and no
    autograd, for a trace, a freeze or a call; the switch put back as it was."""
    import torch

    with fusion_switch(on), torch.no_grad():
        yield


def _trace(traceable: Callable[..., Any], sample: Sequence[Any], fusion: bool = True) -> Any:
    """``traceable`` traced on ``sample`` as a TorchScript module, in a compilation unit of its own
    (with oneDNN Graph fusion on where ``fusion``; ``traced`` traces without).

    ``torch.jit.trace`` defines every traced module's type and ``forward`` in torch's one
    process-wide compilation unit (``torch.jit._state._python_cu``), and nothing ever removes them:
    each graph (the subgraph's weights as its constants), its frozen copy and oneDNN Graph's
    partitions compiled for both stayed in memory after the session was gone, 11-20 MB per
    tiny_mobilenet_v3 session on this AMD EPYC (``bench/memory.py --sessions``). A module whose
    unit is its own holds the unit, and ``torch.jit.freeze`` clones into the same unit: all of it
    goes with the module. This is ``torch.jit.trace``'s own path (``trace_module``) with the unit
    given; torch's private names, so a torch that changes them fails the trace here, and the
    layers then run one by one (``_compiled``)."""
    import torch
    from torch.jit._trace import _create_interpreter_name_lookup_fn

    module = torch._C.ScriptModule("Subgraph", torch._C.CompilationUnit(), True)
    module._register_attribute("training", torch._C.BoolType.get(), False)  # eval: freezable
    with _fusion(fusion), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation, the tracer's warnings
        module._create_method_from_trace("forward", traceable, tuple(sample),
                                         _create_interpreter_name_lookup_fn(0), True, False,
                                         [], False)  # strict, not forced out of place, as trace's
    return torch.jit.RecursiveScriptModule._construct(module, lambda _: None)


def _freeze(module: Any, fusion: bool = True) -> Any:
    """``module`` frozen (its buffers become constants: oneDNN Graph takes constant weights), on
    one thread: freezing compares constants of equal shapes pairwise (``at::equal``, a parallel
    region each, which on a busy machine waits for a preempted thread): resnet50 froze in 0.01 to
    0.02 s on one thread, 0.06 to 0.8 s on two, on this 2-core machine with others' load."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _fusion(fusion), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.freeze(module)
    finally:
        torch.set_num_threads(threads)
