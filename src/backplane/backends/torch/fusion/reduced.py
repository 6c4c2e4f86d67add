"""``CpuAcc.precision`` "bf16": a CpuAcc subgraph's float32 math computed in bfloat16 (Arm NN's
ReduceFp32ToBf16), as one ``Reduced`` layer.

Its float32 inputs are converted on entry, its float32 outputs on exit, its float32 constants once at
load (the fused layers' weights packed in bfloat16, for oneDNN's AMX and AVX512-BF16 kernels), and
every float32 result inside (a Cast to float, a ConstantOfShape) on the spot; the layers then run
one after the other, fused as in float32 (``fuse``), on bfloat16 tensors. Constants a kernel reads on
the host (Resize's scales, Clip's bounds: ``HOST_INPUTS``) stay as they are. bfloat16 has float32's
range and 8 bits of mantissa: results differ from float32 by about 1e-2 of their scale
(``bench/bench_openvino.py`` reports it beside the speed).

Only where the CPU has bfloat16 instructions for oneDNN's kernels (``hardware``: AVX512-BF16, AMX,
AVX-NE-CONVERT, Arm's BF16). Elsewhere torch's bfloat16 is emulated, 5-8x slower than float32 on
the developer machine's AVX2 (a 3x3 convolution 15.6 against 1.9 ms, a 128x768x768 product 8.9
against 1.7), so the subgraph stays float32 and a warning on the ``backplane.torch`` logger says so,
as OpenVINO's CPU plugin does with a precision its CPU lacks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from backplane.backends.api.backend import OptionError, Workload
from backplane.backends.torch.backend import FUSED_DOMAIN, _numpy_to_torch
from backplane.backends.torch.host_inputs import HOST_INPUTS
from backplane.backends.torch.fusion.patterns import named_type
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

log = logging.getLogger("backplane.torch")
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}
"""``CpuAcc.precision`` (GpuAcc's and OpenVINO's option name) -> the type float32 is computed in."""


def precision_of(options: Any) -> str | None:
    """``CpuAcc.precision``'s torch type name (None for fp32), or an error listing the choices."""
    choice = options.get("CpuAcc.precision", "fp32")
    if choice not in PRECISIONS:
        raise OptionError(f"CpuAcc.precision {choice!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[choice]


NATIVE = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16"})
"""CPU flags (x86's, and Arm's ``bf16`` feature) of bfloat16 arithmetic or conversion in hardware."""


@functools.lru_cache(maxsize=1)
def hardware() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU: torch's check, which also passes on plain
    AVX-512 (where oneDNN emulates bfloat16), and a flag of ``NATIVE`` in /proc/cpuinfo."""
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    return bool(cpu_flags() & NATIVE)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86's ``flags``, Arm's ``Features``); none
    where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(flag for line in text.splitlines()
                     if line.split(":")[0].strip() in ("flags", "Features")
                     for flag in line.partition(":")[2].split())


def reduced_type(options: Any) -> str | None:
    """The type this network's CpuAcc subgraphs compute float32 in: ``CpuAcc.precision``'s where the
    CPU has the kernels for it, else None (float32, with a warning)."""
    dtype = precision_of(options)
    if dtype is not None and not hardware():
        _warn(options.get("CpuAcc.precision"))
        return None
    return dtype


@functools.lru_cache(maxsize=None)
def _warn(choice: str) -> None:
    """Once per process, not once per subgraph."""
    from backplane.artifact.facts import cpu

    log.warning("CpuAcc.precision %s: this CPU (%s) has no bfloat16 instructions for oneDNN "
                "(AVX512-BF16, AMX or AVX-NE-CONVERT); computing in fp32", choice, cpu()["isa"])


def mark(layers: Sequence[Layer], dtype: str) -> list[Layer]:
    """``layers`` with each fused one marked to compute in ``dtype`` (its ``compute`` attribute: its
    weights packed and its routes measured in that type, ``patterns.weight_of``)."""
    return [Layer(lay.name, lay.op_type, lay.inputs, lay.outputs, {**lay.attrs, "compute": dtype},
                  lay.domain, lay.opset, lay.backend) if lay.domain == FUSED_DOMAIN else lay
            for lay in layers]


def wrap(view: SubgraphView, graph: Graph, layers: Sequence[Layer], dtype: str) -> Layer:
    """``layers`` (the view's layers after fusion, in order) as one Reduced layer computing in
    ``dtype``; its fused layers marked to pack their weights in it."""
    inner = mark(layers, dtype)
    constants = {n: graph.constants[n] for lay in layers for n in lay.inputs if n in graph.constants}
    attrs = {"layers": inner, "constants": constants, "inputs": list(view.inputs),
             "outputs": list(view.outputs), "compute": dtype,
             "output_dtypes": [graph.info(n).dtype for n in view.outputs]}
    first, last = layers[0].name.split("+")[0], layers[-1].name.split("+")[-1]  # model node names
    name = f"Reduced[{dtype}][{first}..{last}]({len(layers)} layers)"
    return Layer(name, "Reduced", list(view.inputs), list(view.outputs), attrs, FUSED_DOMAIN, 1)


def reduced_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo] = ()) -> Workload:
    """The layers one after the other on ``compute`` tensors, float32 converted at the edges."""
    from backplane.backends.torch.fusion.onednn_graph import layers_run

    return at_edges(layers_run(layer, backend), layer.attrs["compute"], layer.attrs["output_dtypes"])


def constants(layers: Sequence[Layer], arrays: dict[str, np.ndarray], dtype: Any,
              source: Any = None) -> dict[str, Any]:
    """``arrays`` as torch tensors, float32 ones (``source`` ones where given) in ``dtype`` (None:
    as they are) but those a kernel reads on the host (``HOST_INPUTS``: scales, bounds)."""
    host = {lay.inputs[i] for lay in layers for i in HOST_INPUTS.get(lay.op_type, ())
            if i < len(lay.inputs)}
    return {n: _numpy_to_torch(v) if n in host else lower(_numpy_to_torch(v), dtype, source)
            for n, v in arrays.items()}


def at_edges(run: Any, dtype: str, output_dtypes: Sequence[Any], source: str = "float32",
             ) -> Workload:
    """``run`` (which computes in ``dtype``) called on its ``source`` (float32) inputs converted
    to ``dtype``, its outputs declared ``source`` converted back; its attributes (``route``,
    ``inner``, ...) kept, its ``profiled`` (if any) converted alike."""
    computed, kind = named_type(dtype), named_type(source)
    raised = [d == np.dtype(source) for d in output_dtypes]

    def call(*values: Any) -> tuple[Any, ...]:
        outputs = run(*[lower(v, computed, kind) for v in values])
        return tuple(o.to(kind) if up else o for o, up in zip(outputs, raised))

    call.__dict__.update(getattr(run, "__dict__", {}))
    if hasattr(run, "profiled"):
        def profiled(*values: Any) -> tuple[tuple[Any, ...], list[tuple[str, str, float]]]:
            outputs, spent = run.profiled(*[lower(v, computed, kind) for v in values])
            return tuple(o.to(kind) if up else o for o, up in zip(outputs, raised)), spent

        call.profiled = profiled  # type: ignore[attr-defined]
    call.precision = {"bfloat16": "bf16", "float32": "fp32"}[dtype]  # type: ignore[attr-defined]
    return call


def lower(tensor: Any, dtype: Any, source: Any = None) -> Any:
    """A float32 tensor (a ``source`` one where given) in ``dtype``; anything else (and everything,
    for ``dtype`` None) as it is."""
    import torch

    return tensor.to(dtype) if dtype is not None and isinstance(tensor, torch.Tensor) \
        and tensor.dtype == (source or torch.float32) else tensor
