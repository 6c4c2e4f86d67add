"""Stacked forward GRU layers as exporters write them, GRU -> Squeeze(axis 1) -> GRU -> ...: one
``GruStack`` layer, stepped by wavefronts (``kernels/recurrent_stack.py`` says why: gru_tm3_ts13's
24 steps of five ops a run become 10 wavefronts of five).

Each layer: ONNX's GRU with linear_before_reset=1 (what torch's nn.GRU exports), forward, the
default activations, no clip, time-major, constant weights, one hidden size; all of them with the
same sequence_lens (or none); an initial state each, constant, an input or none. Each layer's Y
but the last is read by its Squeeze alone, and that by the next layer alone; the final states may
be read by anything (the fused layer makes each). The last layer's Y is the layer's output, or
its Squeeze's where that alone reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer


def match_gru_stack(first: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The stack of two or more GRU layers that starts with ``first``, or None."""
    if _weights(first, ctx) is None:
        return None
    group, grus, layer = [first], [first], first
    while True:
        squeeze = ctx.sole(layer.outputs[0])
        if squeeze is None or not _squeezes_directions(squeeze, ctx):
            break
        after = ctx.sole(squeeze.outputs[0])
        if after is None or after.op_type != "GRU" or after.inputs[0] != squeeze.outputs[0] \
                or not _same_stack(first, after, ctx):
            if len(grus) > 1 and layer.outputs[0] not in ctx.graph.outputs:
                group.append(squeeze)  # the last layer's Squeeze, its Y read by it alone
            break
        group += [squeeze, after]
        grus.append(after)
        layer = after
    if len(grus) < 2:
        return None
    last = group[-1] if group[-1].op_type == "Squeeze" else None
    states = [g.outputs[1] if len(g.outputs) > 1 else "" for g in grus]
    initial = [g.inputs[5] if len(g.inputs) > 5 else "" for g in grus]
    lens = first.inputs[4] if len(first.inputs) > 4 else ""
    inputs = [first.inputs[0]] + [name for name in [lens, *initial] if name]
    y = last.outputs[0] if last is not None else grus[-1].outputs[0]
    fused = Layer("+".join(lay.name for lay in group), "GruStack", inputs,
                  [y] + [s for s in states if s],
                  {"weights": [_weights(g, ctx) for g in grus], "lens": bool(lens),
                   "initial": [bool(i) for i in initial], "states": [bool(s) for s in states],
                   "squeezed": last is not None,
                   "replaced": len(group)},  # what a trace counts it as (``traced.UNTIMED_LAYERS``)
                  FUSED_DOMAIN, 1)
    return group, fused


def _weights(gru: Layer, ctx: Context) -> tuple[Any, Any, Any] | None:
    """A GRU layer's constant W, R, B (B None where absent) where the wavefront computes it
    (``kernels/recurrent_stack.py``), else None."""
    a = gru.attrs
    if gru.op_type != "GRU" or gru.domain or not a.get("linear_before_reset") \
            or a.get("direction", "forward") not in ("forward", b"forward") \
            or a.get("clip") is not None or a.get("layout", 0) or a.get("activation_alpha") \
            or a.get("activation_beta") \
            or list(a.get("activations") or ["Sigmoid", "Tanh"]) != ["Sigmoid", "Tanh"]:
        return None
    if ctx.graph.info(gru.inputs[0]).dtype != F32:
        return None
    w, r = ctx.const(gru.inputs[1]), ctx.const(gru.inputs[2])
    b = ctx.const(gru.inputs[3]) if len(gru.inputs) > 3 and gru.inputs[3] else None
    if w is None or r is None or (len(gru.inputs) > 3 and gru.inputs[3] and b is None):
        return None
    hidden = r.shape[-1]
    if w.dtype != F32 or r.shape != (1, 3 * hidden, hidden) or w.ndim != 3 \
            or w.shape[:2] != (1, 3 * hidden) or (b is not None and b.shape != (1, 6 * hidden)):
        return None
    return w, r, b


def _same_stack(first: Layer, other: Layer, ctx: Context) -> bool:
    """Whether ``other`` stacks on ``first``'s layers: computed alike, one hidden size, input
    as wide as that, the same sequence_lens."""
    weights = _weights(other, ctx)
    if weights is None:
        return False
    hidden = ctx.const(first.inputs[2]).shape[-1]  # type: ignore[union-attr]
    lens = [lay.inputs[4] if len(lay.inputs) > 4 else "" for lay in (first, other)]
    return weights[1].shape[-1] == hidden and weights[0].shape[-1] == hidden \
        and lens[0] == lens[1]


def _squeezes_directions(squeeze: Layer, ctx: Context) -> bool:
    """Whether ``squeeze`` drops axis 1 (a one-direction Y's) and nothing else."""
    if squeeze.op_type != "Squeeze" or squeeze.domain:
        return False
    if len(squeeze.inputs) > 1 and squeeze.inputs[1]:
        axes = ctx.const(squeeze.inputs[1])
        axes = None if axes is None else [int(v) for v in np.ravel(axes)]
    else:
        axes = squeeze.attrs.get("axes")
    return axes is not None and list(axes) in ([1], [-3])


def gru_stack_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch

    from backplane.backends.torch.kernels.recurrent_stack import GruStack, NativeStack
    from backplane.native.build import mode
    from backplane.native.recurrent import built

    a = layer.attrs
    stack = GruStack(a["weights"])
    # in C where built and CpuAcc.native is "auto" (float32 only: the wavefronts otherwise)
    native = NativeStack(a["weights"]) if mode(backend.options) == "auto" \
        and built() else None
    lens, initial, states, squeezed = a["lens"], a["initial"], a["states"], a["squeezed"]

    def run(x: Any, *rest: Any) -> tuple[Any, ...]:
        given = list(rest)
        sequence_lens = given.pop(0) if lens else None
        starts = [given.pop(0) if present else None for present in initial]
        if native is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            y, final = native(x, sequence_lens, starts)
        else:
            y, final = stack(x, sequence_lens, starts)
        layers = final.unsqueeze(1).unbind(0)  # each (1, batch, H)
        return (y if squeezed else y.unsqueeze(1),
                *[state for state, wanted in zip(layers, states) if wanted])

    run.weights = (stack, native)  # type: ignore[attr-defined]  # held with the workload
    return run
