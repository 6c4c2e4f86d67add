"""torch's int8 convolution inside a TorchScript trace (``Traced``), for a small QLinearConv.

``torch.ops.quantized.conv2d`` reads its weight as a packed object (a TorchScript custom class),
and ``torch.jit.trace`` refuses one that is not an attribute of the traced module ("not part of
the active trace"), so a trace that met an int8 route failed and its layers ran one by one; a
traced QOperator graph therefore kept the float route below ``int8.KNOWN_MACS``: the product of
the centred integers and the requantization in float64, about ten TorchScript calls a layer.
``conv2d`` below records the call itself, the packed weight a constant of the graph (as
``torch.jit.freeze`` makes a quantized module's), so the trace holds one call that convolves and
requantizes. Small convolutions (the small tier's, 16 channels at 8x8) on this 2-core AMD EPYC,
1 thread, frozen trace, CPU us: quantize, int8 convolution, integers out 9.5; the float route's
centring, convolution and float64 requantization 30.5.

The weight is packed for FBGEMM where torch has it: at these sizes its convolution's fixed cost
is the smallest (16x8x8 3x3, eager, us: FBGEMM 16.2, oneDNN 23.4, the "x86" engine, which picks
oneDNN on a VNNI CPU, 24.2). Each packed object runs its own engine's kernel whatever the
process's engine; only the packing reads the engine, set for that call alone. The kernels'
rounding of the requantization is ONNX Runtime's (rint of the float32 product): on 40 random
per-channel cases (61,632 values) FBGEMM's, oneDNN's, ONNX Runtime's and CpuRef's integers were
all equal; a value within a float32 rounding of a half step may land one step away.
"""

from __future__ import annotations

import threading
from typing import Any

_ENGINE = threading.Lock()


def prepack(weight: Any, bias: Any, strides: list[int], pads: list[int], dilations: list[int],
            group: int) -> Any:
    """``quantized.conv2d_prepack`` for FBGEMM where torch has it, else its default engine."""
    import torch

    engines = torch.backends.quantized
    with _ENGINE:
        before = engines.engine
        if "fbgemm" in engines.supported_engines:
            engines.engine = "fbgemm"
        try:
            return torch.ops.quantized.conv2d_prepack(weight, bias, strides, pads, dilations,
                                                      group)
        finally:
            engines.engine = before


def conv2d(q: Any, packed: Any, scale: float, zero: int, relu: bool = False) -> Any:
    """``torch.ops.quantized.conv2d`` (``conv2d_relu`` where ``relu``) of the quint8 tensor
    ``q``; in an active trace, the call is also written into the trace's graph with ``packed``
    as a constant, which the tracer would refuse as an argument."""
    import torch

    op = torch.ops.quantized.conv2d_relu if relu else torch.ops.quantized.conv2d
    state = torch._C._get_tracing_state()
    if state is None:
        return op(q, packed, scale, zero)
    torch._C._set_tracing_state(None)  # run it untraced, then record it by hand
    try:
        out = op(q, packed, scale, zero)
    finally:
        torch._C._set_tracing_state(state)
    graph = state.graph()
    name = "quantized::conv2d_relu" if relu else "quantized::conv2d"
    node = graph.create(name, [torch._C._get_value_trace(q), graph.insertConstant(packed),
                               graph.insertConstant(float(scale)),
                               graph.insertConstant(int(zero))], 1)
    graph.insertNode(node)
    node.output().inferTypeFrom(out)
    torch._C._set_value_trace(out, node.output())
    return out
