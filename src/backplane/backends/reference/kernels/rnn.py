"""Recurrent layers: RNN, GRU and LSTM, one time step at a time (the loop is over time, not pixels).

Shapes (layout 0): X (seq, batch, input); W (dirs, gates * hidden, input); R (dirs, gates * hidden,
hidden); B (dirs, 2 * gates * hidden); Y (seq, dirs, batch, hidden); Y_h, Y_c (dirs, batch, hidden).
Layout 1 swaps seq and batch in X and Y, and puts batch first in the states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo

ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "Tanh": np.tanh,
    "Relu": lambda x: np.maximum(x, 0),
    "Softsign": lambda x: x / (1 + np.abs(x)),
    "Softplus": lambda x: np.logaddexp(0, x),
}

Cell = Callable[[np.ndarray, list[np.ndarray], int], list[np.ndarray]]


def _run(cell: Cell, X, states, sequence_lens, direction, layout):
    """Run ``cell`` over time for each direction; returns Y and the final states (layout 0)."""
    if layout:
        X, states = np.swapaxes(X, 0, 1), [np.swapaxes(s, 0, 1) for s in states]
    seq, batch = X.shape[:2]
    lengths = np.full(batch, seq) if sequence_lens is None else np.asarray(sequence_lens)
    directions = 2 if direction == "bidirectional" else 1
    ys, finals = [], []
    for d in range(directions):
        backward = direction == "reverse" or d == 1
        carried = [s[d] for s in states]
        y = np.zeros((seq, batch, states[0].shape[-1]), dtype=X.dtype)
        for t in range(seq):
            # Backward, each sequence starts at its own last valid step.
            steps = lengths - 1 - t if backward else np.full(batch, t)
            valid = (steps >= 0) & (t < lengths)
            x_t = X[np.clip(steps, 0, seq - 1), np.arange(batch)]
            updated = cell(x_t, carried, d)
            carried = [np.where(valid[:, None], new, old) for new, old in zip(updated, carried)]
            y[np.clip(steps, 0, seq - 1)[valid], np.arange(batch)[valid]] = carried[0][valid]
        ys.append(y)
        finals.append(carried)
    y_all = np.stack(ys, axis=1)  # (seq, dirs, batch, hidden)
    final_states = [np.stack([f[i] for f in finals]) for i in range(len(states))]
    if layout:
        y_all = y_all.transpose(2, 0, 1, 3)
        final_states = [np.swapaxes(s, 0, 1) for s in final_states]
    return y_all, final_states


def _initial(value, X, directions, hidden_size, layout):
    batch = X.shape[1 - layout] if X.ndim == 3 else X.shape[0]
    if value is not None:
        return value
    shape = (batch, directions, hidden_size) if layout else (directions, batch, hidden_size)
    return np.zeros(shape, dtype=X.dtype)


def _biases(B, directions, gates, hidden_size, dtype):
    if B is None:
        return np.zeros((directions, 2 * gates * hidden_size), dtype=dtype)
    return B


def _functions(activations, defaults, directions):
    names = list(activations or defaults * directions)
    per = len(defaults)
    return [[ACTIVATIONS[n] for n in names[d * per:(d + 1) * per]] for d in range(directions)]


def _clipped(values, clip):
    return values if clip is None else np.clip(values, -clip, clip)


def rnn(X, W, R, B=None, sequence_lens=None, initial_h=None, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, *, n_outputs=2):
    dirs = W.shape[0]
    bias = _biases(B, dirs, 1, W.shape[1], X.dtype)
    funcs = _functions(activations, ["Tanh"], dirs)

    def cell(x, states, d):
        gates = x @ W[d].T + states[0] @ R[d].T + bias[d, :W.shape[1]] + bias[d, W.shape[1]:]
        return [funcs[d][0](_clipped(gates, clip))]

    h0 = _initial(initial_h, X, dirs, W.shape[1], layout)
    y, (y_h,) = _run(cell, X, [h0], sequence_lens, direction, layout)
    return (y.astype(X.dtype), y_h.astype(X.dtype))[:n_outputs]


def gru(X, W, R, B=None, sequence_lens=None, initial_h=None, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, linear_before_reset=0, *, n_outputs=2):
    dirs, hidden = W.shape[0], W.shape[1] // 3
    bias = _biases(B, dirs, 3, hidden, X.dtype)
    funcs = _functions(activations, ["Sigmoid", "Tanh"], dirs)

    def cell(x, states, d):
        (h,) = states
        w_b, r_b = bias[d, :3 * hidden], bias[d, 3 * hidden:]
        xw = x @ W[d].T + w_b  # gates z, r, h
        hr = h @ R[d, :2 * hidden].T + r_b[:2 * hidden]
        z = funcs[d][0](_clipped(xw[:, :hidden] + hr[:, :hidden], clip))
        r = funcs[d][0](_clipped(xw[:, hidden:2 * hidden] + hr[:, hidden:], clip))
        r_h, r_hb = R[d, 2 * hidden:], r_b[2 * hidden:]
        recurrent = r * (h @ r_h.T + r_hb) if linear_before_reset else (r * h) @ r_h.T + r_hb
        candidate = funcs[d][1](_clipped(xw[:, 2 * hidden:] + recurrent, clip))
        return [(1 - z) * candidate + z * h]

    h0 = _initial(initial_h, X, dirs, hidden, layout)
    y, (y_h,) = _run(cell, X, [h0], sequence_lens, direction, layout)
    return (y.astype(X.dtype), y_h.astype(X.dtype))[:n_outputs]


def lstm(X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None,
         activation_alpha=None, activation_beta=None, activations=None, clip=None,
         direction="forward", hidden_size=None, input_forget=0, layout=0, *, n_outputs=3):
    dirs, hidden = W.shape[0], W.shape[1] // 4
    bias = _biases(B, dirs, 4, hidden, X.dtype)
    peep = np.zeros((dirs, 3 * hidden), dtype=X.dtype) if P is None else P
    funcs = _functions(activations, ["Sigmoid", "Tanh", "Tanh"], dirs)

    def cell(x, states, d):
        h, c = states
        f, g, act = funcs[d]
        gates = x @ W[d].T + h @ R[d].T + bias[d, :4 * hidden] + bias[d, 4 * hidden:]
        i_, o_, f_, c_ = np.split(gates, 4, axis=1)  # ONNX gate order: i, o, f, c
        p_i, p_o, p_f = np.split(peep[d], 3)
        i = f(_clipped(i_ + p_i * c, clip))
        forget = 1 - i if input_forget else f(_clipped(f_ + p_f * c, clip))
        c_new = forget * c + i * g(_clipped(c_, clip))
        o = f(_clipped(o_ + p_o * c_new, clip))
        return [o * act(c_new), c_new]

    h0 = _initial(initial_h, X, dirs, hidden, layout)
    c0 = _initial(initial_c, X, dirs, hidden, layout)
    y, (y_h, y_c) = _run(cell, X, [h0, c0], sequence_lens, direction, layout)
    return (y.astype(X.dtype), y_h.astype(X.dtype), y_c.astype(X.dtype))[:n_outputs]


def check_rnn(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("activation_alpha") or layer.attrs.get("activation_beta"):
        return "activation_alpha / activation_beta not supported"
    unknown = [a for a in layer.attrs.get("activations", []) if a not in ACTIVATIONS]
    if unknown:
        return f"activation(s) {unknown} not supported (known: {list(ACTIVATIONS)})"
    return weights_contradiction(layer, inputs)


GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def weights_contradiction(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    """Where the layer's attributes and its weights' known sizes disagree (a hidden_size that is
    not the weights', a direction count that is not theirs): ONNX Runtime refuses such a model,
    OpenVINO crashed on it, and a kernel would read past or short of the weights."""
    gates = GATES[layer.op_type]
    hidden = layer.attrs.get("hidden_size")
    directions = 2 if layer.attrs.get("direction", "forward") == "bidirectional" else 1
    w = inputs[1].shape if len(inputs) > 1 else None
    r = inputs[2].shape if len(inputs) > 2 else None
    if w is None or r is None or len(w) != 3 or len(r) != 3:
        return None
    if isinstance(r[2], int) and hidden is not None and r[2] != hidden:
        return f"hidden_size {hidden} but R {list(r)} is of hidden size {r[2]}"
    hidden = hidden if hidden is not None else r[2]
    x = inputs[0].shape
    if x and isinstance(x[-1], int) and isinstance(w[2], int) and x[-1] != w[2]:
        return f"X {list(x)} has {x[-1]} features where W {list(w)} takes {w[2]}"
    for name, shape in (("W", w), ("R", r)):
        if isinstance(shape[1], int) and isinstance(hidden, int) and shape[1] != gates * hidden:
            return (f"{name} {list(shape)} has {shape[1]} rows where {layer.op_type} of hidden "
                    f"size {hidden} has {gates} x {hidden}")
        if isinstance(shape[0], int) and shape[0] != directions:
            return (f"{name} {list(shape)} holds {shape[0]} directions where direction "
                    f"'{layer.attrs.get('direction', 'forward')}' has {directions}")
    return None


KERNELS: KernelTable = {
    "RNN": {7: rnn},
    "GRU": {7: gru},
    "LSTM": {7: lstm},
}

CHECKS = {"RNN": check_rnn, "GRU": check_rnn, "LSTM": check_rnn}
