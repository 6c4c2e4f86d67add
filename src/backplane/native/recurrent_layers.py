"""The layers ``recurrent_net.plan`` takes, each a function (layer, plan, get, constants) -> the
views of its outputs: the recurrent layers as records of ``recurrent.c``'s loop (their weights
packed by ``recurrent.prepared``), the moves between them as views or strided copies, CpuAcc's
Linear as a record of ``recurrent_net.h``'s product. Each raises ``Unplannable`` where the C would
not compute what ONNX says."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.native.recurrent_net import (
    ACTS,
    DIRECTIONS,
    LINEAR,
    RNN,
    SOFTMAX,
    Plan,
    Unplannable,
    View,
    _dense,
    largest_product,
)

FUSED = "backplane.torch"  # (backends/torch/backend.py's FUSED_DOMAIN, not imported: no torch)
Get = Callable[[str], View]


def _ints(constants: dict[str, Any], name: str) -> list[int]:
    value = constants.get(name) if name else None
    if value is None:
        raise Unplannable(f"{name}: not a constant")
    return [int(v) for v in np.ravel(value)]


def _axes(layer: Any, constants: dict[str, Any]) -> list[int] | None:
    if len(layer.inputs) > 1 and layer.inputs[1]:
        return _ints(constants, layer.inputs[1])
    axes = layer.attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def _transpose(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    perm = [int(p) for p in layer.attrs.get("perm") or reversed(range(len(x.shape)))]
    return [x.moved([x.shape[p] for p in perm], [x.strides[p] for p in perm])]


def _squeeze(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    axes = _axes(layer, constants)
    rank = len(x.shape)
    drop = {a % rank for a in axes} if axes is not None else \
        {i for i, d in enumerate(x.shape) if d == 1}
    if any(x.shape[a] != 1 for a in drop):
        raise Unplannable("Squeeze of an axis not of size 1")
    keep = [i for i in range(rank) if i not in drop]
    return [x.moved([x.shape[i] for i in keep], [x.strides[i] for i in keep])]


def _unsqueeze(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    axes = _axes(layer, constants)
    if axes is None:
        raise Unplannable("Unsqueeze without axes")
    rank = len(x.shape) + len(axes)
    added = sorted(a % rank for a in axes)
    shape, strides, rest = [], [], iter(zip(x.shape, x.strides))
    for i in range(rank):
        d, s = (1, 0) if i in added else next(rest)
        shape.append(d)
        strides.append(s)
    return [x.moved(shape, strides)]


def _reshaped(plan: Plan, x: View, shape: Sequence[int], kind: str) -> View:
    x = plan.dense(x, kind)
    return x.moved(shape, _dense(shape))


def _reshape(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    wanted = _ints(constants, layer.inputs[1])
    if layer.attrs.get("allowzero", 0) and 0 in wanted:
        raise Unplannable("Reshape with allowzero")
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(wanted)]
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1]))
        shape[shape.index(-1)] = int(np.prod(x.shape)) // max(known, 1)
    if int(np.prod(shape)) != int(np.prod(x.shape)):
        raise Unplannable("Reshape to another size")
    return [_reshaped(plan, x, shape, layer.name)]


def _flatten(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    axis = int(layer.attrs.get("axis", 1)) % max(len(x.shape), 1)
    shape = [int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))]
    return [_reshaped(plan, x, shape, layer.name)]


def _identity(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    return [get(layer.inputs[0])]


def _slice(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    rank = len(x.shape)
    if len(layer.inputs) < 3:  # opset 1-9: attributes
        starts, ends = list(layer.attrs["starts"]), list(layer.attrs["ends"])
        axes = list(layer.attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(constants, layer.inputs[1]), _ints(constants, layer.inputs[2])
        axes = _ints(constants, layer.inputs[3]) if len(layer.inputs) > 3 and layer.inputs[3] \
            else list(range(len(starts)))
        steps = _ints(constants, layer.inputs[4]) if len(layer.inputs) > 4 and layer.inputs[4] \
            else [1] * len(starts)
    shape, strides, offset = list(x.shape), list(x.strides), 0
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= rank
        if step < 1:
            raise Unplannable("Slice with a step below 1")
        size = x.shape[axis]
        start = max(0, min(size, start + size if start < 0 else start))
        end = max(0, min(size, end + size if end < 0 else end))
        shape[axis] = max(0, -(-(end - start) // step))
        offset += start * x.strides[axis]
        strides[axis] = x.strides[axis] * step
    if 0 in shape:
        raise Unplannable("an empty Slice")
    return [x.moved(shape, strides, offset)]


def _gather(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    x = get(layer.inputs[0])
    indices = constants.get(layer.inputs[1])
    if indices is None:
        raise Unplannable("Gather of indices not constant")
    indices = np.asarray(indices)
    axis = int(layer.attrs.get("axis", 0)) % len(x.shape)
    size = x.shape[axis]
    values = [int(i) + size if int(i) < 0 else int(i) for i in indices.reshape(-1)]
    if any(not 0 <= i < size for i in values):
        raise Unplannable("Gather out of range")
    if indices.ndim == 0:  # a select: the axis dropped
        shape = [d for i, d in enumerate(x.shape) if i != axis]
        strides = [s for i, s in enumerate(x.strides) if i != axis]
        return [x.moved(shape, strides, values[0] * x.strides[axis])]
    step = values[1] - values[0] if len(values) > 1 else 1
    if indices.ndim != 1 or step < 1 or values != list(range(values[0], values[-1] + 1, step)):
        raise Unplannable("Gather of indices not a range")
    shape, strides = list(x.shape), list(x.strides)
    shape[axis], strides[axis] = len(values), x.strides[axis] * step
    return [x.moved(shape, strides, values[0] * x.strides[axis])]


def _concat(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    parts = [get(n) for n in layer.inputs if n]
    rank = len(parts[0].shape)
    axis = int(layer.attrs.get("axis", 0)) % rank
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    out = plan.buffer(shape)
    at = 0
    for part in parts:
        plan.copy(part, out.moved(part.shape, out.strides, at * out.strides[axis]), layer.name)
        at += part.shape[axis]
    return [out]


def _linear(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    a = layer.attrs
    unary = a.get("unary")
    act = unary[0] if unary else None
    if a.get("binary") or a.get("compute") or act not in ACTS or (unary and unary[1]):
        raise Unplannable("a Linear with a residual, reduced precision or another activation")
    weight = np.asarray(a["weight"])
    if weight.dtype != np.float32 or (a["bias"] is not None and a["bias"].dtype != np.float32):
        raise Unplannable("a Linear not of float32")
    n, k = weight.shape
    x = get(layer.inputs[0])
    if x.shape[-1] != k:
        raise Unplannable("a Linear's input not as wide as its weight")
    lead = list(x.shape[:-1])
    rows = int(np.prod(lead))
    if rows * k * n > largest_product():
        raise Unplannable(f"a Linear of {rows * k * n} multiply-adds")
    step = _row_step(x)
    flat = x.moved([rows, k], [step, 1]) if step is not None else \
        plan.dense(x, layer.name).moved([rows, k], [k, 1])
    out_shape = a.get("output_shape") or [*lead, n]
    out = plan.buffer(out_shape)
    packed, bias = plan.panels(weight, a["bias"])
    plan.record(layer.name, [LINEAR, rows, k, n, flat.ref(), flat.strides[0], packed, bias,
                             out.ref(), ACTS[act]])
    plan.flops += rows * k * n
    return [out]


def _row_step(x: View) -> int | None:
    """The floats between rows of ``x`` taken as (rows, last dimension), contiguous inside; None
    where its leading dimensions do not fold into one stride."""
    if x.strides[-1] != 1 and x.shape[-1] != 1:
        return None
    lead = [(d, s) for d, s in zip(x.shape[:-1], x.strides[:-1]) if d != 1]
    for (_, outer), (size, inner) in zip(lead, lead[1:]):
        if outer != inner * size:
            return None
    return lead[-1][1] if lead else x.shape[-1]


PROJECT_ROWS = 16
"""The fewest rows (steps x batch) whose input projection a plan makes before the loop where
``_projects`` would have it (fewer are not worth a product record of their own)."""
TOGETHER = 32 << 10
"""recurrent.c's ``TOGETHER``: the bytes of weights a loop's rows read together from L1."""


def _projects(rows: int, dirs: int, inputs: int, hidden: int, gates: int) -> bool | None:
    """Whether a layer's input projection is one product before its loop: where its directions'
    ``[W, R]`` would not stay in L1 together (the loop then reads R alone, and the product's
    register tile takes W at its rate, AVX-512's 120 GMAC/s here), over at least
    ``PROJECT_ROWS`` rows; else recurrent.py's own rule (``STACKED_BYTES``). The small-tier CRNN's
    layers (80 steps, both directions, [W, R] 48 KB each), 1 thread, the plan's call, thread CPU,
    load 8, three pairs alternating: 58.2, 62.1, 59.8 -> 58.0, 54.8, 52.9 us."""
    stacked = gates * hidden * (inputs + hidden) * 4
    if rows >= PROJECT_ROWS and dirs * stacked > TOGETHER:
        return True
    return None


def _rnn(plan: Plan, kind: str, weights: Sequence[Any], lbr: int, direction: str, x: View,
         h0: View | None, c0: View | None, y: View, yh: View, yc: View | None, name: str) -> None:
    """One layer's record (its input's projection first where ``recurrent.prepared`` makes one):
    ``y`` (seq, dirs, batch, H) by any strides, ``yh``, ``yc`` dense (dirs, batch, H)."""
    import torch

    from backplane.native import recurrent as single

    w, r, b = weights
    dirs, hidden, gates = r.shape[0], r.shape[-1], 4 if kind == "lstm" else 3
    if len(x.shape) != 3 or x.shape[2] != w.shape[-1] or 0 in x.shape:
        raise Unplannable(f"{name}: an input of shape {x.shape}")
    seq, batch, inputs = x.shape
    as_torch = [None if v is None else torch.from_numpy(np.ascontiguousarray(v, np.float32))
                for v in (w, r, b)]
    with torch.no_grad():
        packed, bias, w_in, b_in = single.prepared(
            kind, *as_torch, lbr, _projects(seq * batch, dirs, inputs, hidden, gates))
    if x.strides[-1] != 1:
        x = plan.dense(x, name)
    xt, xb, width, xd = x.strides[0], x.strides[1], inputs, 0
    if w_in is not None:  # every step's input projection first, one product
        if seq * batch * w_in.numel() > largest_product():
            raise Unplannable(f"{name}: an input projection of {seq * batch * w_in.numel()} "
                              f"multiply-adds")
        step = _row_step(x)
        if step is None:
            x, step = plan.dense(x, name), inputs
        outputs = dirs * gates * hidden
        made = plan.buffer((seq, batch, outputs))
        w_at, b_at = plan.panels(w_in.numpy(), b_in.numpy())
        plan.record(name, [LINEAR, seq * batch, inputs, outputs, x.ref(), step, w_at, b_at,
                           made.ref(), 0])
        plan.flops += seq * batch * inputs * outputs
        x, xt, xb, width, xd = made, batch * outputs, outputs, 0, gates * hidden
    states = (dirs, batch, hidden)
    starts = []
    for value in (h0, c0):
        if value is not None and tuple(value.shape) != states:
            raise Unplannable(f"{name}: an initial state of shape {value.shape}")
        starts.append(-1 if value is None else plan.dense(value, name).ref())
    if tuple(y.shape) != (seq, dirs, batch, hidden) or y.strides[-1] != 1 or not yh.dense():
        raise Unplannable(f"{name}: outputs not as planned")
    shape = [seq, dirs, batch, width, hidden, DIRECTIONS[direction], xt, xb, batch * hidden,
             hidden, *y.strides[:3], lbr, xd]
    plan.record(name, [RNN, int(kind == "gru"), *shape, x.ref(), plan.const(packed.numpy()).ref(),
                       plan.const(bias.numpy()).ref(), *starts, -1, y.ref(), yh.ref(),
                       -1 if yc is None else yc.ref()])
    plan.flops += seq * dirs * batch * (width + hidden) * gates * hidden


def _direction(attrs: dict[str, Any]) -> str:
    direction = attrs.get("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    if direction not in DIRECTIONS:
        raise Unplannable(f"direction {direction}")
    return direction


def _checked(layer: Any, constants: dict[str, Any]) -> tuple[str, tuple[Any, ...], int, str]:
    """A plain LSTM or GRU layer's kind, constant (W, R, B), linear_before_reset, direction."""
    a, kind = layer.attrs, layer.op_type.lower()
    direction = _direction(a)
    dirs = 2 if direction == "bidirectional" else 1
    default = (["Sigmoid", "Tanh", "Tanh"] if kind == "lstm" else ["Sigmoid", "Tanh"]) * dirs
    activations = [v.decode() if isinstance(v, bytes) else str(v)
                   for v in (a.get("activations") or default)]
    if a.get("clip") is not None or a.get("layout", 0) or a.get("input_forget", 0) \
            or a.get("activation_alpha") or a.get("activation_beta") or activations != default:
        raise Unplannable(f"{layer.name}: attributes the C loop does not compute")
    given = list(layer.inputs) + [""] * 8
    if given[4]:
        raise Unplannable(f"{layer.name}: sequence_lens")
    if kind == "lstm" and given[7]:
        peepholes = constants.get(given[7])
        if peepholes is None or np.asarray(peepholes).any():
            raise Unplannable(f"{layer.name}: peepholes")
    w, r = constants.get(given[1]), constants.get(given[2])
    b = constants.get(given[3]) if given[3] else None
    gates = 4 if kind == "lstm" else 3
    if w is None or r is None or (given[3] and b is None):
        raise Unplannable(f"{layer.name}: weights not constant")
    hidden = r.shape[-1]
    if any(v.dtype != np.float32 for v in (w, r) + ((b,) if b is not None else ())) \
            or w.ndim != 3 or w.shape[:2] != (dirs, gates * hidden) \
            or r.shape != (dirs, gates * hidden, hidden) \
            or (b is not None and b.shape != (dirs, 2 * gates * hidden)) \
            or int(a.get("hidden_size", hidden)) != hidden:
        raise Unplannable(f"{layer.name}: weights of other shapes or types")
    return kind, (w, r, b), int(a.get("linear_before_reset", 0)), direction


def _recurrent(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    kind, weights, lbr, direction = _checked(layer, constants)
    given = list(layer.inputs) + [""] * 8
    x = get(given[0])
    dirs, hidden = weights[1].shape[0], weights[1].shape[-1]
    h0 = get(given[5]) if given[5] else None
    c0 = get(given[6]) if kind == "lstm" and given[6] else None
    if len(x.shape) != 3:
        raise Unplannable(f"{layer.name}: an input of rank {len(x.shape)}")
    seq, batch = x.shape[:2]
    y = plan.buffer((seq, dirs, batch, hidden))
    yh = plan.buffer((dirs, batch, hidden))
    yc = plan.buffer((dirs, batch, hidden)) if kind == "lstm" else None
    _rnn(plan, kind, weights, lbr, direction, x, h0, c0, y, yh, yc, layer.name)
    return [y, yh] + ([yc] if yc is not None else [])


def _lstm_stack(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    """CpuAcc's LstmStack (``fusion/recurrent_stack.py``): each layer's Y written as the next
    reads it, (seq, batch, dirs, H)."""
    a = layer.attrs
    if a["lens"]:
        raise Unplannable(f"{layer.name}: sequence_lens")
    given = iter(layer.inputs)
    x = get(next(given))
    starts = [tuple(get(next(given)) if has else None for has in pair) for pair in a["initial"]]
    count, (dirs, _, hidden) = len(a["weights"]), a["weights"][0][1].shape
    if len(x.shape) != 3:
        raise Unplannable(f"{layer.name}: an input of rank {len(x.shape)}")
    seq, batch = x.shape[:2]
    joined = a.get("joined", [False, False])
    finals = [plan.buffer((count * dirs, batch, hidden)) for _ in range(2)]
    each = dirs * batch * hidden
    for index, weights in enumerate(a["weights"]):
        merged = index < count - 1 or a["merged"]
        made = plan.buffer((seq, batch, dirs, hidden) if merged else (seq, dirs, batch, hidden))
        y = made.moved((seq, dirs, batch, hidden), [made.strides[i] for i in (0, 2, 1, 3)]) \
            if merged else made
        h, c = [f.moved((dirs, batch, hidden), _dense((dirs, batch, hidden)), index * each)
                for f in finals]
        _rnn(plan, "lstm", weights, 0, a["direction"], x, starts[index][0], starts[index][1], y,
             h, c, layer.name)
        x = made.moved((seq, batch, dirs * hidden), _dense((seq, batch, dirs * hidden))) \
            if merged else made
    states: list[View] = []
    for which, final in enumerate(finals):
        if joined[which]:
            states.append(final)
            continue
        for index, wanted in enumerate(a["states"]):
            if wanted[which]:
                states.append(final.moved((dirs, batch, hidden), _dense((dirs, batch, hidden)),
                                          index * each))
    return [x, *states]


def _gru_stack(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    """CpuAcc's GruStack (``fusion/recurrent_stack.py``): forward GRUs, linear_before_reset."""
    a = layer.attrs
    if a["lens"]:
        raise Unplannable(f"{layer.name}: sequence_lens")
    given = iter(layer.inputs)
    x = get(next(given))
    starts = [get(next(given)) if has else None for has in a["initial"]]
    if len(x.shape) != 3:
        raise Unplannable(f"{layer.name}: an input of rank {len(x.shape)}")
    seq, batch = x.shape[:2]
    hidden = a["weights"][0][1].shape[-1]
    states = []
    for weights, start in zip(a["weights"], starts):
        y = plan.buffer((seq, 1, batch, hidden))
        h = plan.buffer((1, batch, hidden))
        _rnn(plan, "gru", weights, 1, "forward", x, start, None, y, h, None, layer.name)
        x = y.moved((seq, batch, hidden), _dense((seq, batch, hidden)))
        states.append(h)
    out = x if a["squeezed"] else x.moved((seq, 1, batch, hidden), _dense((seq, 1, batch, hidden)))
    return [out, *[h for h, wanted in zip(states, a["states"]) if wanted]]


def _softmax(layer: Any, plan: Plan, get: Get, constants: dict[str, Any]) -> list[View]:
    """ONNX's Softmax: over the last axis (opset 13 on), or over the dimensions from ``axis`` on
    (before 13: the input taken as 2-d), into a dense copy."""
    x = get(layer.inputs[0])
    rank = len(x.shape)
    axis = int(layer.attrs.get("axis", -1 if layer.opset >= 13 else 1)) % max(rank, 1)
    if layer.opset >= 13 and axis != rank - 1:
        raise Unplannable("a Softmax not over the last axis")
    out = plan.buffer(x.shape)
    plan.copy(x, out, layer.name)
    n = int(np.prod(x.shape[axis:]))
    plan.record(layer.name, [SOFTMAX, int(np.prod(x.shape)) // max(n, 1), n, out.ref()])
    return [out]


PLANNERS: dict[str, Callable[[Any, Plan, Get, dict[str, Any]], list[View]]] = {
    "Transpose": _transpose, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Reshape": _reshape,
    "Flatten": _flatten, "Identity": _identity, "Slice": _slice, "Gather": _gather,
    "Concat": _concat, "Linear": _linear, "LSTM": _recurrent, "GRU": _recurrent,
    "LstmStack": _lstm_stack, "GruStack": _gru_stack, "Softmax": _softmax}
RECURRENT = ("LSTM", "GRU", "LstmStack", "GruStack")
