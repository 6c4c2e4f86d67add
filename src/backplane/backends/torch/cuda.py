"""GpuAcc's memory and CUDA graphs.

Memory: CUDA tensors. ``copy_in`` uploads the host array as it is, from pageable memory: the driver
stages it and returns once it has read the array (it may wait for the stream first). On an H100 that
took 45-55 us for a 1x3x224x224 float input, against 70-110 us for copying it into a pinned buffer of
ours, uploading that asynchronously and recording an event to keep the buffer alive until done;
``copy_out`` downloads it, which waits for the GPU work queued before it: that is the sync before
another backend or the user reads a GpuAcc output.

CUDA graphs: ``capture_views`` substitutes every static-shape GPU subgraph by one ``CudaGraph`` layer.
Its workload, made at load, uploads the subgraph's constants once, runs the layers' kernels twice on a
side stream (warm-up), captures them into a ``torch.cuda.CUDAGraph`` and from then on, per run,
copies the inputs into the graph's static input tensors and replays it: one launch for the subgraph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.kernels import bind_kernel
from backplane.backends.api.memory import MemorySource, TensorHandleFactory
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.torch.backend import FUSED_DOMAIN, _numpy_to_torch
from backplane.backends.torch.kernels.common import NUMPY_TO_TORCH
from backplane.ir.graph import Layer, SubgraphView, TensorInfo

HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Split": (1,), "Slice": (1, 2, 3, 4),
    "Squeeze": (1,), "Unsqueeze": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
    "ReduceMax": (1,), "ReduceMin": (1,), "Clip": (1, 2),
}
"""Inputs the kernels read on the host (shapes, axes, bounds): kept as NumPy inside a CUDA graph, since
reading a CUDA tensor on the host would wait for the GPU, which a capture forbids."""
NOT_CAPTURABLE = frozenset({"Shape"})  # makes a tensor from host values during the run


@functools.lru_cache(maxsize=None)
def factory(device: str) -> TensorHandleFactory:
    import torch

    target = torch.device(device)

    def copy_in(value: Any) -> Any:
        # From pageable memory the copy returns once the driver has read the array: it may be
        # freed right after, so no staging buffer has to outlive the call.
        return _numpy_to_torch(value).to(target, non_blocking=True)

    def copy_out(tensor: Any) -> np.ndarray:
        return tensor.cpu().numpy()

    return TensorHandleFactory(f"torch-{device}", MemorySource.CUDA, MemorySource.CUDA,
                               MemorySource.CUDA, supports_mapping=False, copy_in=copy_in,
                               copy_out=copy_out)


def capture_views(view: SubgraphView, backend: Any) -> OptimizationViews:
    """The whole subgraph as one CUDA graph when its inputs have static shapes."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    # Static boundary inputs fix every shape inside: no kernel here makes a shape from data, and
    # the shape-like inputs (HOST_INPUTS) must be constants.
    if not view.layers or not all(graph.info(n).is_static for n in view.inputs):
        return OptimizationViews(untouched=[view])
    for layer in view.layers:
        host = HOST_INPUTS.get(layer.op_type, ())
        if layer.op_type in NOT_CAPTURABLE or any(
                i < len(layer.inputs) and layer.inputs[i] and layer.inputs[i] not in graph.constants
                for i in host):
            return OptimizationViews(untouched=[view])
    constants = {n: graph.constants[n] for layer in view.layers for n in layer.inputs
                 if n in graph.constants}
    # The boundary names as the layers inside read and write them (the optimizer renames the
    # fused layer's inputs when it puts copies in front of them).
    attrs = {"layers": list(view.layers), "constants": constants, "inputs": list(view.inputs),
             "outputs": list(view.outputs)}
    name = f"CudaGraph[{view.layers[0].name}..{view.layers[-1].name}]({len(view.layers)} layers)"
    replacement = Layer(name, "CudaGraph", list(view.inputs), list(view.outputs), attrs,
                        FUSED_DOMAIN, 1)
    return OptimizationViews(substitutions=[Substitution(view, [replacement])])


def _inner_steps(layers: Sequence[Layer], backend: Any) -> list[tuple[Workload, Layer]]:
    steps = []
    for layer in layers:
        kernel = backend.kernel_for(layer)
        steps.append((bind_kernel(kernel, layer.attrs, len(layer.outputs)), layer))
    return steps


def _upload(layers: Sequence[Layer], constants: dict[str, np.ndarray], device: Any) -> dict[str, Any]:
    import torch

    host = {layer.inputs[i] for layer in layers for i in HOST_INPUTS.get(layer.op_type, ())
            if i < len(layer.inputs)}
    return {name: value if name in host else torch.from_numpy(np.array(value)).to(device)
            for name, value in constants.items()}


def cuda_graph_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload:
    """Capture at load, with the static inputs the boundary's tensor infos describe."""
    import torch

    device = backend.device()
    inner = layer.attrs["layers"]
    steps = _inner_steps(inner, backend)
    env_template = _upload(inner, layer.attrs["constants"], device)

    def run_layers(*values: Any) -> list[Any]:
        env = dict(env_template)
        env.update(zip(layer.attrs["inputs"], values))
        for workload, inner_layer in steps:
            results = workload(*[env[n] if n else None for n in inner_layer.inputs])
            env.update(zip(inner_layer.outputs, results))
        return [env[n] for n in layer.attrs["outputs"]]

    if not backend.options.get("GpuAcc.cuda_graphs", True):  # decided at load, with the options
        return lambda *values: tuple(run_layers(*values))
    static = [torch.zeros(info.shape, dtype=NUMPY_TO_TORCH[info.dtype], device=device)  # type: ignore
              for info in inputs]  # capture_views took only static inputs
    return CapturedGraph(run_layers, static, device)


class CapturedGraph:
    """Layers captured once into a CUDA graph; a call copies its inputs into the graph's static
    inputs and replays it. The outputs are the graph's static outputs, overwritten by the next call
    (whoever reads them copies them out first: a MemCopy, or the user through it)."""

    def __init__(self, run_layers: Callable[..., list[Any]], static_inputs: list[Any],
                 device: Any) -> None:
        import torch

        self.static_inputs = static_inputs
        self.run_layers = run_layers  # holds the uploaded constants the graph reads: keep them alive
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisations (cuBLAS handles, ...) happen here
                run_layers(*static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = tuple(run_layers(*static_inputs))

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        for static, value in zip(self.static_inputs, inputs):
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


WORKLOADS: dict[str, Callable[..., Workload]] = {"CudaGraph": cuda_graph_workload}
