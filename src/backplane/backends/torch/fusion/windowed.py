"""A small 1-d Conv of a transposed (N, L, C) tensor, and its siblings of the same windows, as
one matrix product of those windows (``WindowedConv``).

Why: an embedding's (N, L, C) output transposed to (N, C, L) and convolved without padding or
dilation has windows that are rows of the (N, L, C) memory: window i is the K * C values from
row i * stride, one strided view. The convolution is then that view times the weight laid out
(O, K * C), one ``addmm`` with the bias, and sibling convolutions of the same input and
geometry (a gated Conv1d: ``conv(x) * sigmoid(gate(x))``) are one product of their weights
stacked, each output a view of its columns. The small tier's byte classifier (16 channels, 512
bytes, kernel 16, stride 8, two 64-channel convolutions), 1 thread, CPU time, this 2-core AMD EPYC
at load 7: oneDNN's two packed convolutions, their gate and max 300-410 us, one packed
convolution of both 300-320, the product 117-187. At the full tier's size (8 channels, 16384
bytes, kernel 32, stride 16, 128 channels each) the product was the slower (6.3-7.0 ms against
3.1-4.3 at 1 thread), so it is taken up to ``PRODUCT_MACS`` multiply-adds only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context, holding, weight_of
from backplane.ir.graph import Layer

PRODUCT_MACS = 1 << 22
"""The multiply-adds (all siblings together) up to which the windows' product is taken: the
small byte classifier's 2.1 M are faster so (above), the full tier's 67 M slower."""


def match_windowed_conv(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """``layer`` and its free sibling convolutions of the same windows as one WindowedConv, or
    None where the input is not a transposed (N, L, C) tensor or the product would be large."""
    geometry = _geometry(layer, ctx)
    x = layer.inputs[0]
    made = ctx.graph.producers().get(x)
    shape = ctx.shape(x)
    if geometry is None or shape is None or len(shape) != 3 or made is None \
            or made.op_type != "Transpose" or made.domain \
            or list(made.attrs.get("perm", [])) != [0, 2, 1]:
        return None
    group = [layer] + [u for u in ctx.consumers.get(x, []) if u is not layer and u.op_type == "Conv"
                       and u.inputs[0] == x and _geometry(u, ctx) == geometry]
    if any(id(u) not in ctx.inside or id(u) in ctx.taken for u in group):
        return None  # a sibling fused otherwise (a batch norm folded): the rest stay convolutions
    if any(r.op_type in ("QuantizeLinear", "BatchNormalization")
           for u in group for r in ctx.consumers.get(u.outputs[0], [])):
        return None  # a QDQ convolution's, or one with a batch norm to fold: FusedConv's
    if len(group) > 1 and any(u.outputs[0] in ctx.graph.outputs for u in group):
        group = [layer]  # outputs of one product would share its memory: a run's are the caller's
    n, c, length = shape
    kernel, stride = geometry
    rows = (length - kernel) // stride + 1
    weights = [ctx.const(u.inputs[1]) for u in group]
    splits = [int(w.shape[0]) for w in weights]
    if rows < 1 or n * rows * sum(splits) * kernel * c > PRODUCT_MACS:
        return None
    stacked = np.concatenate([w.transpose(0, 2, 1).reshape(w.shape[0], kernel * c)
                              for w in weights])  # (O, K * C): a window's (K, C) order
    biases = [ctx.const(u.inputs[2]) if len(u.inputs) > 2 and u.inputs[2] else
              np.zeros(size, np.float32) for u, size in zip(group, splits)]
    attrs = {"weight": np.ascontiguousarray(stacked, F32),
             "bias": np.ascontiguousarray(np.concatenate(biases), F32), "splits": splits,
             "kernel": kernel, "stride": stride, "channels": c}
    fused = Layer("+".join(u.name for u in group), "WindowedConv", [x],
                  [u.outputs[0] for u in group], attrs, FUSED_DOMAIN, 1)
    return group, fused


def _geometry(conv: Layer, ctx: Context) -> tuple[int, int] | None:
    """(kernel, stride) of a 1-d float32 Conv by constant weights of one group, without padding
    or dilation; None for any other."""
    a = conv.attrs
    weight = ctx.const(conv.inputs[1]) if len(conv.inputs) > 1 else None
    bias = conv.inputs[2] if len(conv.inputs) > 2 else ""
    if conv.domain or conv.op_type != "Conv" or weight is None or weight.dtype != F32 \
            or weight.ndim != 3 or (bias and ctx.const(bias) is None) or a.get("group", 1) != 1:
        return None
    if any(d != 1 for d in a.get("dilations", [1])) or any(p != 0 for p in a.get("pads", [0, 0])) \
            or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID", b"NOTSET", b"VALID"):
        return None
    kernel = int(weight.shape[2])
    if list(a.get("kernel_shape", [kernel])) != [kernel]:
        return None
    return kernel, int(a.get("strides", [1])[0])


def windowed_conv_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The windows of the (N, L, C) memory under ``x`` (a strided view; its copy where ``x`` is
    not that transpose) times the stacked weight, plus the bias; each output its columns,
    transposed back to (N, O, L') as a view."""
    import torch

    a = layer.attrs
    weight = weight_of(a, "weight")
    bias = weight_of(a, "bias")
    stacked = weight.t()  # (K * C, O): a view
    kernel, stride, channels, splits = a["kernel"], a["stride"], a["channels"], a["splits"]

    def run(x: Any) -> tuple[Any, ...]:
        n, _, length = x.shape
        rows = (length - kernel) // stride + 1
        memory = x.transpose(1, 2)
        if not memory.is_contiguous():
            memory = memory.contiguous()
        windows = memory.as_strided((n, rows, kernel * channels),
                                    (length * channels, stride * channels, 1),
                                    memory.storage_offset())
        if n == 1:
            y = torch.addmm(bias, windows[0], stacked).unsqueeze(0)
        else:
            y = torch.matmul(windows, stacked).add_(bias)
        outputs, start = [], 0
        for size in splits:
            outputs.append(y[:, :, start:start + size].transpose(1, 2))
            start += size
        return tuple(outputs)
    return holding(run, weight, bias)
