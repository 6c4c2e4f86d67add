"""CpuAcc and GpuAcc: the backend classes, their tensor memory, options and workload factories.

Both share one kernel table (``kernels/``): a torch kernel runs where its tensors are. They differ in
memory (CpuAcc: torch CPU tensors, zero-copy views of NumPy arrays; GpuAcc: CUDA tensors, uploaded
asynchronously on the current stream) and in ``optimize_subgraph`` (CpuAcc fuses into oneDNN
primitives, GpuAcc captures CUDA graphs).

Options (``RuntimeOptions.backend_options``): ``CpuAcc.threads`` ("auto", the default: as many
intra-op threads as the CPUs other processes leave free, ``threads.py``; or a fixed count; a
session's ``intra_op_num_threads`` is a ceiling, ``threads.AtMost``),
``CpuAcc.linear_route`` ("auto": measure MKL and oneDNN per layer at load and keep the faster;
"mkl"; "onednn"), ``CpuAcc.conv_route`` ("auto", "onednn", "torch", "gemm"), ``CpuAcc.compile``
("auto": a subgraph with convolutions compiled by oneDNN Graph where that measures faster;
"onednn_graph"; "layers": see ``fusion/onednn_graph.py``), ``CpuAcc.route_cache``
(default True: measured routes kept on disk, ``route_cache``), ``CpuAcc.precision`` ("fp32", the
default; "bf16": float32 computed in bfloat16 inside CpuAcc's subgraphs where the CPU has bfloat16
instructions, ``fusion/reduced.py``), ``GpuAcc.device`` (default
"cuda:0"), ``GpuAcc.cuda_graphs`` (default True), ``GpuAcc.tf32`` (default False),
``GpuAcc.fuse_conv_relu`` (default True), ``GpuAcc.precision`` ("fp32", the default; "fp16" or "bf16":
float32 computed in that type inside GpuAcc's captured subgraphs, Arm NN's ReduceFp32ToFp16),
``GpuAcc.channels_last`` ("auto": NHWC convolutions with fp16, bf16 or TF32) and ``GpuAcc.compile``
("none"; "inductor": each captured subgraph compiled by TorchInductor first).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import (
    SUPPORTED,
    Backend,
    BackendContext,
    BackendOptions,
    Support,
    Workload,
    WorkloadFactory,
    unsupported,
)
from backplane.backends.api.memory import MemorySource, TensorHandleFactory, is_host_allocator
from backplane.backends.api.optimization import OptimizationViews
from backplane.install_hints import hint
from backplane.ir.graph import Layer, SubgraphView, TensorInfo

FUSED_DOMAIN = "backplane.torch"
"""The domain of the layers CpuAcc and GpuAcc substitute (fused convolutions, CUDA graphs)."""


def torch_missing() -> str | None:
    """Why torch cannot be used here, or None."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed ({hint('torch')})"
    return None


def _numpy_to_torch(value: Any) -> Any:
    array = value if type(value) is np.ndarray else np.asarray(value)
    flags = array.flags
    if not (flags.writeable and flags.c_contiguous):
        array = np.array(array, order="C")  # torch.from_numpy wants writable, positive strides
    return (_FROM_NUMPY or _from_numpy())(array)


_FROM_NUMPY: Callable[[np.ndarray], Any] | None = None
"""``torch.from_numpy``, read at the first import (every host input of a CpuAcc layer comes
through ``_numpy_to_torch``: no import statement and attribute look-up per call)."""


def _from_numpy() -> Callable[[np.ndarray], Any]:
    global _FROM_NUMPY
    import torch

    _FROM_NUMPY = torch.from_numpy
    return _FROM_NUMPY


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    return tensor.numpy()


TORCH_CPU_FACTORY = TensorHandleFactory(
    "torch-cpu", MemorySource.MALLOC, MemorySource.MALLOC, MemorySource.MALLOC,
    copy_in=_numpy_to_torch, copy_out=_torch_to_numpy, export=_torch_to_numpy,
    import_=_numpy_to_torch)
"""torch CPU tensors: host memory both ways, so edges to host backends and the user are imports,
zero-copy views (torch.from_numpy / .numpy())."""


class TorchBackend(Backend):
    """What CpuAcc and GpuAcc share: the kernel table, the support check, fused-layer workloads."""

    version = "0.3.0"  # 0.3: CpuAcc blobs hold no archive, only data (delegate.py's layout 3)

    def __init__(self) -> None:
        self.options = BackendOptions()
        self.missing = self._missing()
        if self.missing is None:
            from backplane.backends.torch import kernels

            self.KERNELS = kernels.KERNELS  # type: ignore[misc]
            self.CHECKS = kernels.CHECKS  # type: ignore[misc]
            self.input_dtypes = kernels.INPUT_DTYPES

    def _missing(self) -> str | None:
        return torch_missing()

    def availability(self) -> Support:
        return unsupported(self.missing) if self.missing else SUPPORTED

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        if self.missing:
            return unsupported(self.missing)
        from backplane.backends.torch.kernels.common import TORCH_DTYPES

        for info in (*inputs, *outputs):
            if info.dtype is not None and info.dtype not in TORCH_DTYPES:
                return unsupported(f"data type {info.dtype.name} not supported by torch kernels")
        allowed = self.input_dtypes.get(layer.op_type)
        if allowed and inputs and inputs[0].dtype is not None and inputs[0].dtype not in allowed:
            return unsupported(f"{layer.op_type} on {inputs[0].dtype.name} is not claimed "
                               f"(claimed: {', '.join(sorted(d.name for d in allowed))})")
        # named, not super(): its layer support (registry/support.py) runs this check, no backend
        return Backend.is_layer_supported(self, layer, inputs, outputs)

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return TorchWorkloadFactory(self, memory_manager)

    def fused_workloads(self) -> dict[str, Callable[..., Workload]]:
        """Workload makers for the layers this backend substitutes: op type -> maker(layer, backend,
        input infos)."""
        return {}


class TorchWorkloadFactory(WorkloadFactory):
    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        if layer.domain == FUSED_DOMAIN:
            backend: TorchBackend = self.backend  # type: ignore[assignment]
            return backend.fused_workloads()[layer.op_type](layer, backend, inputs)
        return super().create_workload(layer, inputs, outputs)


class GpuWorkloadFactory(TorchWorkloadFactory):
    """fp32 means fp32: TF32 matmuls and convolutions (torch's default for cuDNN) only where the
    network's ``GpuAcc.tf32`` is set. The switches are torch's, for the whole process: they are set
    as the network says while its graphs are captured and while its other workloads run, then put
    back, so that two sessions with different options each get their own."""

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        from backplane.backends.torch import cuda

        tf32 = bool(self.backend.options.get("GpuAcc.tf32", False))
        with cuda.math_mode(tf32):
            workload = super().create_workload(layer, inputs, outputs)
        if isinstance(workload, cuda.CapturedGraph):  # its kernels were chosen at the capture
            return workload
        return cuda.in_math_mode(workload, tf32)


class TorchContext(BackendContext):
    """Sets torch's threads to ``CpuAcc.threads`` where a fixed count is given; otherwise starts
    the process's thread governor (``threads.py``; a session's ``intra_op_num_threads``, an
    ``AtMost``, that count's), and holds the loading thread at its full count while a network
    loads (routes are measured, and their cache keyed, at that count)."""

    def __init__(self, threads: Any) -> None:
        from backplane.backends.torch import threads as policy

        count = policy.thread_setting(threads)
        self.governor = None if count else policy.governor(policy.ceiling(threads))
        if count:
            policy.fixed(count)

    def before_load_network(self, network_id: int) -> None:
        if self.governor is not None:
            self.governor.hold_most()


class CpuWorkloadFactory(TorchWorkloadFactory):
    """Under the thread policy (``CpuAcc.threads`` "auto"), each workload ticks the governor
    before its call: the threads follow the machine's load between calls. Not the workloads of a
    Specialized layer's build (made at its run, ``traced.AT_RUN``): the Specialized layer's own
    workload ticks before it calls them (the full-tier VAD's run ticked twice, a frame each)."""

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        from backplane.backends.torch import background, threads as policy
        from backplane.backends.torch.fusion.traced import AT_RUN

        if layer.domain == FUSED_DOMAIN and background.wanted(self.backend):
            made = background.deferred(
                lambda: TorchWorkloadFactory.create_workload(self, layer, inputs, outputs),
                layer.name)
        else:
            made = super().create_workload(layer, inputs, outputs)
        workload = _writing_into(made, layer, inputs, outputs)
        threads = self.backend.options.get("CpuAcc.threads")
        if policy.thread_setting(threads) is not None or AT_RUN.get():
            return workload
        return policy.Governed(workload, policy.governor(policy.ceiling(threads)))


@functools.cache
def _out_kernels() -> dict[str, tuple[str, Callable[..., Any]]]:
    """Op type -> (the element kinds it writes in place, ``kernel(out, *inputs)``): torch's
    ``out=``, computing what the kernel in KERNELS does (clamp_min is torch.relu's values, -0.0
    and NaN included)."""
    import torch

    return {"Relu": ("fi", lambda out, X: torch.clamp_min(X, 0, out=out)),
            "Add": ("fi", lambda out, A, B: torch.add(A, B, out=out)),
            "Sub": ("fi", lambda out, A, B: torch.sub(A, B, out=out)),
            "Mul": ("fi", lambda out, A, B: torch.mul(A, B, out=out)),
            "Div": ("f", lambda out, A, B: torch.div(A, B, out=out)),
            "Abs": ("fi", lambda out, X: torch.abs(X, out=out)),
            "Neg": ("f", lambda out, X: torch.neg(X, out=out)),
            "Sqrt": ("f", lambda out, X: torch.sqrt(X, out=out)),
            "Exp": ("f", lambda out, X: torch.exp(X, out=out)),
            "Tanh": ("f", lambda out, X: torch.tanh(X, out=out)),
            "Sigmoid": ("f", lambda out, X: torch.sigmoid(X, out=out))}


def _writing_into(workload: Workload, layer: Layer, inputs: Sequence[TensorInfo],
                  outputs: Sequence[TensorInfo]) -> Workload:
    """CpuAcc's ``workload`` with a ``write_into`` (an output the caller bound to a buffer, the
    runtime's ``user_buffers``): torch's ``out=`` for the common elementwise ops of one element
    type; a fused or compiled layer copies its last result into the memory given (still the
    producer writing it, in its step); anything else as it is."""
    from backplane.backends.api.kernels import with_write_into

    if layer.domain == FUSED_DOMAIN and layer.op_type != "Specialized":
        try:
            workload.write_into = functools.partial(_copied_into, workload)  # type: ignore[attr-defined]
        except AttributeError:  # a callable without a __dict__
            pass
        return workload
    found = _out_kernels().get(layer.op_type)
    dtypes = {info.dtype for info in (*inputs, *outputs)}
    dtype = next(iter(dtypes))
    if found is None or layer.attrs or layer.domain not in ("", "ai.onnx") or len(dtypes) != 1 \
            or dtype is None or dtype.isbuiltin != 1 or dtype.kind not in found[0]:
        return workload
    return with_write_into(workload, found[1])


def _copied_into(workload: Workload, memory: Sequence[Any], *inputs: Any) -> tuple[Any, ...]:
    results = workload(*inputs)
    return tuple(r if m is None else m.copy_(r) for m, r in zip(memory, results))


class CpuAcc(TorchBackend):
    """PyTorch's CPU kernels (oneDNN, MKL), with convolutions and linears fused and prepacked."""

    id = "CpuAcc"
    OPTIONS = {
        "CpuAcc.threads": "auto (fewer while other processes hold CPUs) or a count (process-wide)",
        "CpuAcc.conv_route": "auto (measured), onednn, torch or gemm (1x1 only)",
        "CpuAcc.linear_route": "auto (measured), mkl or onednn",
        "CpuAcc.compile": "auto, onednn_graph, layers, or inductor: each partition compiled by "
                          "TorchInductor's C++ backend at load (a C++ compiler needed)",
        "CpuAcc.inductor": "off (the default), auto (a transformer's traced subgraph compiled "
                           "by TorchInductor in the background, swapped in where its runs time "
                           "it faster) or swap (swapped in untimed)",
        "CpuAcc.background": "False (the default: measured and compiled at load) or True (a load "
                             "takes its routes at once; a background thread builds and compiles, "
                             "swaps them in, the runs time them)",
        "CpuAcc.route_cache": "keep measured routes on disk (True)",
        "CpuAcc.static_runtime": "auto (a Traced layer's graph run by TorchScript's Static Runtime "
                                 "where it builds and reproduces the trace's outputs) or off",
        "CpuAcc.native": "auto (backplane's own C kernels, built once per machine with its C "
                         "compiler, where a layer has one) or off (torch's kernels only)",
        "CpuAcc.specialize": "input signatures kept per Specialized layer (8; 0: off)",
        "CpuAcc.precision": "fp32, or bf16 on CPUs with bfloat16 instructions (AVX512-BF16, AMX)",
        "CpuAcc.keep_memory": "True (the default: freed tensor memory kept in the process for the "
                              "next run, memory.py) or False",
        "CpuAcc.int8": "auto (QDQ convolutions on int8 kernels where measured faster), kernels "
                       "or exact (never: CpuRef's values bit for bit)",
        "CpuAcc.against_cpuref": "auto: a model with If/Loop/Scan that CpuAcc runs in under 2 ms "
                                 "is timed against its placement without CpuAcc (CpuRef), the "
                                 "faster kept; off",
    }

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (TORCH_CPU_FACTORY,)

    def use_custom_allocator(self, allocator: Any) -> bool:
        """A host allocator: torch CPU tensors over its memory (the runtime allocates them)."""
        return is_host_allocator(allocator)

    def create_backend_context(self, options: BackendOptions) -> BackendContext | None:
        """Checks the runtime's ``CpuAcc.precision`` (an unknown one is an error at the first load,
        listing the choices); a network's own is checked as it is optimized."""
        from backplane.backends.torch import inductor_background, memory, static_runtime
        from backplane.backends.torch.fusion import reduced
        from backplane.native import build as native

        reduced.precision_of(options)
        static_runtime.mode(options)  # an unknown setting: an error at load, not at a run
        inductor_background.mode(options)
        native.mode(options)
        if options.get("CpuAcc.compile") == "inductor":  # no C++ compiler: said at load
            from backplane.backends.torch import inductor

            inductor.compiler()
        memory.keep_freed_memory(options.get("CpuAcc.keep_memory", True))
        return TorchContext(options.get("CpuAcc.threads"))

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return CpuWorkloadFactory(self, memory_manager)

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "FusedConvolution": True, "ZeroCopyNumPy": True,
                "HostThreads": "openmp"}

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        if self.missing:
            return OptimizationViews(untouched=[view])
        from backplane.backends.torch import fusion
        from backplane.backends.torch.fusion import int8_exact, int8_native, reduced, traced

        specialized = _specialized(view, self)
        if specialized is not None:
            return specialized
        compute = reduced.reduced_type(self.options)
        native = None if compute is not None else int8_native.whole(view, self.options)
        if native is not None:  # a whole int8 CNN in one native call
            return native
        int8 = int8_exact.mode(self.options.get("CpuAcc.int8", "auto"))
        from backplane.native import build

        native_mode = build.mode(self.options)
        views = fusion.fuse(view, compute, int8, native_mode)
        if compute is not None or self.options.get("CpuAcc.compile") == "layers":
            return views
        return traced.whole(view, views, native_mode)

    def fused_workloads(self) -> dict[str, Callable[..., Workload]]:
        from backplane.backends.torch import fusion, specialize
        from backplane.backends.torch.fusion import traced

        own = {**fusion.WORKLOADS, "Specialized": specialize.specialized_workload,
               "Traced": traced.traced_workload}
        if self.options.get("CpuAcc.compile") == "inductor":
            from backplane.backends.torch import inductor

            return inductor.workloads(own)
        from backplane.backends.torch import inductor_background

        return inductor_background.workloads(own, self.options)

    def flat_layers(self, layer: Layer, workload: Workload, constants: Any) -> Any:
        """A Specialized layer of a control-flow body as plain kernel calls, for builtin's flat
        bodies (``flat.py``); None: it runs as it is."""
        from backplane.backends.torch import flat

        return None if self.missing else flat.flat_layers(layer, self, workload, constants)

    # -- ahead of time: the routes and compiled partitions of a load, kept in a blob (delegate.py)
    def machine_facts(self) -> dict[str, str]:
        from backplane.backends.torch import delegate

        return {} if self.missing else delegate.machine_facts()

    def preprocess(self, graph: Any, compile_specs: Any) -> Any:
        from backplane.backends.torch import delegate

        return None if self.missing else delegate.preprocess(self, graph)

    def init(self, processed: Any, compile_specs: Any, context: Any) -> Any:
        from backplane.backends.torch import delegate

        return delegate.init(self, processed, context)

    def execute(self, handle: Any, *inputs: Any) -> tuple[Any, ...]:
        return handle(*inputs)


class GpuAcc(TorchBackend):
    """PyTorch's CUDA kernels; each static-shape subgraph captured as a CUDA graph at load."""

    id = "GpuAcc"
    OPTIONS = {
        "GpuAcc.device": "the CUDA device (cuda:0)",
        "GpuAcc.cuda_graphs": "capture and replay (True)",
        "GpuAcc.fuse_conv_relu": "Conv [-> Add] -> Relu as one cuDNN call (True)",
        "GpuAcc.tf32": "TF32 matrix products and convolutions (False)",
        "GpuAcc.precision": "fp32, fp16 or bf16 inside captured subgraphs",
        "GpuAcc.specialize": "input signatures kept per Specialized layer (8; 0: off)",
        "GpuAcc.fuse_attention": "attention blocks as scaled_dot_product_attention (True; "
                                 "with fp16, bf16 or tf32)",
        "GpuAcc.compile": "none, or inductor: each captured subgraph compiled by TorchInductor",
        "GpuAcc.channels_last": "convolutions' tensors in NHWC memory (auto: with fp16, bf16 or "
                                "tf32)",
        "GpuAcc.against_cpu": "auto: a model the GPU runs in under 10 ms is timed against its "
                              "placement without GpuAcc, the faster kept; off",
    }

    def _missing(self) -> str | None:
        reason = torch_missing()
        if reason:
            return reason
        import torch

        if not torch.cuda.is_available():
            built = torch.version.cuda
            return ("no CUDA device is available" if built else
                    f"this torch ({torch.__version__}) is built without CUDA")
        return None

    def device(self) -> Any:
        import torch

        return torch.device(self.options.get("GpuAcc.device", "cuda:0"))

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        from backplane.backends.torch import cuda

        return (cuda.factory(self.options.get("GpuAcc.device", "cuda:0")),)

    def create_backend_context(self, options: BackendOptions) -> BackendContext | None:
        """Checks the runtime's ``GpuAcc.precision`` (an unknown one is an error at the first load,
        listing the choices); a network's own options are checked as its workloads are made."""
        from backplane.backends.torch import cuda

        cuda.precision_type(options.get("GpuAcc.precision", "fp32"))
        cuda.compiler_of(options)
        cuda.channels_last(options, None)
        return None

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return GpuWorkloadFactory(self, memory_manager)

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "AsyncExecution": True, "CudaGraphs": True}

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        if self.missing:
            return OptimizationViews(untouched=[view])
        from backplane.backends.torch import cuda

        return cuda.with_host_predicates(  # an If's predicate from the inputs stays on the host
            view, lambda rest: _specialized(rest, self) or cuda.capture_views(rest, self))

    def fused_workloads(self) -> dict[str, Callable[..., Workload]]:
        from backplane.backends.torch import cuda, specialize

        return {**cuda.WORKLOADS, "Specialized": specialize.specialized_workload}

    def host_run(self, network: Any) -> Callable[[Sequence[Any]], list[Any]] | None:
        """``network`` (loaded) as one function of its NumPy inputs where it is one GpuAcc
        partition between them and its outputs: one CUDA graph with its copies per signature
        (``cuda_host``); None for any other network."""
        from backplane.backends.torch import cuda_host

        return None if self.missing else cuda_host.host_run(network)

    def constant_inputs(self, layer: Layer, known: Any) -> Layer:
        """``layer`` of a control-flow body with the outer constants it reads (``known``) made
        its own (``flat.folded_inputs``: a Loop body captured whole)."""
        from backplane.backends.torch import flat

        return flat.folded_inputs(layer, known)


def _specialized(view: SubgraphView, backend: TorchBackend) -> OptimizationViews | None:
    """A subgraph with free dimensions at its inputs as one Specialized layer (``specialize``)."""
    from backplane.backends.api.optimization import Substitution
    from backplane.backends.torch import specialize

    assert view.graph is not None, "the optimizer always gives views of a graph"
    layer = specialize.wrap(view, view.graph, backend)
    return None if layer is None else OptimizationViews(substitutions=[Substitution(view, [layer])])
