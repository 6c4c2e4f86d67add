"""``CpuAcc.compile`` "inductor": each CpuAcc subgraph without convolutions (a Traced one: a
transformer's, a tagger's) compiled by TorchInductor's C++ backend in place of its frozen
TorchScript trace, when CpuAcc makes its workload (at load, or at the first run of an input
signature); a subgraph with convolutions (every OneDnnGraph) or recurrent layers keeps CpuAcc's
own route (``CONVOLUTIONS``, ``RECURRENT``).

Why, and why it is not the default: a trace runs each torch op through TorchScript's interpreter
(3-5 us an op at batch 1); inductor fuses the elementwise ops, norms and softmaxes between the
products into C++ loops and calls the rest from a C++ wrapper (``cpp_wrapper``), the weights frozen
into it (``freezing``). On this project's AVX2 EPYC at 1 thread (thread CPU a run, sessions
alternating in one process, load 7-10) that took ``gpt_causal_ts15`` 0.47 -> 0.32 ms and
``encoder4_plain_dyn18`` 0.76-0.99 of before; with convolutions or LSTMs it lost, and
its fused ReLU dropped NaN. At 2 threads on that busy machine it lost too (``gpt_causal_ts15``
3.7 times the default's wall time at load 2.6-3.9): inductor made each fused loop of 512 values a
thread or more an OpenMP region, each waiting for a preempted thread; regions start at ATen's
32,768 now (``CONFIG``). A partition costs 40-100 s of inductor and g++ on that machine, and
about as long with a warm cache (its FX graph cache is bypassed for frozen oneDNN weights; only
the compiled C++ is reused). docs/torch-backends.md, "TorchInductor's C++ backend", has the
table. Inductor's cache goes under backplane's cache folder
(``cache_folder``), never into an artifact: loading an artifact runs no code from it.

The partition is the same function the trace records (its layers on the traceable routes,
``onednn_graph.layers_run`` over ``TRACEABLE_ROUTES``), captured by ``make_fx`` (every Python
decision of the kernels taken once, for the static shapes), its constants as buffers (what
inductor's freezing folds), compiled by ``torch._inductor.compile``: without dynamo, whose guards
and wrappers cost 40-60 us a call (through ``torch.compile`` the same code ran 0.43-0.53 ms a call
against 0.11-0.20). A partition inductor cannot compile, or whose outputs on a sample differ from
its layers', takes CpuAcc's own route ("auto"), with a warning; a float input holding NaN or an
infinity runs CpuAcc's own route too (NaN in, NaN out)."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from backplane.backends.api.backend import BackendOptions, Workload
from backplane.ir.graph import Layer, TensorInfo

PARTITIONS = ("OneDnnGraph", "Traced")
"""The fused layers "inductor" takes: the partitions oneDNN Graph or a trace would run, those
without convolutions and recurrent layers (``CONVOLUTIONS``, ``RECURRENT``) compiled."""
CONFIG = {"freezing": True, "cpp_wrapper": True, "cpp.min_chunk_size": 32768}
"""Inductor's settings: the weights constants of the compiled code (convolutions and products on
prepacked weights), the calls made from C++ (at 1 thread, ``gpt_causal_ts15``'s partition took
0.11-0.20 ms a call with the C++ wrapper, 0.23-0.40 with the Python one, load 8-9), and a fused
loop an OpenMP region only from 32,768 values a thread (ATen's own grain, ``at::internal::
GRAIN_SIZE``; inductor's default is 512). Each region is compiled for the thread count of the
load (``num_threads(2)``), which no call can lower, and on a busy machine each waits for its
preempted second thread: ``gpt_causal_ts15`` at 2 threads (its two GELU loops of 8 x 128 were
regions) ran 33.5 ms a call (median wall; p10 2.9), with this 1.76 (p10 1.06); encoder_padmask_dyn17
2.09 -> 1.92 (load 7-10, this 2-core AMD EPYC). At 1 thread inductor makes no region either way:
the same code."""


class CompilerMissing(RuntimeError):
    """No C++ compiler for inductor's C++ backend (``CXX``, or g++ / c++ / clang++ on the PATH)."""


@functools.lru_cache(maxsize=1)
def compiler() -> str:
    """The C++ compiler inductor will call (found once: it runs ``--version``), or
    ``CompilerMissing`` naming where it looked."""
    _cache_dir()
    from torch._inductor import config, exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except exc.InvalidCxxCompiler as error:
        raise CompilerMissing(
            "CpuAcc.compile=inductor needs a C++ compiler (TorchInductor's C++ backend); none of "
            f"{config.cpp.cxx!r} runs here. Install g++ (apt-get install g++) or set CXX, or use "
            "CpuAcc.compile auto") from error


def cache_folder() -> Path:
    """Where inductor's compiled code goes: ``inductor`` beside CpuAcc's route cache, unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another place."""
    from backplane.backends.torch import route_cache

    return route_cache.cache_file().parent / "inductor"


def _cache_dir() -> None:
    """``TORCHINDUCTOR_CACHE_DIR`` set to ``cache_folder`` where the caller has not set it, before
    inductor is imported: inductor sets it for the process itself at its first use (its default
    is /tmp/torchinductor_$USER, which a reboot empties)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_folder()))


class _Auto:
    """``backend`` with ``CpuAcc.compile`` "auto": CpuAcc's own route for a partition inductor
    does not take."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.options = BackendOptions({**backend.options.values, "CpuAcc.compile": "auto"})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def workloads(own: dict[str, Callable[..., Workload]]) -> dict[str, Callable[..., Workload]]:
    """CpuAcc's fused workloads (``own``) with its partitions without convolutions compiled by
    inductor."""
    compiler()  # no C++ compiler: the load fails here, saying so

    def make(kind: str) -> Callable[..., Workload]:
        return lambda layer, backend, inputs: inductor_workload(layer, backend, inputs, own[kind])
    return {**own, **{kind: make(kind) for kind in PARTITIONS}}


def inductor_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
                      own: Callable[..., Workload]) -> Workload:
    """The partition compiled by inductor, or CpuAcc's own route (``own`` under "auto") where it
    holds a convolution or a recurrent layer (``CONVOLUTIONS``, ``RECURRENT``), computes in
    reduced precision, or inductor fails or computes otherwise."""
    auto = _Auto(backend)
    if layer.attrs.get("compute") is not None or _convolutions(layer):
        return own(layer, auto, inputs)
    try:
        compiled = compile_partition(layer, backend, inputs)
    except CompilerMissing:
        raise
    except Exception as error:  # noqa: BLE001  # any failure: CpuAcc's own route
        warnings.warn(f"{layer.name}: TorchInductor could not compile it ({type(error).__name__}: "
                      f"{str(error).splitlines()[0][:300] if str(error) else ''}); it takes "
                      "CpuAcc's own route", RuntimeWarning, stacklevel=2)
        return own(layer, auto, inputs)
    if compiled is None:
        warnings.warn(f"{layer.name}: TorchInductor's code computes otherwise than its layers; "
                      "it takes CpuAcc's own route", RuntimeWarning, stacklevel=2)
        return own(layer, auto, inputs)
    return _finite_or(compiled, lambda: own(layer, auto, inputs))


CONVOLUTIONS = frozenset({"Conv", "FusedConv", "ConvTranspose", "WindowedConv", "QLinearConv",
                          "ConvInteger"})
"""Layers that keep a subgraph on CpuAcc's own route: inductor runs each convolution as its own
oneDNN call set up again at every call (``mkldnn._convolution_pointwise``), where oneDNN Graph's
compiled partition is set up once: every subgraph with convolutions measured ran slower
compiled, or no faster (``resnet_basic_ts16`` 1.6-1.9 times the default's time,
``mobilenet_dw_ts13`` 2.0-2.2, ``audio_conv1d_dyn19`` 1.26-1.28, ``unet_resize_ts13`` 1.07-1.12,
``detect_nms_ts14``'s backbone 1.02-1.03; 1 thread, thread CPU, load 7.5-10)."""


RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
"""Layers that keep a subgraph on CpuAcc's own route too: compiled, ``lstm_bi2_ts14``'s traced
bidirectional LSTM took 1.51 times the default's time (394 -> 595 us a run, 1 thread, thread
CPU, load 3.7): its steps become inductor's small kernels and products one by one, where CpuAcc's
kernel runs oneDNN's whole layer."""


def _convolutions(layer: Layer) -> bool:
    """Whether the subgraph holds a layer of ``CONVOLUTIONS`` or ``RECURRENT``."""
    return any(inner.op_type in CONVOLUTIONS | RECURRENT for inner in layer.attrs["layers"])


def compile_partition(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload | None:
    """The partition's layers captured by ``make_fx`` and compiled by inductor (``CONFIG``) for
    the calling thread count, or None where its outputs on a sample differ from the layers'."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from backplane.backends.torch.fusion import onednn_graph

    compiler()
    layers = onednn_graph.layers_run(layer, onednn_graph._Forced(backend,
                                                                 onednn_graph.TRACEABLE_ROUTES))
    sample = onednn_graph._sample(inputs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = layers(*sample)
        graph = _with_buffers(make_fx(layers)(*sample))
        settings = {**CONFIG, "cpp.threads": torch.get_num_threads()}
        with torch._inductor.config.patch(settings):
            function = torch._inductor.compile(graph, sample)
        got = tuple(function(*sample))
    if len(got) != len(expected) or not all(map(onednn_graph._close, got, expected)):
        return None
    return _run(function)


def _with_buffers(graph: Any) -> Any:
    """``graph`` (make_fx's) with its tensor constants registered as buffers: inductor's freezing
    folds buffers into the compiled code, where a plain attribute stays an input of every call.
    Its nodes' recorded values go: where a kernel made meta tensors of its own while traced (the
    views composed on a meta tensor), they came from two fake modes, and inductor refused the
    graph ("fake mode ... doesn't match mode": ``encoder_padmask_dyn17``, ``lstm_bi2_ts14``);
    inductor records them again itself."""
    import torch

    for node in graph.graph.nodes:
        for key in ("val", "tensor_meta", "example_value"):
            node.meta.pop(key, None)
        if node.op == "get_attr":
            value = getattr(graph, node.target)
            if isinstance(value, torch.Tensor) and node.target not in dict(graph.named_buffers()):
                delattr(graph, node.target)
                graph.register_buffer(node.target, value)
    return graph


def _run(function: Callable[..., Any]) -> Workload:
    """The compiled ``function`` as a workload: below autograd, its outputs a tuple of tensors
    inductor made for this call (the caller's alone)."""
    from backplane.backends.torch.fusion.traced import below_autograd_guard

    guard = below_autograd_guard()

    def run(*values: Any) -> tuple[Any, ...]:
        with guard():
            return tuple(function(*values))

    run.route = "inductor"  # type: ignore[attr-defined]
    return run


def _finite_or(compiled: Workload, own: Callable[[], Workload]) -> Workload:
    """``compiled`` where every float input is finite, else CpuAcc's own route (made at the first
    such call): inductor's fused ReLU and max pool (oneDNN's post-ops, C++ ``max``) drop NaN."""
    import torch

    isfinite = torch.isfinite
    made: list[Workload] = []

    def run(*values: Any) -> tuple[Any, ...]:
        for value in values:
            if value.is_floating_point() and value.numel() and not bool(isfinite(value).all()):
                if not made:
                    made.append(own())
                return made[0](*values)
        return compiled(*values)

    run.route = "inductor"  # type: ignore[attr-defined]
    return run
