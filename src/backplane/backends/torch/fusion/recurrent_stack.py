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
            y, layers = native(x, sequence_lens, starts)  # each (1, batch, H)
        else:
            y, final = stack(x, sequence_lens, starts)
            layers = final.unsqueeze(1).unbind(0)
        return (y if squeezed else y.unsqueeze(1),
                *[state for state, wanted in zip(layers, states) if wanted])

    run.weights = (stack, native)  # type: ignore[attr-defined]  # held with the workload
    return run


# -- LSTM stacks -------------------------------------------------------------------------------
# LSTM -> Transpose(0, 2, 1, 3) -> Reshape(0, 0, -1) -> LSTM ..., as torch's exporters write a
# multi-layer nn.LSTM (lstm_bi2_ts14, crnn_paddle_ts12): one ``LstmStack`` layer, one op of one C
# call a layer where ``CpuAcc.native`` is "auto" (``native/recurrent_stack.py``: layer l writes
# its Y as layer l + 1 reads it), else each layer by CpuAcc's LSTM kernel and the two reshapes.
# Each layer: the default activations, no clip, no peepholes (or all zero), input_forget 0,
# time-major, constant float32 weights, one direction and hidden size, the same sequence_lens;
# its initial states anything. The last layer's Transpose and Reshape join where they read its Y
# alone. Not where a layer runs its steps apart from a trace (``traced._alone``: at two threads
# on a busy machine, today's path).


def match_lstm_stack(first: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The stack of two or more LSTM layers that starts with ``first``, or None."""
    if _lstm_weights(first, ctx) is None or _apart(first, ctx):
        return None
    group, lstms, layer, merged = [first], [first], first, False
    while True:
        pair = _merging(layer, ctx)
        if pair is None:
            break
        after = ctx.sole(pair[1].outputs[0])
        if after is None or after.op_type != "LSTM" or after.domain \
                or after.inputs[0] != pair[1].outputs[0] or not _same_lstms(first, after, ctx) \
                or _apart(after, ctx):
            merged = len(lstms) > 1
            group += list(pair) if merged else []
            break
        group += [*pair, after]
        lstms.append(after)
        layer = after
    if len(lstms) < 2:
        return None
    y = group[-1].outputs[0]
    joins = [_joined(lstms, i, ctx) for i in (1, 2)]  # a Concat of every layer's Y_h (Y_c)
    group += [join for join in joins if join is not None]
    if not _in_time(group, y, lstms, ctx):
        return None
    lens = _lens(first)
    initial = [tuple(bool(_input(lay, i)) for i in (5, 6)) for lay in lstms]
    states = [tuple(len(lay.outputs) > i and bool(lay.outputs[i]) and joins[i - 1] is None
                    for i in (1, 2)) for lay in lstms]
    inputs = [first.inputs[0]] + ([lens] if lens else []) + \
        [_input(lay, i) for lay in lstms for i in (5, 6) if _input(lay, i)]
    outputs = [y]
    for i, join in zip((1, 2), joins):  # Y_h's, then Y_c's: joined, or those read of each layer
        outputs += [join.outputs[0]] if join is not None else \
            [lay.outputs[i] for lay, wanted in zip(lstms, states) if wanted[i - 1]]
    fused = Layer("+".join(lay.name for lay in group), "LstmStack", inputs, outputs,
                  {"weights": [_lstm_weights(lay, ctx) for lay in lstms], "lens": bool(lens),
                   "initial": initial, "states": states, "merged": merged,
                   "joined": [join is not None for join in joins],
                   "direction": _direction(first), "replaced": len(group)},
                  FUSED_DOMAIN, 1)
    return group, fused


def _joined(lstms: list[Layer], index: int, ctx: Context) -> Layer | None:
    """The Concat on axis 0 of every layer's output ``index`` (Y_h, Y_c) in order, alone reading
    each (lstm_bi2_ts14's h and c: the stack's states as they are, no copy), or None."""
    names = [lay.outputs[index] if len(lay.outputs) > index else "" for lay in lstms]
    join = ctx.sole(names[0]) if all(names) else None
    if join is None or join.op_type != "Concat" or join.domain \
            or int(join.attrs.get("axis", 0)) not in (0, -3) or list(join.inputs) != names \
            or any(ctx.sole(name) is not join for name in names):
        return None
    return join


def _in_time(group: list[Layer], y: str, lstms: list[Layer], ctx: Context) -> bool:
    """Whether the layers of the view that read the final states (or their Concat) come after
    the layer that makes ``y`` (where the fused layer runs: ``fusion._in_order``)."""
    at = {id(lay): index for index, lay in enumerate(ctx.view.layers)}
    inside = {id(lay) for lay in group}
    last = max(at.get(id(lay), -1) for lay in group if y in lay.outputs)
    names = [name for lay in lstms for name in lay.outputs[1:] if name] + \
        [lay.outputs[0] for lay in group if lay.op_type == "Concat"]
    return all(at.get(id(user), last + 1) > last for name in names
               for user in ctx.consumers.get(name, []) if id(user) not in inside)


def _input(layer: Layer, index: int) -> str:
    return layer.inputs[index] if len(layer.inputs) > index else ""


def _lens(layer: Layer) -> str:
    return _input(layer, 4)


def _direction(layer: Layer) -> str:
    direction = layer.attrs.get("direction", "forward")
    return direction.decode() if isinstance(direction, bytes) else str(direction)


def _lstm_weights(lstm: Layer, ctx: Context) -> tuple[Any, Any, Any] | None:
    """An LSTM layer's constant W, R, B (B None where absent) where the stack computes it."""
    a = lstm.attrs
    if lstm.op_type != "LSTM" or lstm.domain or a.get("clip") is not None or a.get("layout", 0) \
            or a.get("input_forget", 0) or a.get("activation_alpha") or a.get("activation_beta"):
        return None
    dirs = 2 if _direction(lstm) == "bidirectional" else 1
    if _direction(lstm) not in ("forward", "reverse", "bidirectional") or \
            list(a.get("activations") or ["Sigmoid", "Tanh", "Tanh"] * dirs) != \
            ["Sigmoid", "Tanh", "Tanh"] * dirs or ctx.graph.info(lstm.inputs[0]).dtype != F32:
        return None
    if _input(lstm, 7):
        peepholes = ctx.const(lstm.inputs[7])
        if peepholes is None or peepholes.any():
            return None
    w, r = ctx.const(lstm.inputs[1]), ctx.const(lstm.inputs[2])
    b = ctx.const(lstm.inputs[3]) if _input(lstm, 3) else None
    if w is None or r is None or (_input(lstm, 3) and b is None) or w.dtype != F32 \
            or r.dtype != F32 or w.ndim != 3 or r.ndim != 3:
        return None
    hidden = r.shape[-1]
    if w.shape[:2] != (dirs, 4 * hidden) or r.shape != (dirs, 4 * hidden, hidden) \
            or (b is not None and (b.dtype != F32 or b.shape != (dirs, 8 * hidden))):
        return None
    return w, r, b


def _same_lstms(first: Layer, other: Layer, ctx: Context) -> bool:
    """Whether ``other`` stacks on ``first``: computed alike, one direction and hidden size, its
    input as wide as a layer's Y, the same sequence_lens."""
    mine, theirs = _lstm_weights(first, ctx), _lstm_weights(other, ctx)
    if mine is None or theirs is None or _direction(first) != _direction(other):
        return False
    dirs, hidden = mine[1].shape[0], mine[1].shape[-1]
    return theirs[1].shape[-1] == hidden and theirs[0].shape[-1] == dirs * hidden \
        and _lens(first) == _lens(other)


def _merging(lstm: Layer, ctx: Context) -> tuple[Layer, Layer] | None:
    """The Transpose(0, 2, 1, 3) and Reshape(0, 0, -1) that alone read ``lstm``'s Y, making it
    (seq, batch, dirs * H), or None."""
    transpose = ctx.sole(lstm.outputs[0])
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain \
            or list(transpose.attrs.get("perm") or []) != [0, 2, 1, 3]:
        return None
    reshape = ctx.sole(transpose.outputs[0])
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain \
            or reshape.inputs[0] != transpose.outputs[0] or reshape.attrs.get("allowzero", 0):
        return None
    shape = ctx.const(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
    weights = _lstm_weights(lstm, ctx)
    width = None if weights is None else weights[1].shape[0] * weights[1].shape[-1]
    if shape is None or width is None:
        return None
    values, dims = [int(v) for v in np.ravel(shape)], ctx.graph.info(transpose.outputs[0]).shape
    known = [] if dims is None or len(dims) != 4 else list(dims[:2])  # a specialized graph's sizes
    if values not in ([0, 0, -1], [0, 0, width], known + [-1], known + [width]):
        return None  # (lstm_bi2_dyn18's shape, folded from Shape ops: its sizes)
    return transpose, reshape


def _apart(lstm: Layer, ctx: Context) -> bool:
    """Whether a trace leaves this layer apart (``traced._alone``)."""
    from backplane.backends.torch.fusion.traced import _alone

    return _alone(lstm, ctx.graph, ctx.native)


def lstm_stack_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch

    from backplane.backends.torch.kernels.recurrent import lstm
    from backplane.native.build import mode
    from backplane.native.recurrent import built

    a = layer.attrs
    direction, merged, hidden = a["direction"], a["merged"], a["weights"][0][1].shape[-1]
    joined, dirs = a.get("joined", [False, False]), a["weights"][0][1].shape[0]
    weights = [tuple(None if v is None else torch.from_numpy(np.ascontiguousarray(v)) for v in w)
               for w in a["weights"]]
    native, placed = None, {}
    if mode(backend.options) == "auto" and built():
        from backplane.native import recurrent as in_c
        from backplane.native.recurrent_stack import Stack

        native = Stack("lstm", [in_c.prepared("lstm", *w) for w in weights], hidden, direction)

    def run(x: Any, *rest: Any) -> tuple[Any, ...]:
        given = list(rest)
        sequence_lens = given.pop(0) if a["lens"] else None
        h0, c0 = [], []
        for has_h, has_c in a["initial"]:
            h0.append(given.pop(0) if has_h else None)
            c0.append(given.pop(0) if has_c else None)
        if native is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            y, h, c = native(x, sequence_lens, h0, c0, merged)  # (L * dirs, batch, H) each
            hs = [h] if joined[0] else list(h.split(dirs))
            cs = [c] if joined[1] else list(c.split(dirs))
        else:  # each layer by CpuAcc's kernel, its Y made (seq, batch, dirs * H) for the next
            hs, cs, y = [], [], x
            if x.device not in placed:
                placed[x.device] = [[None if v is None else v.to(x.device) for v in w]
                                    for w in weights]
            for index, (w, r, b) in enumerate(placed[x.device]):
                y, h, c = lstm(y, w, r, b, sequence_lens, h0[index], c0[index],
                               direction=direction, hidden_size=hidden)
                if index < len(weights) - 1 or merged:
                    y = y.permute(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
                hs.append(h)
                cs.append(c)
            hs, cs = ([torch.cat(hs)] if joined[0] else hs), ([torch.cat(cs)] if joined[1] else cs)
        return (y, *[v for v, wanted in zip(hs, a["states"]) if joined[0] or wanted[0]],
                *[v for v, wanted in zip(cs, a["states"]) if joined[1] or wanted[1]])

    run.weights = (placed, native)  # type: ignore[attr-defined]  # held with the workload
    return run
