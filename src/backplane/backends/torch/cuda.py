"""GpuAcc's CUDA graphs (its memory: ``gpu_memory.py``, imported here as ``cuda.factory``).

Memory: CUDA tensors. ``copy_in`` uploads the host array as it is, from pageable memory: the driver
stages it and returns once it has read the array (it may wait for the stream first). On an H100 that
took 45-55 us for a 1x3x224x224 float input, against 70-110 us for copying it into a pinned buffer of
ours, uploading that asynchronously and recording an event to keep the buffer alive until done;
``copy_out`` downloads it into page-locked memory, which waits for the GPU work queued before it:
that is the sync before another backend or the user reads a GpuAcc output.

CUDA graphs: ``capture_views`` substitutes every static-shape GPU subgraph by one ``CudaGraph`` layer.
Its workload, made at load, uploads the subgraph's constants once, runs the layers' kernels twice on a
side stream (warm-up), captures them into a ``torch.cuda.CUDAGraph`` and from then on, per run,
copies the inputs into the graph's static input tensors and replays it: one launch for the subgraph.
Inside, Conv [-> Add] -> Relu chains run as one cuDNN call and attention blocks as one
scaled-dot-product-attention call (``gpu_fusion.py``), and each value is dropped after its last
reader (``frees``), so that the graph reuses its memory as torch's modules do. A subgraph with a
layer that cannot be captured (sizes read from data: NonMaxSuppression, NonZero, a TopK of computed
k) is captured in runs around it, that layer and every layer reading what it sizes run one by one
(``capturable_runs``; a NonMaxSuppression's post-process on the host: ``gpu_host_chain``); layers
whose capture fails run uncaptured, on the GPU (``CaptureError``).
With ``GpuAcc.precision`` "fp16" or "bf16", float32 runs in that type inside the graph (``PRECISIONS``),
convolutions in channels-last memory (``channels_last``). With ``GpuAcc.compile`` "inductor", the
graph's layers are first compiled by TorchInductor for their shapes (``COMPILERS``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import OptionError, Workload
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.cuda_host import warm_up
from backplane.backends.torch.cuda_predicates import with_host_predicates  # noqa: F401  # GpuAcc's
from backplane.backends.torch.gpu_compile import COMPILERS, compiled, compiler_of  # noqa: F401
from backplane.backends.torch.gpu_fusion import Step, inner_steps
from backplane.backends.torch.gpu_host_chain import host_chain_workload, host_chained
from backplane.backends.torch.gpu_layernorm import fused_layer_norms
from backplane.backends.torch.gpu_memory import STAGED_BYTES, factory  # noqa: F401  # GpuAcc's memory
from backplane.backends.torch.host_inputs import HOST_INPUTS, NOT_CAPTURABLE  # noqa: F401  # torch-free
from backplane.backends.torch.kernels.common import NUMPY_TO_TORCH
from backplane.ir.graph import Layer, SubgraphView, TensorInfo

log = logging.getLogger("backplane.torch")



def capture_views(view: SubgraphView, backend: Any) -> OptimizationViews:
    """Each run of capturable layers (``capturable``) as one CUDA graph, the other layers
    untouched: a subgraph whose shapes are all static is one graph; one with a NonMaxSuppression or
    a NonZero is split there, the layers before it captured, those whose shapes it decides left to
    run one by one."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    runs = capturable_runs(view)
    if not runs:
        return OptimizationViews(untouched=[view])
    captured = {id(layer) for run in runs for layer in run}
    rest = [layer for layer in view.layers if id(layer) not in captured]
    substitutions = [Substitution(part, [_cuda_graph_layer(part)])
                     for part in (SubgraphView.of(graph, run) for run in runs)]
    views = OptimizationViews(substitutions=substitutions,
                              untouched=[SubgraphView.of(graph, rest)] if rest else [])
    return host_chained(view, views, backend)  # a NonMaxSuppression's post-process on the host


def capturable(layer: Layer, graph: Any) -> bool:
    """Whether a capture can hold ``layer``: no size read from data or made on the host during the
    run (``NOT_CAPTURABLE``), and the inputs its kernel reads on the host (``HOST_INPUTS``) are
    constants."""
    if layer.op_type in NOT_CAPTURABLE:
        return False
    host = HOST_INPUTS.get(layer.op_type, ())
    return not any(i < len(layer.inputs) and layer.inputs[i] and layer.inputs[i] not in graph.constants
                   for i in host)


def capturable_runs(view: SubgraphView, least: int = 2) -> list[list[Layer]]:
    """The view's layers that can be captured, as runs of consecutive layers (in topological order,
    so that no path leaves a run and comes back into it) of ``least`` layers or more. A layer is
    left out where ``capturable`` says so, and so is every layer reading what such a layer or a
    boundary input of free shape makes: its shapes are known only at the run."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    free = {n for n in view.inputs if not graph.info(n).is_static}
    runs: list[list[Layer]] = [[]]
    for layer in view.layers:
        if capturable(layer, graph) and not free.intersection(layer.inputs):
            runs[-1].append(layer)
            continue
        free.update(n for n in layer.outputs if n)
        runs.append([])
    return [run for run in runs if len(run) >= least and _static_boundary(graph, run)]


def _static_boundary(graph: Any, run: list[Layer]) -> bool:
    """Whether the run's inputs have static shapes (its capture allocates them at load)."""
    return all(graph.info(n).is_static for n in SubgraphView.of(graph, run).inputs)


def _cuda_graph_layer(view: SubgraphView) -> Layer:
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    layers = fused_layer_norms(view)  # an exported LayerNorm as one layer (gpu_layernorm.py)
    constants = {n: graph.constants[n] for layer in layers for n in layer.inputs
                 if n in graph.constants}
    # The boundary names as the layers inside read and write them (the optimizer renames the
    # fused layer's inputs when it puts copies in front of them).
    attrs = {"layers": layers, "constants": constants, "inputs": list(view.inputs),
             "outputs": list(view.outputs),
             "output_dtypes": [graph.info(n).dtype for n in view.outputs]}
    name = f"CudaGraph[{view.layers[0].name}..{view.layers[-1].name}]({len(view.layers)} layers)"
    return Layer(name, "CudaGraph", list(view.inputs), list(view.outputs), attrs, FUSED_DOMAIN, 1)


PRECISIONS = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}
"""``GpuAcc.precision``: the type float32 tensors take inside captured subgraphs (Arm NN's
ReduceFp32ToFp16); their float32 inputs are converted on entry, their float32 outputs on exit, every
float32 result inside (a Cast to float) on the spot, and float32 constants are clamped to the reduced
type's finite range first (attention masks of -3.4e38 would become -inf, and 0 * -inf NaN). Values
computed beyond that range (activations over 65504 in fp16) still overflow: bf16 has float32's range."""


def reduced_precision(backend: Any) -> Any:
    """The torch dtype float32 becomes inside GpuAcc's subgraphs, or None for float32 itself."""
    return precision_type(backend.options.get("GpuAcc.precision", "fp32"))


def precision_type(choice: str) -> Any:
    """``GpuAcc.precision``'s torch dtype (None for fp32), or an error that lists the choices."""
    import torch

    if choice not in PRECISIONS:
        raise OptionError(f"GpuAcc.precision {choice!r} is not one of {', '.join(PRECISIONS)}")
    name = PRECISIONS[choice]
    return None if name is None else getattr(torch, name)


def channels_last(options: Any, reduced: Any) -> bool:
    """``GpuAcc.channels_last``: a captured subgraph with convolutions keeps its 4-d float tensors
    in channels-last memory (NHWC strides, the layout cuDNN's tensor-core kernels read without a
    transpose), the convolutions' weights converted once at load. "auto" (the default): where the
    subgraph runs on tensor cores, in fp16 or bf16 or with ``GpuAcc.tf32``. Measured on an H100 in
    TF32, NCHW against NHWC in one session: resnet50 1.02 against 0.62 ms at batch 1 and 4802
    against 7920 samples/s at 32; mobilenet_v3_large 8310 against 10486 at 32, 0.543 against 0.555
    ms at 1; efficientnet_b0 1.035 against 0.982 ms at 1, 5173 against 5058 at 32. Strict float32
    stays NCHW (not measured). Only the memory changes: every kernel still sees the same values,
    and the subgraph's outputs leave it contiguous."""
    choice = options.get("GpuAcc.channels_last", "auto")
    if choice == "auto":
        return reduced is not None or bool(options.get("GpuAcc.tf32", False))
    if isinstance(choice, bool):
        return choice
    raise OptionError(f"GpuAcc.channels_last {choice!r} is not one of auto, True, False")


@contextlib.contextmanager
def math_mode(tf32: bool) -> Iterator[None]:
    """torch's TF32 switches for matmuls and cuDNN set to ``tf32`` inside, put back after. Without
    TF32 (strict mode) cuBLAS may not reduce fp16 and bf16 products in reduced precision either
    (torch allows it by default: split-K sums rounded to half, a few ulps off the ONNX reference on
    a model whose own tensors are fp16)."""
    c, was = _switched(tf32)
    try:
        yield
    finally:
        _set(c, was, None)


def _switched(tf32: bool) -> tuple[Any, tuple[Any, ...]]:
    """torch's C module and the switches as they were, now set to ``tf32``: read and set through
    torch's C functions, as the attributes of ``torch.backends.cuda.matmul`` parse their values in
    Python (10-15 us a GpuAcc run for the four, cProfile on the H100 machine's Xeon)."""
    c = _c()
    was = (c._get_cublas_allow_tf32(), c._get_cudnn_allow_tf32(),
           c._get_cublas_allow_fp16_reduced_precision_reduction(),
           c._get_cublas_allow_bf16_reduced_precision_reduction())
    _set(c, (tf32, tf32, (tf32, True) if isinstance(was[2], tuple) else tf32,
             (tf32, True) if isinstance(was[3], tuple) else tf32), was)
    return c, was


def _c() -> Any:
    import torch

    return torch._C


def _set(c: Any, values: tuple[Any, ...], now: tuple[Any, ...] | None) -> None:
    """Each switch set where it differs from ``now`` (all where ``now`` is None). torch 2.10 and
    later take and give the reduced-precision ones as (allow, allow split-K), earlier a bool."""
    setters = (c._set_cublas_allow_tf32, c._set_cudnn_allow_tf32,
               c._set_cublas_allow_fp16_reduced_precision_reduction,
               c._set_cublas_allow_bf16_reduced_precision_reduction)
    for i, (setter, value) in enumerate(zip(setters, values)):
        if now is not None and now[i] == value:
            continue
        if isinstance(value, tuple):
            setter(*value)
        else:
            setter(value)


def in_math_mode(workload: Workload, tf32: bool) -> Workload:
    """``workload`` run with torch's TF32 switches set to ``tf32`` (``math_mode`` without its
    context manager, which costs a few microseconds a run)."""

    def run(*values: Any) -> tuple[Any, ...]:
        c, was = _switched(tf32)
        try:
            return workload(*values)
        finally:
            _set(c, was, None)

    run.__dict__.update(getattr(workload, "__dict__", {}))  # exclusive, built, ...: kept
    return run


def _upload(layers: Sequence[Layer], constants: dict[str, np.ndarray], device: Any,
            reduced: Any = None, nhwc: bool = False) -> dict[str, Any]:
    import torch

    host = {layer.inputs[i] for layer in layers for i in HOST_INPUTS.get(layer.op_type, ())
            if i < len(layer.inputs)}
    weights = {layer.inputs[1] for layer in layers
               if nhwc and layer.op_type == "Conv" and len(layer.inputs) > 1}
    selects = _select_indices(layers, constants)
    uploaded = {}
    for name, value in constants.items():
        if name in host:
            uploaded[name] = value
            continue
        if name in selects:  # the Gather kernel selects a view by a host index: no kernel
            uploaded[name] = torch.from_numpy(np.array(value))
            continue
        tensor = torch.from_numpy(np.array(value)).to(device)
        if reduced is not None and tensor.dtype == torch.float32:  # -3.4e38 masks stay finite
            finite = torch.finfo(reduced)
            tensor = tensor.clamp(finite.min, finite.max)
        tensor = _lower(tensor, reduced)
        uploaded[name] = _nhwc(tensor) if name in weights else tensor
    return uploaded


def _select_indices(layers: Sequence[Layer], constants: dict[str, np.ndarray]) -> set[str]:
    """The constants read only as a Gather's one index (a 0-d integer): kept on the host, where
    torch's Gather kernel takes them as a view of the data (``select``). Uploaded, each Gather
    of one constant index ran five kernels a run in a captured graph (the index's bounds and
    negatives on the device, then index_select): ten of the 41 in the corpus VAD's replay, for
    its state's two Gathers (H100, the full tier)."""
    readers: dict[str, list[tuple[Layer, int]]] = {}
    for layer in layers:
        for position, name in enumerate(layer.inputs):
            if name in constants:
                readers.setdefault(name, []).append((layer, position))
    return {name for name, uses in readers.items()
            if np.ndim(constants[name]) == 0 and np.asarray(constants[name]).dtype.kind in "iu"
            and all(lay.op_type == "Gather" and not lay.domain and at == 1 for lay, at in uses)}


def _nhwc(tensor: Any) -> Any:
    """A 4-d tensor in channels-last memory (the same values, strides NHWC); others as they are."""
    import torch

    if tensor.dim() != 4 or not tensor.is_floating_point():
        return tensor
    return tensor.contiguous(memory_format=torch.channels_last)


def _lower(tensor: Any, reduced: Any) -> Any:
    import torch

    return tensor.to(reduced) if reduced is not None and tensor.dtype == torch.float32 else tensor


def frees(steps: Sequence[Step], kept: set[str]) -> list[list[str]]:
    """For each step, the values no later step reads (the subgraph's outputs and constants aside):
    dropped right after it, so that the caching allocator reuses their memory for the next steps.

    Inside a capture that keeps the graph's memory small, as in torch's own modules (their
    intermediates die as the forward goes). With every intermediate kept to the end, the late 1x1
    convolutions of mobilenet_v3_large's captured graph ran 20-40% longer than in torch's graph of
    the module, with the same cuDNN kernel and arguments; dropping them took its replay from 857 to
    722 us of GPU time (H100, fp32, batch 1; resnet50: 2159 to 2146 us)."""
    last: dict[str, int] = {}
    for index, (_, names_in, names_out) in enumerate(steps):
        for name in (*names_in, *names_out):
            if name:
                last[name] = index
    dropped: list[list[str]] = [[] for _ in steps]
    for name, index in last.items():
        if name not in kept:
            dropped[index].append(name)
    return dropped


def cuda_graph_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload:
    """Capture at load, with the static inputs the boundary's tensor infos describe."""
    run_layers, static = graph_parts(layer, backend, inputs)
    if not backend.options.get("GpuAcc.cuda_graphs", True):  # decided at load, with the options
        return lambda *values: tuple(run_layers(*values))
    try:
        return CapturedGraph(run_layers, static, backend.device())
    except CaptureError as exc:  # the layers run (the warm-up did): on the GPU, uncaptured
        log.warning("%s: not captured as a CUDA graph (%s); its layers run one by one on %s",
                    layer.name, exc, backend.device())
        return lambda *values: tuple(run_layers(*values))


def graph_parts(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
                ) -> tuple[Callable[..., list[Any]], list[Any]]:
    """A CudaGraph layer's function of its inputs (its layers' kernels, fused, in the precision
    and compiled as the options say) and its static input tensors, zeros of the boundary's shapes:
    what a capture records (``CapturedGraph``; ``cuda_host.HostGraph`` with its copies)."""
    import torch

    device = backend.device()
    inner = layer.attrs["layers"]
    reduced = reduced_precision(backend)
    steps = inner_steps(inner, backend, layer.attrs["outputs"], layer.attrs["constants"])
    nhwc = channels_last(backend.options, reduced) and any(
        lay.op_type == "Conv" and not lay.domain for lay in inner)
    env_template = _upload(inner, layer.attrs["constants"], device, reduced, nhwc)
    dead_after = frees(steps, set(layer.attrs["outputs"]) | set(env_template))
    back_to_fp32 = [reduced is not None and dtype == np.float32
                    for dtype in layer.attrs.get("output_dtypes") or []]

    def run_layers(*values: Any) -> list[Any]:
        env = dict(env_template)
        if nhwc:
            values = tuple(_nhwc(v) for v in values)
        env.update(zip(layer.attrs["inputs"], (_lower(v, reduced) for v in values)))
        for (workload, names_in, names_out), dead in zip(steps, dead_after):
            results = workload(*[env[n] if n else None for n in names_in])
            if reduced is not None:  # a Cast to float32 inside stays in the reduced type
                results = tuple(_lower(r, reduced) for r in results)
            env.update(zip(names_out, results))
            for name in dead:
                del env[name]
        outputs = [env[n] for n in layer.attrs["outputs"]]
        if nhwc:  # the other backends, and the user, get their usual layout
            outputs = [o.contiguous() for o in outputs]
        if any(back_to_fp32):
            outputs = [o.float() if fp32 else o for o, fp32 in zip(outputs, back_to_fp32)]
        return outputs

    static = [torch.zeros(info.shape, dtype=NUMPY_TO_TORCH[info.dtype], device=device)  # type: ignore
              for info in inputs]  # capture_views took only static inputs
    return compiled(run_layers, static, compiler_of(backend.options), layer.name), static


class CaptureError(RuntimeError):
    """The layers ran in the warm-up, but their capture failed (a kernel copied from pageable host
    memory, or waited for the GPU): they can still run uncaptured, on the GPU, rather than the
    whole subgraph leaving GpuAcc for the next backend."""


class CapturedGraph:
    """Layers captured once into a CUDA graph; a call copies its inputs into the graph's static
    inputs and replays it. The outputs are the graph's static outputs, overwritten by the next call
    (whoever reads them copies them out first: a MemCopy, or the user through it). So it is
    ``exclusive``: a network that holds one runs one run at a time (``LoadedNetwork``)."""

    exclusive = True

    def __init__(self, run_layers: Callable[..., list[Any]], static_inputs: list[Any],
                 device: Any) -> None:
        import torch

        self.static_inputs = static_inputs
        self.run_layers = run_layers  # holds the uploaded constants the graph reads: keep them alive
        warm_up(lambda: run_layers(*static_inputs), device)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.outputs = tuple(run_layers(*static_inputs))
        except RuntimeError as exc:
            raise CaptureError(str(exc).splitlines()[0][:300] if str(exc) else repr(exc)) from exc

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        for static, value in zip(self.static_inputs, inputs):
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


WORKLOADS: dict[str, Callable[..., Workload]] = {"CudaGraph": cuda_graph_workload,
                                                  "HostChain": host_chain_workload}
