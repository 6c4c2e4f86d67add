"""A CpuAcc or GpuAcc subgraph whose inputs have free dimensions, specialized per input shapes.

Why: CpuAcc fuses, prepacks and compiles, and GpuAcc captures CUDA graphs, only where shapes are
static, and most models from the wild have a free batch (or sequence, or image size) dimension: their
layers ran one by one, unfused. Such a subgraph becomes one ``Specialized`` layer. At a run, its
workload looks up the input shapes and types (the signature): the first run with a signature builds,
for those shapes, what a static model gets at load (constant folding, which turns Shape -> Gather ->
Concat chains into constants, then the backend's own ``optimize_subgraph`` and workloads: fused
convolutions and linears, a compiled oneDNN Graph, captured CUDA graphs); later runs with it reuse
that. ``<backend>.specialize`` bounds how many signatures are kept (default 8; the least recently
used goes first); 0 keeps the layers shape-generic, one by one. A signature whose build fails runs the
layers one by one too.

The first run of each signature pays for what a load pays for (CpuAcc measures its routes, remembered
on disk by ``route_cache``; GpuAcc captures).
"""

from __future__ import annotations

import copy
import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane import debug
from backplane.backends.api.backend import Workload
from backplane.backends.torch import small
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo
from backplane.runtime import host_route

log = logging.getLogger("backplane.torch")
DEFAULT_SIGNATURES = 8
SIGNATURE = operator.attrgetter("shape", "dtype")
"""An input's part of a signature, (shape, dtype): a C call, no comprehension's frame a run."""
MIN_LAYERS = 2  # a single layer gains nothing from a build


def signatures(backend: Any) -> int:
    """How many input signatures a Specialized layer keeps (``<backend id>.specialize``)."""
    return int(backend.options.get(f"{backend.id}.specialize", DEFAULT_SIGNATURES))


def wrap(view: SubgraphView, graph: Graph, backend: Any) -> Layer | None:
    """The view as one Specialized layer, or None where its inputs are static (or it is too small,
    or specializing is off)."""
    if len(view.layers) < MIN_LAYERS or signatures(backend) <= 0:
        return None
    if all(graph.info(n).is_static for n in view.inputs):
        return None
    names = {n for layer in view.layers for n in (*layer.inputs, *layer.outputs) if n}
    attrs = {"layers": list(view.layers), "inputs": list(view.inputs), "outputs": list(view.outputs),
             "constants": {n: graph.constants[n] for n in names if n in graph.constants},
             "tensors": {n: graph.info(n) for n in names}, "opsets": dict(graph.opsets)}
    first, last = view.layers[0].name, view.layers[-1].name
    name = f"Specialized[{first}..{last}]({len(view.layers)} layers)"
    return Layer(name, "Specialized", list(view.inputs), list(view.outputs), attrs, FUSED_DOMAIN, 1)


def specialized_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload:
    """Per input signature, the subgraph built for those shapes (see above), least recently used out."""
    limit = signatures(backend)
    built: OrderedDict[tuple[Any, ...], Callable[..., Any]] = OrderedDict()
    lock = threading.Lock()
    generic: list[Callable[..., Any]] = []  # made at the first signature that needs it

    def layers_one_by_one() -> Callable[..., Any]:
        if not generic:
            generic.append(_loaded(_graph(layer), backend))
        return generic[0]

    by_shapes: dict[tuple[Any, ...], Callable[..., Any]] = {}  # ``keyed``'s: while one is built
    hosted = host_route.Hosted()  # likewise, its build's NumPy run where it offers one

    def lookup(key: tuple[Any, ...], values: Sequence[Any]) -> Callable[..., Any]:
        runner = built.get(key)  # one dict read, atomic: no lock for a signature built already
        if runner is not None and len(built) > 1:
            with lock:  # the order of use matters only where one may be evicted
                if key in built:
                    built.move_to_end(key)
        if runner is None:
            made = _build(layer, backend, values)
            runner = made or layers_one_by_one()
            with lock:
                built[key] = runner
                by_shapes.clear()  # its runners stand only for a lone signature's
                hosted.clear()
                while len(built) > limit:
                    built.popitem(last=False)
                host = host_route.of(small.unwrapped(made)) if len(built) == 1 else None
                if host is not None:  # the session's direct run calls it on NumPy arrays
                    hosted[tuple(tuple(shape) for shape, _ in key)] = host
        return runner

    def run(*values: Any) -> tuple[Any, ...]:
        key = tuple(map(SIGNATURE, values))  # torch.Size is a hashable tuple
        runner = built.get(key)  # a lone signature's: no frame of ``lookup``'s
        if runner is None or len(built) > 1:
            runner = lookup(key, values)
        return runner(*values)

    def keyed(shapes: tuple[Any, ...], *values: Any) -> tuple[Any, ...]:
        """``run`` for a caller that read ``values``' shapes already, from the NumPy arrays they
        were made of (``prepared_run``'s direct run, whose check fixed their dtypes): while one
        signature is built, its runner by those shapes, without torch's ``.shape`` and ``.dtype``
        per input (the LRU's order matters only with more)."""
        runner = by_shapes.get(shapes)
        if runner is None:
            key = tuple(map(SIGNATURE, values))
            runner = lookup(key, values)
            with lock:
                if len(built) == 1 and built.get(key) is runner:
                    by_shapes[shapes] = runner
        return runner(*values)

    def close() -> None:
        """The built subgraphs' networks closed with the network that holds this layer (their
        buffers from a custom allocator go back at its unload, not when collected)."""
        with lock:
            runners = [*built.values(), *generic]
            built.clear()
            by_shapes.clear()
            hosted.clear()
            generic.clear()
        for runner in runners:
            runner.close()  # type: ignore[attr-defined]

    run.keyed = keyed  # type: ignore[attr-defined]
    run.hosted = hosted  # type: ignore[attr-defined]  # runtime/host_route.py
    run.built = built  # type: ignore[attr-defined]  # for tests and debugging
    run.layer = layer  # type: ignore[attr-defined]  # with its weights (cuda_host builds from it)
    run.exclusive = bool(backend.capabilities().get("CudaGraphs"))  # type: ignore[attr-defined]
    run.destroy = close  # type: ignore[attr-defined]  # called by LoadedNetwork.close
    return run


def _graph(layer: Layer, values: Sequence[Any] = ()) -> Graph:
    """The layers as a graph of their own (copies: the network's stay as they are), its inputs given
    the shapes and types of ``values`` where there are any."""
    layers = [copy.copy(lay) for lay in layer.attrs["layers"]]
    for lay in layers:
        lay.inputs, lay.outputs = list(lay.inputs), list(lay.outputs)
    tensors = dict(layer.attrs["tensors"])
    for name, value in zip(layer.attrs["inputs"], values):
        tensors[name] = TensorInfo(tuple(int(d) for d in value.shape), _numpy_dtype(value.dtype))
    return Graph(layer.name, layers, list(layer.attrs["inputs"]), list(layer.attrs["outputs"]),
                 tensors, dict(layer.attrs["constants"]), dict(layer.attrs["opsets"]))


def _numpy_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, np.dtype):
        return dtype
    from backplane.backends.torch.kernels.common import NUMPY_TO_TORCH

    return next(np.dtype(n) for n, t in NUMPY_TO_TORCH.items() if t == dtype)


def _build(layer: Layer, backend: Any, values: Sequence[Any]) -> Callable[..., Any] | None:
    """The subgraph for the shapes of ``values``: folded, optimized by the backend, its workloads
    made; None where any of that fails (the layers then run one by one)."""
    from backplane.backends.torch.fusion.traced import AT_RUN

    try:
        graph = built_graph(layer, backend, values)
        if graph is None:
            return None
        at_run = AT_RUN.set(True)  # this run is its traces' first: traced now, not at a later call
        try:
            with small.whole():  # its threads chosen for the whole build, not per compiled part
                run = _loaded(graph, backend)
        finally:
            AT_RUN.reset(at_run)
        if backend.capabilities().get("HostThreads") == "openmp":  # CpuAcc
            run = small.deciding(run, values)
        return run
    except Exception as exc:  # noqa: BLE001  # any failure: these shapes run the layers one by one
        shapes = [tuple(v.shape) for v in values]
        log.warning("%s: no build for input shapes %s (%s: %s); its layers run one by one",
                    layer.name, shapes, type(exc).__name__, exc)
        return None


def built_graph(layer: Layer, backend: Any, values: Sequence[Any]) -> Graph | None:
    """The layers of ``layer`` (a Specialized layer) for the shapes and types of ``values``:
    folded, optimized by ``backend`` and its substitutions made (a CudaGraph layer, a compiled
    partition); None where the backend gives any part back."""
    from backplane.optimizer import passes
    from backplane.optimizer.optimize import _substitute
    from backplane.optimizer.report import PlacementReport

    graph = passes.remove_dead_layers(passes.fold_constants(_graph(layer, values)))
    for lay in graph.layers:
        lay.backend = backend.id
    if graph.layers:
        views = backend.optimize_subgraph(SubgraphView.of(graph, graph.layers))
        if views.failed:
            return None
        for sub in views.substitutions:
            _substitute(graph, sub.substitutable.layers, sub.replacement, backend.id,
                        PlacementReport([backend.id]))
    return graph


def _loaded(graph: Graph, backend: Any) -> Callable[..., tuple[Any, ...]]:
    """``graph`` loaded on ``backend`` alone, its inputs and outputs in the backend's memory."""
    from backplane.optimizer.optimize import OptimizedNetwork
    from backplane.optimizer.report import PlacementReport
    from backplane.runtime.loaded_network import LoadedNetwork

    network = OptimizedNetwork(graph, {backend.id: backend}, PlacementReport([backend.id]),
                               list(graph.inputs), list(graph.outputs))
    loaded = LoadedNetwork(network, 0)
    to_backend = backend.tensor_handle_factories()[0].copy_in
    folded = [name in graph.constants for name in graph.outputs]  # outputs folded to NumPy
    alone = _one_step(loaded) if not any(folded) else None

    def run(*values: Any) -> tuple[Any, ...]:
        if alone is not None:
            try:
                results = alone(*values)  # a tuple kept as it is (fresh_outputs.Made)
                return results if isinstance(results, tuple) else tuple(results)
            except Exception:  # noqa: BLE001  # again through the network: its error names the layer
                pass
        outputs = loaded.execute(values)
        if any(folded):
            outputs = [to_backend(o) if f else o for o, f in zip(outputs, folded)]
        return tuple(outputs)

    host = host_route.of(alone) if alone is not None else None
    if host is None and not any(folded):  # steps that all run on NumPy, as one (host_network)
        host = host_route.of(getattr(loaded.execute, "native", None))
    if host is not None:  # the one step's NumPy run is this build's (runtime/host_route.py)
        host_route.offer(run, host)
    run.graph = graph  # type: ignore[attr-defined]  # what was built, for tests and debugging
    run.alone = alone  # type: ignore[attr-defined]  # the one step it calls, where it is one
    run.close = loaded.close  # type: ignore[attr-defined]
    return run


def _one_step(loaded: Any) -> Callable[..., Any] | None:
    """The workload of a network that is one layer reading its inputs and writing its outputs, in
    order (most builds: one OneDnnGraph or Traced layer), to be called without the network's run
    loop (about 5 us a call); None where the network is more, or shares anything between runs
    (``exclusive``: its buffers, a lock)."""
    if len(loaded.steps) != 1 or loaded.exclusive or debug.level() >= 2:  # 2: each layer shown
        return None
    (step,) = loaded.steps
    if step.inputs != loaded.input_slots or step.outputs != loaded.output_slots:
        return None
    return step.workload  # type: ignore[no-any-return]
