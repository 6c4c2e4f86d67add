"""GpuAcc's detector post-process on the host: a NonMaxSuppression and the small layers after it
(CpuAcc's ``HostChain``, ``fusion/host_chain.py``) as one layer whose inputs are downloaded once.

Why: NonMaxSuppression's count comes from the data, so a capture stops at it (``cuda.capture_views``)
and the layers after it ran one by one on the GPU, on a few dozen values: the NMS's overlaps in about
twenty torch calls, its scores, its overlaps and each scalar input (``.item()``) waited for and
copied back, its selections uploaded, then each Gather, Reshape and Slice a launch, and the outputs
downloaded one wait each. On the H100 machine detect_nms_dyn21 (64 boxes) ran so in 1.0 ms, with
14 waits for the GPU and 33 launches outside its graph, where its CPU placement took 0.53 ms, so the
model went to the CPU whole. The chain's outputs are the model's, which go to the host anyway: its
inputs (boxes, scores, a few small tensors made before the NMS) are downloaded into page-locked
memory, one wait for them all, and the chain runs in NumPy as on CpuAcc (CpuRef's kernels: its
selections box for box); its outputs are host tensors, which the copy to the caller takes as they are.

Only where that holds: the subgraph computes in float32 (``GpuAcc.precision`` fp32: bfloat16 has no
NumPy type), the chain starts at the NonMaxSuppression itself (``host_chain.chained`` takes it where
its inputs are of NumPy's types), and nothing outside the chain reads what it makes (a GPU layer
would get a host tensor): the model's outputs alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.api.optimization import OptimizationViews
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo


def host_chained(view: SubgraphView, views: OptimizationViews, backend: Any) -> OptimizationViews:
    """``views`` (a capture's) with each NonMaxSuppression and the chain after it as one HostChain
    layer where every chain qualifies (see above); ``views`` as they are otherwise."""
    from backplane.backends.torch import cuda
    from backplane.backends.torch.fusion import host_chain

    if backend is not None and cuda.reduced_precision(backend) is not None:
        return views
    chained = host_chain.chained(view, views)
    added = chained.substitutions[len(views.substitutions):]
    graph = view.graph
    if not added or graph is None:
        return views
    if not all(_qualifies(sub.substitutable, graph) for sub in added):
        return views
    return chained


def _qualifies(part: SubgraphView, graph: Graph) -> bool:
    """Whether the chain starts at its NonMaxSuppression and only the model reads its outputs."""
    if part.layers[0].op_type != "NonMaxSuppression":
        return False
    inside = {id(layer) for layer in part.layers}
    consumers = graph.consumers()
    return all(name in graph.outputs and all(id(c) in inside for c in consumers.get(name, ()))
               for name in part.outputs)


def host_chain_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo] = ()) -> Workload:
    """CpuAcc's HostChain workload on the layer's inputs downloaded (``downloaded``)."""
    from backplane.backends.torch.fusion import host_chain

    run = host_chain.host_chain_workload(layer, backend, inputs)

    def workload(*values: Any) -> tuple[Any, ...]:
        return run(*downloaded(values))  # type: ignore[no-any-return]

    def profiled(*values: Any) -> Any:
        return run.profiled(*downloaded(values))  # type: ignore[attr-defined]

    workload.profiled = profiled  # type: ignore[attr-defined]
    return workload


def downloaded(values: Sequence[Any]) -> list[Any]:
    """``values`` with each CUDA tensor copied into page-locked host memory, all copies queued
    before one wait for the stream (a ``.cpu()`` each waited once each)."""
    import torch

    out, stream = [], None
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            stream = torch.cuda.current_stream(value.device)
            value = host
        out.append(value)
    if stream is not None:
        stream.synchronize()
    return out

