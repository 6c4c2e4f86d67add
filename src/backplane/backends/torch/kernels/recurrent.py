"""RNN, GRU and LSTM on torch.

In a CpuAcc trace under ``CpuAcc.native`` "auto", an LSTM or GRU of more than one step, the
default activations and no clip (nor peepholes, nor input_forget) is one call of C over all its
steps where the package's C builds (``native/recurrent.py``, ``_in_c``); what follows is the rest.
They run as one call of torch's fused kernel (``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh`` /
``rnn_relu``, what nn.LSTM / GRU / RNN call; oneDNN's LSTM on the CPU; ``recurrent_fused.py``) where
ONNX's attributes are what it computes: the default activations (RNN's Tanh or Relu), no clip, full
sequences, LSTM without peepholes (or all zero) and input_forget, GRU with linear_before_reset=1.
A GRU with linear_before_reset=0 and those attributes steps in a few ops, all directions at once
(``_reset_first``), and so do, in a TorchScript trace, one with linear_before_reset=1 and a short
small bidirectional LSTM (``_lstm_steps``). A large bidirectional layer's directions run at once
on two threads (``recurrent_parallel.py``). Elsewhere they step through time as CpuRef does (every
ONNX option: directions, the activations torch has, clip, sequence_lens, initial states,
peepholes, layouts), every step's input projection in one matrix product before the loop, the
recurrent one per step. (The other network kernels: ``network.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.rnn import weights_contradiction
from backplane.backends.torch.kernels.common import FLOATS
from backplane.backends.torch.kernels.recurrent_fused import (
    CUDNN_MODES,
    fused,
    one_step,
    pair_of,
    params_of,
    runs_alone,
)
from backplane.backends.torch.kernels.recurrent_parallel import at_once, directions
from backplane.ir.graph import Layer, TensorInfo
from backplane.native import recurrent as in_c

# -- RNN, GRU, LSTM --------------------------------------------------------------------------------
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh,
    "Relu": torch.relu,
    "Softsign": lambda x: x / (1 + x.abs()),
    "Softplus": lambda x: torch.logaddexp(torch.zeros_like(x), x),  # no threshold, as in CpuRef
}

LSTM_ORDER, GRU_ORDER = [0, 2, 3, 1], [1, 0, 2]
"""torch's gates (LSTM i, f, g, o; GRU r, z, n) as indices into ONNX's (LSTM i, o, f, c; GRU z, r,
h)."""
RNN_NATIVE = {"Tanh": torch.rnn_tanh, "Relu": torch.rnn_relu}
Cell = Callable[[torch.Tensor, list[torch.Tensor], int], list[torch.Tensor]]


def _native(function, order, X, W, R, B, states, direction, layout):
    """All steps and directions in one call of torch's fused kernel (``torch.lstm``, ``torch.gru``,
    ``torch.rnn_tanh``, ``torch.rnn_relu``, what nn.LSTM / GRU / RNN call): Y and the final states,
    shaped as ONNX's."""
    name, hidden, bidirectional = function.__name__, R.shape[-1], direction == "bidirectional"
    params = params_of(W, R, B, order, CUDNN_MODES.get(name), layout)
    if X.shape[layout] == 1:
        return one_step(STEP_CELLS[name], X, params, B is not None, states, layout)
    # (W's directions: torch refuses a count other than 1 or 2)
    # torch runs backward only as a bidirectional's second half: reverse alone runs forward on
    # the flipped sequence (time is axis `layout`), and its Y is flipped back
    reverse = direction == "reverse"
    x = X.flip(layout) if reverse else X
    # torch's states are (dirs, batch, hidden) in both layouts
    hx = [(s.transpose(0, 1) if layout else s).contiguous() for s in states]
    cpu, batch = X.device.type == "cpu", X.shape[1 - layout]
    pair = pair_of(name, W, params, B is not None) if bidirectional and cpu else None
    wide = 1 if pair is None else 2  # paired: both directions in one call of twice the width
    alone = cpu and runs_alone(batch, wide * R.shape[1], wide * hidden)
    # a large layer's directions at once, each on one thread (recurrent_parallel.py)
    steps = X.shape[layout]
    if alone and pair is None and bidirectional and at_once(steps, batch, *W.shape[1:], hidden):
        out, *final = directions(name, x, hx, params, B is not None, bool(layout))
    else:
        out, *final = fused(function, x, hx, pair, params, B is not None, bidirectional,
                            bool(layout), alone)
    y = out.unflatten(2, (1 + bidirectional, hidden))  # (seq, batch, dirs, hidden), or batch first
    y = y.flip(layout) if reverse else y
    return (y if layout else y.transpose(1, 2)), [f.transpose(0, 1) if layout else f for f in final]


STEP_CELLS = {"lstm": torch.lstm_cell, "gru": torch.gru_cell, "rnn_tanh": torch.rnn_tanh_cell,
              "rnn_relu": torch.rnn_relu_cell}
"""torch's one-step cell per fused kernel: the same gates, the two products by addmm. On a
one-step sequence (a streaming model's chunk, the corpus's VAD) the fused CPU kernel (oneDNN's
``mkldnn_rnn_layer``) pays its setup per call: an LSTM step, batch 1, hidden 128, 1 thread on this
project's 2-core AMD EPYC at load 5: torch.lstm 203 us, torch.lstm_cell 61-69 us. On the GPU too:
cuDNN's persistent LSTM kernel (``RNN_blockPersist_fp_LSTM``) was 37.6 us of the full-tier VAD's
126 us of kernels a run on an H100, for that one step."""



def _full(sequence_lens, seq):
    """Whether every sequence is ``seq`` steps long: no sequence_lens, or all of them equal to it.
    Their values are read on the CPU only (on a GPU the read would wait for the device, which a CUDA
    graph's capture forbids)."""
    if sequence_lens is None:
        return True
    return sequence_lens.device.type == "cpu" and bool((sequence_lens == seq).all())


def _natively(X, sequence_lens, clip, layout, names, defaults):
    """Whether torch's fused kernel computes what ONNX asks: the default activations in every
    direction, no clip, full sequences, and steps to take."""
    return (clip is None and layout in (0, 1) and X.numel() > 0 and list(names) == defaults
            and _full(sequence_lens, X.shape[layout]))


def _in_c(X, W, R, B, clip, layout, names, defaults):
    """Whether the layer runs as one call of C (``native/recurrent.py``: in a CpuAcc trace under
    ``CpuAcc.native`` "auto"): the default activations, no clip, either layout, any
    sequence_lens, more than one step (one step is torch's cell, a few ops: the VAD's LSTM, 1
    thread, load 3.7-4.6, thread CPU a run 284 us with the cell, 411 with the C call, whose
    Python custom op costs about 15 us of dispatch and allocation)."""
    return (clip is None and layout in (0, 1) and names == defaults and X.dim() == 3
            and X.shape[layout] > 1 and in_c.usable(X, W, R, B))


def _run(cell: Cell, projected, states, sequence_lens, direction, layout):
    """``cell`` over time for each direction, fed each step's input projection (``projected``:
    (seq, batch, dirs, gates), time first): Y (seq, dirs, batch, hidden) and the final states
    (dirs, batch, hidden), or batch first with layout 1."""
    if layout:
        states = [s.transpose(0, 1) for s in states]
    seq = projected.shape[0]
    ys, finals = [], []
    for d in range(2 if direction == "bidirectional" else 1):
        backward = direction == "reverse" or d == 1
        carried = [s[d] for s in states]
        if _full(sequence_lens, seq):
            y, carried = _steps(cell, projected[:, :, d], carried, d, backward)
        else:
            y, carried = _masked_steps(cell, projected[:, :, d], carried, d, backward,
                                       sequence_lens.long())
        ys.append(y)
        finals.append(carried)
    y_all = torch.stack(ys, dim=1)
    final = [torch.stack([f[i] for f in finals]) for i in range(len(states))]
    if layout:
        return y_all.permute(2, 0, 1, 3), [s.transpose(0, 1) for s in final]
    return y_all, final


def _steps(cell: Cell, xw, carried, d, backward):
    """Every sequence as long as ``xw`` (seq, batch, gates): one cell call per step, no masks."""
    seq = xw.shape[0]
    outputs = [carried[0]] * seq
    for t in range(seq - 1, -1, -1) if backward else range(seq):
        carried = cell(xw[t], carried, d)
        outputs[t] = carried[0]
    y = torch.stack(outputs) if seq else carried[0].new_zeros((0, *carried[0].shape))
    return y, carried


def _masked_steps(cell: Cell, xw, carried, d, backward, lengths):
    """Sequences of their own ``lengths``: a step past a sequence's end keeps its state, and its
    Y stays zero; backward, each sequence starts at its own last valid step."""
    seq, batch = xw.shape[:2]
    rows = torch.arange(batch, device=xw.device)
    y = carried[0].new_zeros((seq, *carried[0].shape))
    for t in range(seq):
        steps = lengths - 1 - t if backward else torch.full_like(lengths, t)
        valid = ((steps >= 0) & (t < lengths))[:, None]
        at = steps.clamp(0, max(seq - 1, 0))
        updated = cell(xw[at, rows], carried, d)
        carried = [torch.where(valid, new, old) for new, old in zip(updated, carried)]
        y[at, rows] = torch.where(valid, carried[0], y[at, rows])
    return y, carried


def _projected(X, W, bias, layout):
    """Every step's input projection X W^T + bias in one matrix product: (seq, batch, dirs, gates),
    time first. The loop is left with the recurrent part."""
    x = X.transpose(0, 1) if layout else X
    # (one op: linear adds the bias in its product)
    return F.linear(x, W.flatten(0, 1), bias.flatten()).unflatten(-1, (W.shape[0], -1))


def _backward_reversed(values, direction):
    """``values`` (seq, dirs, ...) with a backward direction's steps in reverse order: all of them
    for reverse; for bidirectional the second direction's, by one flip and one select by
    direction (``where`` on a mask a frozen graph folds), not a flip of each direction's view and
    a stack (two ops a bidirectional layer's input and output, not four)."""
    if direction == "forward":
        return values
    flipped = values.flip(0)
    if direction == "reverse":
        return flipped
    second = torch.arange(2, device=values.device).view(2, *[1] * (values.dim() - 2)) == 1
    return torch.where(second, flipped, values)


def _initial(value, X, directions, hidden, layout):
    if value is not None:
        return value
    batch = X.shape[1 - layout]
    shape = (batch, directions, hidden) if layout else (directions, batch, hidden)
    return torch.zeros(shape, dtype=X.dtype, device=X.device)


def _biases(B, directions, gates, hidden, X):
    if B is None:
        return torch.zeros((directions, 2 * gates * hidden), dtype=X.dtype, device=X.device)
    return B


def _functions(names, per, directions):
    return [[ACTIVATIONS[n] for n in names[d * per:(d + 1) * per]] for d in range(directions)]


def _clipped(values, clip):
    return values if clip is None else values.clamp(-clip, clip)


def rnn(X, W, R, B=None, sequence_lens=None, initial_h=None, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, *, n_outputs=2):
    dirs, hidden = W.shape[0], W.shape[1]
    names = list(activations or ["Tanh"] * dirs)
    h0 = _initial(initial_h, X, dirs, hidden, layout)
    native = names[0] in RNN_NATIVE  # one kernel for both directions: the same activation
    if native and _natively(X, sequence_lens, clip, layout, names, names[:1] * dirs):
        y, (y_h,) = _native(RNN_NATIVE[names[0]], [0], X, W, R, B, [h0], direction, layout)
        return (y, y_h)[:n_outputs]
    bias = _biases(B, dirs, 1, hidden, X)
    funcs = _functions(names, 1, dirs)

    def cell(xw, states, d):
        return [funcs[d][0](_clipped(xw + states[0] @ R[d].T, clip))]

    projected = _projected(X, W, bias[:, :hidden] + bias[:, hidden:], layout)
    y, (y_h,) = _run(cell, projected, [h0], sequence_lens, direction, layout)
    return (y, y_h)[:n_outputs]


def gru(X, W, R, B=None, sequence_lens=None, initial_h=None, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, linear_before_reset=0, *, n_outputs=2):
    dirs, hidden = W.shape[0], W.shape[1] // 3
    names = list(activations or ["Sigmoid", "Tanh"] * dirs)
    if _in_c(X, W, R, B, clip, layout, names, ["Sigmoid", "Tanh"] * dirs):
        return in_c.layer("gru", X, W, R, B, sequence_lens, initial_h, None, direction, layout,
                          linear_before_reset)[:n_outputs]
    h0 = _initial(initial_h, X, dirs, hidden, layout)
    # torch's GRU applies the reset gate after the recurrent product: linear_before_reset=1 only
    if _natively(X, sequence_lens, clip, layout, names, ["Sigmoid", "Tanh"] * dirs):
        if linear_before_reset and not _stepped_reset(X, hidden, layout, dirs):
            y, (y_h,) = _native(torch.gru, GRU_ORDER, X, W, R, B, [h0], direction, layout)
        else:
            y, y_h = _reset_first(X, W, R, B, h0, direction, layout, linear_before_reset)
        return (y, y_h)[:n_outputs]
    bias = _biases(B, dirs, 3, hidden, X)
    funcs = _functions(names, 2, dirs)

    def cell(xw, states, d):  # xw: gates z, r, h of X W^T + Wb
        (h,) = states
        r_b = bias[d, 3 * hidden:]
        hr = h @ R[d, :2 * hidden].T + r_b[:2 * hidden]
        z = funcs[d][0](_clipped(xw[:, :hidden] + hr[:, :hidden], clip))
        r = funcs[d][0](_clipped(xw[:, hidden:2 * hidden] + hr[:, hidden:], clip))
        r_h, r_hb = R[d, 2 * hidden:], r_b[2 * hidden:]
        recurrent = r * (h @ r_h.T + r_hb) if linear_before_reset else (r * h) @ r_h.T + r_hb
        candidate = funcs[d][1](_clipped(xw[:, 2 * hidden:] + recurrent, clip))
        return [(1 - z) * candidate + z * h]

    projected = _projected(X, W, bias[:, :3 * hidden], layout)
    y, (y_h,) = _run(cell, projected, [h0], sequence_lens, direction, layout)
    return (y, y_h)[:n_outputs]


STEPPED_GRU_HIDDEN = {1: 384, 2: 384}
"""The widest GRU with linear_before_reset=1 that a TorchScript trace on the CPU steps in
``_reset_first``'s ops rather than by torch's GRU (``_stepped_reset``), by its directions: a
layer traced and frozen, 1 thread, this 2-core AMD EPYC (AVX2) at load 5.5, p10 CPU us, torch's
GRU / stepped, 100 steps, input 64: bidirectional hidden 96 4756 / 3057, 128 6985 / 4555, 192
8613 / 7010, 256 16245 / 9918 (50 steps, hidden 512: 14520 / 21371); forward hidden 96 1825 /
1638, 128 3770 / 3457, 256 5161 / 5327 (torch's GRU runs each direction's steps in its own
dozen ATen calls a step; the stepped ops do both directions in each). With five ops a step (the
fourteenth session; load 8-9, median CPU us, torch's / stepped, recurrent weights small enough
not to be chaotic): forward 100 steps hidden 256 12399 / 10034, 384 10725-12971 / 10084-10725,
512 24994 / 23142 (p10 16240 / 17083: kept torch's); bidirectional 50 steps hidden 256 7061 /
5488, 384 11440-15656 / 10162-13829, 512 24210 / 46532."""

STEPPED_GRU_AT_TWO = 128
"""The widest one-direction layer ``_stepped_reset`` steps at two threads or more (the limit of
before, measured there on gru_tm3_ts13's 20)."""


def _stepped_reset(X, hidden, layout, dirs):
    """Whether a GRU with linear_before_reset=1 runs by ``_reset_first``: where TorchScript traces
    it on the CPU (a frozen graph's ops cost less than torch's GRU loop, a dozen ATen calls a step
    and a direction, or its paired call; eager, each op's Python call costs more), more than one
    step (one is torch's cell, one call), at most ``STEPPED_GRU_HIDDEN`` wide, at one thread or
    one direction of ``STEPPED_GRU_AT_TWO`` or less: at two, the two directions' ``baddbmm``
    opens a parallel region a product (gru_bi2_dyn19's trace at 2 threads, load 13.5: p10 796 ->
    9172 us a run; 614 -> 512 for gru_tm3_ts13's one direction); wider ones were measured at one
    thread only."""
    return (torch.jit.is_tracing() and X.device.type == "cpu" and X.shape[layout] > 1
            and hidden <= STEPPED_GRU_HIDDEN.get(int(dirs), 0)
            and (torch.get_num_threads() == 1 or dirs == 1 and hidden <= STEPPED_GRU_AT_TWO))


def _reset_first(X, W, R, B, h0, direction, layout, linear_before_reset=0):
    """A GRU with linear_before_reset=0 (ONNX's default, which torch's kernel does not compute)
    and the default activations over full sequences: every direction's step in a few ops, the
    directions side by side as a batch of products (``baddbmm``: no block of zeros that would
    carry a NaN from one to the other), all steps' input projections and both biases of the z
    and r gates and of h's input side in one product before the loop (Rb_h is added with them:
    it is outside the reset). Y (seq, dirs, batch, hidden) and Y_h (dirs, batch, hidden), or
    batch first with layout 1. (The step loop of ``_run`` costs about twice the ops a
    direction.) With ``linear_before_reset`` (where ``_stepped_reset``), h's recurrent bias is
    added to its recurrent product inside the reset, the other biases before the loop, and that
    product is made with z's and r's as one (``[z, r, h] = h [Rz, Rr, Rh] + [.., .., Rb_h]``: five
    ops a step, not six; a cat of the addends before the loop)."""
    dirs, hidden = W.shape[0], W.shape[1] // 3
    h = h0.transpose(0, 1) if layout else h0  # (dirs, batch, hidden)
    bias = _biases(B, dirs, 3, hidden, X)
    w_b, r_b = bias[:, :3 * hidden], bias[:, 3 * hidden:]
    if linear_before_reset:  # Rb_h is inside the reset: added to h's recurrent product
        r_hb = r_b[:, 2 * hidden:].unsqueeze(1)  # (dirs, 1, hidden)
        r_b = torch.cat([r_b[:, :2 * hidden], torch.zeros_like(r_b[:, 2 * hidden:])], 1)
    # (seq, dirs, batch, 3 hidden)
    xw = _projected(X, W, w_b + r_b, layout).transpose(1, 2)
    xw = _backward_reversed(xw, direction)  # a backward direction reads the sequence from its end
    r_h = R[:, 2 * hidden:].transpose(1, 2)  # (dirs, hidden, hidden)
    x_zr, x_n = xw.split([2 * hidden, hidden], -1)  # gates z, r and h of every step
    if linear_before_reset:  # z, r and h's recurrent part in one product a step, Rb_h its addend
        x_zr = torch.cat([x_zr, r_hb.expand_as(x_n)], -1)
        recurrent = R.transpose(1, 2)  # (dirs, hidden, 3 hidden)
    else:
        recurrent = R[:, :2 * hidden].transpose(1, 2)  # (dirs, hidden, 2 hidden)
    # each step's views made once before the loop (one op each, not two a step), (dirs, batch, .)
    x_zr, x_n = x_zr.unbind(0), x_n.unbind(0)
    # each step's products in one buffer whose views are made once (a view costs about what an
    # op does): z and r, then h's recurrent part (h Rh + Rb_h) with linear_before_reset
    gates = h.new_empty((dirs, h.shape[1], recurrent.shape[-1]))
    zr, h_r = gates.split([2 * hidden, hidden], -1) if linear_before_reset else (gates, None)
    z, r = zr.chunk(2, -1)
    ys = []
    for t in range(xw.shape[0]):
        torch.baddbmm(x_zr[t], h, recurrent, out=gates)
        zr.sigmoid_()
        if linear_before_reset:  # n = tanh(x Wh + Wb_h + r * (h Rh + Rb_h))
            n = torch.addcmul(x_n[t], r, h_r).tanh_()
        else:  # n = tanh(x Wh + Wb_h + (r * h) Rh + Rb_h)
            n = torch.baddbmm(x_n[t], r * h, r_h).tanh_()
        h = torch.lerp(n, h, z)  # (1 - z) * n + z * h in one op
        ys.append(h)
    y = torch.stack(ys)  # (seq, dirs, batch, hidden)
    y = _backward_reversed(y, direction)
    if layout:
        return y.permute(2, 0, 1, 3), h.transpose(0, 1)
    return y, h


def lstm(X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None,
         activation_alpha=None, activation_beta=None, activations=None, clip=None,
         direction="forward", hidden_size=None, input_forget=0, layout=0, *, n_outputs=3):
    dirs, hidden = W.shape[0], W.shape[1] // 4
    names = list(activations or ["Sigmoid", "Tanh", "Tanh"] * dirs)
    # peepholes of zeros change nothing (read on the CPU only, as sequence_lens)
    no_peepholes = P is None or (P.device.type == "cpu" and not P.any())
    if no_peepholes and not input_forget and _in_c(X, W, R, B, clip, layout, names,
                                                   ["Sigmoid", "Tanh", "Tanh"] * dirs):
        return in_c.layer("lstm", X, W, R, B, sequence_lens, initial_h, initial_c, direction,
                          layout)[:n_outputs]
    h0 = _initial(initial_h, X, dirs, hidden, layout)
    c0 = _initial(initial_c, X, dirs, hidden, layout)
    if no_peepholes and not input_forget and _natively(X, sequence_lens, clip, layout, names,
                                                       ["Sigmoid", "Tanh", "Tanh"] * dirs):
        if _stepped_lstm(X, hidden, layout, direction):
            y, y_h, y_c = _lstm_steps(X, W, R, B, h0, c0, direction, layout)
        else:
            y, (y_h, y_c) = _native(torch.lstm, LSTM_ORDER, X, W, R, B, [h0, c0], direction,
                                    layout)
        return (y, y_h, y_c)[:n_outputs]
    bias = _biases(B, dirs, 4, hidden, X)
    peep = torch.zeros((dirs, 3 * hidden), dtype=X.dtype, device=X.device) if P is None else P
    funcs = _functions(names, 3, dirs)

    def cell(xw, states, d):
        h, c = states
        f, g, act = funcs[d]
        i_, o_, f_, c_ = (xw + h @ R[d].T).chunk(4, dim=1)  # ONNX's gate order: i, o, f, c
        p_i, p_o, p_f = peep[d].chunk(3)
        i = f(_clipped(i_ + p_i * c, clip))
        forget = 1 - i if input_forget else f(_clipped(f_ + p_f * c, clip))
        c_new = forget * c + i * g(_clipped(c_, clip))
        o = f(_clipped(o_ + p_o * c_new, clip))
        return [o * act(c_new), c_new]

    projected = _projected(X, W, bias[:, :4 * hidden] + bias[:, 4 * hidden:], layout)
    y, (y_h, y_c) = _run(cell, projected, [h0, c0], sequence_lens, direction, layout)
    return (y, y_h, y_c)[:n_outputs]


STEPPED_LSTM = (8, 32, 96)
"""The most steps and the widest hidden sizes at which a TorchScript trace on the CPU runs a
bidirectional LSTM by ``_lstm_steps`` (``_stepped_lstm``): at any thread count, and at one."""


def _stepped_lstm(X, hidden, layout, direction):
    """Whether an LSTM runs by ``_lstm_steps``: where TorchScript traces it on the CPU, both
    directions, 2 to 8 steps, hidden 32 or less, or 96 or less at one thread. oneDNN's LSTM costs
    tens of us a call and a direction (ideep makes its primitive descriptor and reorders the
    weights at every call) and about 1 us a step; the steps' ops in a frozen graph, both
    directions in each, about 10 us a step. A layer traced and frozen, input 16, hidden 24, 1
    thread, load 8.5, CPU us, oneDNN / steps: bidirectional 4 steps 279 / 159, 8 steps 353 / 308,
    13 steps 441 / 524; forward 8 steps 248 / 275; hidden 32, 8 steps 435 / 426. With the steps at
    seven ops (the fourteenth session, load 8.6-9.2, input 16, median CPU us, oneDNN / steps): 8
    steps, hidden 48 333 / 302, 64 382 / 328, 96 515 / 433, 128 585 / 568; 4 steps, hidden 128
    531 / 371; 10 steps, hidden 64 395 / 378; 13 steps, hidden 32 533 / 575, 64 534 / 678. Not
    wider at two threads: unmeasured there (a GRU's ``baddbmm`` of both directions opens a
    parallel region a product, ``_stepped_reset``)."""
    steps, widest, alone = STEPPED_LSTM
    return (torch.jit.is_tracing() and X.device.type == "cpu" and direction == "bidirectional"
            and 1 < X.shape[layout] <= steps
            and (hidden <= widest or hidden <= alone and torch.get_num_threads() == 1))


def _lstm_steps(X, W, R, B, h0, c0, direction, layout):
    """An LSTM (the default activations, no clip or peepholes, full sequences) in a few ops a
    step, every direction at once as a batch of products (``baddbmm``: no block of zeros to carry
    a NaN from one direction to the other), all steps' input projections and both biases in one
    product before the loop; ONNX's gate order (i, o, f, c) puts the three sigmoids first. Y
    (seq, dirs, batch, hidden), Y_h and Y_c (dirs, batch, hidden), or batch first with layout 1."""
    dirs, hidden = W.shape[0], W.shape[1] // 4
    h = h0.transpose(0, 1) if layout else h0  # (dirs, batch, hidden)
    c = c0.transpose(0, 1) if layout else c0
    bias = _biases(B, dirs, 4, hidden, X)
    # (seq, dirs, batch, 4 hidden): ONNX's gates i, o, f, c
    xw = _projected(X, W, bias[:, :4 * hidden] + bias[:, 4 * hidden:], layout).transpose(1, 2)
    xw = _backward_reversed(xw, direction)  # a backward direction reads the sequence from its end
    r_t = R.transpose(1, 2)  # (dirs, hidden, 4 hidden)
    # every step's gates in one buffer whose views are made once, not five slices a step (a view
    # costs about what an op does)
    gates = h.new_empty((dirs, h.shape[1], 4 * hidden))
    sigmoids, g = gates.split([3 * hidden, hidden], -1)
    i, o, f = sigmoids.chunk(3, -1)
    ys = []
    for x_t in xw.unbind(0):  # each step's input projection, the views made by one op
        torch.baddbmm(x_t, h, r_t, out=gates)  # (dirs, batch, 4 hidden)
        sigmoids.sigmoid_()
        c = torch.addcmul(f * c, i, g.tanh_())
        h = o * c.tanh()
        ys.append(h)
    y = torch.stack(ys)
    y = _backward_reversed(y, direction)
    if layout:
        return y.permute(2, 0, 1, 3), h.transpose(0, 1), c.transpose(0, 1)
    return y, h, c


def check_rnn(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("activation_alpha") or layer.attrs.get("activation_beta"):
        return "activation_alpha / activation_beta not supported"
    unknown = [a for a in layer.attrs.get("activations", []) if a not in ACTIVATIONS]
    if unknown:
        return f"activation(s) {unknown} not supported (known: {list(ACTIVATIONS)})"
    return weights_contradiction(layer, inputs)


KERNELS: KernelTable = {
    "RNN": {7: rnn},
    "GRU": {7: gru},
    "LSTM": {7: lstm},
}

CHECKS = {
    "RNN": check_rnn,
    "GRU": check_rnn,
    "LSTM": check_rnn,
}

INPUT_DTYPES = {op: FLOATS for op in KERNELS}
