"""torch's fused recurrent kernels, as ``recurrent.py`` calls them where they compute what ONNX
asks: the weights in torch's gate order, kept per weight tensor; one call of ``torch.lstm`` / ``gru``
/ ``rnn_tanh`` / ``rnn_relu`` for every step; the one-thread rule for a small recurrent product; a
small bidirectional layer's two directions as one direction of twice the width (``paired``).

Why the pairing: torch's own GRU / RNN loop on the CPU costs a dozen ATen calls a step (about 10
us a step at hidden 20), each direction its own; paired, one loop of block-diagonal weights does
both directions. (oneDNN's LSTM costs about 50 us a call at hidden 24, 1 us a step: a primitive
descriptor made and the weights reordered at every call, ideep's
``lstm_forward_inference::compute``; paired, it was no faster.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils.weak import WeakIdKeyDictionary

from backplane.backends.torch.kernels import recurrent_packed

ONE_THREAD_BELOW = 1 << 19
"""A fused kernel whose recurrent product is smaller than this (batch x gates * hidden x hidden
multiply-adds a step: hidden 256 at batch 1) runs on one thread: its steps' parallel regions are
too small to share, and each waits for every thread. On this project's 2-core machine (load 3-5), a
bidirectional LSTM of 80 steps, batch 1, hidden 32 (crnn_paddle_ts12's) took 0.21 ms on one thread,
0.28-0.36 ms on two and, in minutes when other processes held a core, 22-124 ms; at load 5, one
thread / two, wall ms: 100 steps hidden 128 1.9-4.3 / 8.5-147, 64 steps hidden 256 4.9-8.7 /
16-136, 160 steps hidden 96 1.3-3.9 / 10-125. A trace would not keep the count: such a layer is
not traced (``runs_alone``, ``fusion/traced.py``)."""
log = logging.getLogger("backplane.torch")
_PARAMS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise
"""W -> (R, B, the three's versions, torch's weight list): ``params_of``'s, dropped with W."""


def one_step(cell: Callable[..., Any], X: torch.Tensor, params: list[torch.Tensor],  # noqa: N803
             has_bias: bool, states: list[torch.Tensor],
             layout: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One time step of every direction by ``cell`` (forward and backward are the same step):
    Y and the final states, shaped as ``recurrent._native``'s."""
    x = X.select(layout, 0)  # (batch, input)
    per = 4 if has_bias else 2
    finals: list[list[torch.Tensor]] = [[] for _ in states]
    packed = traced_lstm_weights(params, per) if len(states) == 2 else None
    if packed is None and torch.jit.is_tracing():
        states = [s if _from_inputs(s) else _unfolded(s) for s in states]
    for d in range(len(params) // per):
        weights = params[d * per:(d + 1) * per] + ([None, None] if not has_bias else [])
        carried = [s.select(layout, d) for s in states]  # (batch, hidden)
        if packed is not None:  # an LSTM traced with constant weights
            out = lstm_step(x, carried[0], carried[1], *packed[d])
        else:
            out = cell(x, tuple(carried) if len(carried) > 1 else carried[0], *weights)
        for kept, value in zip(finals, out if isinstance(out, tuple) else (out,)):
            kept.append(value)
    # (dirs, batch, hidden), or batch first
    final = [f[0].unsqueeze(layout) if len(f) == 1 else torch.stack(f, dim=layout) for f in finals]
    # Y (1, dirs, batch, hidden), or (batch, 1, dirs, hidden): a copy, not a view of Y_h (each
    # output is the caller's alone)
    return final[0].unsqueeze(layout).clone(), final


def _unfolded(state: torch.Tensor) -> torch.Tensor:
    """``state``'s values in a tensor a frozen trace makes at each call, never one of its
    constants. Why: where torch's cell takes a state that the freeze folds (a GRU's initial state
    absent or constant in the model), TorchScript's optimized graph computes the state's product
    once, as constants, and then updates them in place (the decomposed ``gru_cell``'s ``add_``,
    ``sigmoid_``, ``mul_``): from the second call on the cell starts from other values (torch
    2.13), the trace's check finds it computing otherwise, and the partition ran layer by layer.
    Two ops (an allocation is never folded)."""
    return state.new_empty(state.shape).copy_(state)


def _from_inputs(value: torch.Tensor) -> bool:
    """Whether the trace computes ``value`` from one of its inputs (else its freeze folds it: a
    state made in the trace, or a constant). Where the tracer cannot tell, False."""
    try:
        todo = [torch._C._get_value_trace(value)]
    except (AttributeError, RuntimeError):
        return False
    seen = set()
    while todo:
        traced = todo.pop()
        node = traced.node()
        if node.kind() == "prim::Param":
            return True
        if traced.unique() not in seen:
            seen.add(traced.unique())
            todo.extend(node.inputs())
    return False


_STEP_WEIGHTS = WeakIdKeyDictionary()
"""torch's first LSTM weight -> (its weight list, ``traced_lstm_weights``'s), dropped with it."""
IFOG = [0, 1, 3, 2]
"""torch's LSTM gates (i, f, g, o) in the order ``lstm_step`` takes them: the sigmoids first."""


def traced_lstm_weights(params: list[torch.Tensor],
                        per: int) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """Per direction, an LSTM's weights (torch's list, ``per`` tensors a direction) as
    ``lstm_step`` takes them: the input and recurrent weights transposed, one above the other,
    gates i, f, o, g, and the two biases summed. Only where TorchScript traces and they are
    constants of the trace (else None: torch's ``lstm_cell`` runs): made once, outside the trace,
    where a frozen trace of ``lstm_cell`` transposed both weights and added both biases at every
    run."""
    if not trace_constants(params):
        return None
    kept = _STEP_WEIGHTS.get(params[0])
    if kept is not None and kept[0] is params:
        return kept[1]
    packed = []
    with untraced(True):
        for d in range(len(params) // per):
            w_ih, w_hh, *biases = params[d * per:(d + 1) * per]
            stacked = torch.cat([_reordered(w_ih, IFOG).t(), _reordered(w_hh, IFOG).t()])
            bias = _reordered(biases[0] + biases[1], IFOG) if biases else None
            packed.append((stacked.contiguous(), bias))
    _STEP_WEIGHTS[params[0]] = (params, packed)
    return packed


def lstm_step(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step as ``torch.lstm_cell`` computes it, on ``traced_lstm_weights``'s: one product
    of ``[x, h]``, one sigmoid over the three gates, ``f * c + i * g`` by one addcmul. (A trace of
    it, VAD sizes (batch 1, input and hidden 128), 1 thread: 25.3 us a step, two products 27.6,
    ``lstm_cell`` 29.7; this project's 2-core AMD EPYC, load 3.7.) The gates are split once and
    their activations computed in place, in the product's own buffer (the five ``narrow`` and two
    new tensors of before: frozen, 1 thread, load 6.8, three runs of 20 blocks, p10 CPU us a step
    86.7 / 60.9 / 59.9 -> 70.6 / 53.3 / 52.8, the same values bit for bit)."""
    hidden = h.shape[1]
    both = torch.cat([x, h], 1)
    gates = torch.mm(both, weight) if bias is None else torch.addmm(bias, both, weight)
    ifo, g = gates.split([3 * hidden, hidden], 1)  # (batch, 3 hidden): i, f, o; (batch, hidden)
    i, f, o = ifo.sigmoid_().chunk(3, 1)
    c_next = torch.addcmul(f * c, i, g.tanh_())
    return o * c_next.tanh(), c_next


def runs_alone(batch: int, gate_rows: int, hidden: int) -> bool:
    """Whether a fused kernel of this batch and recurrent weight (gates * hidden, hidden) runs on
    one thread (``ONE_THREAD_BELOW``)."""
    return batch * gate_rows * hidden < ONE_THREAD_BELOW


def on_one_thread_if(alone: bool, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, on one thread where ``alone`` (this thread's count: OpenMP's are per
    thread), the count put back after."""
    threads = torch.get_num_threads()
    if not alone or threads == 1:
        return function(*args)
    torch.set_num_threads(1)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(threads)


def fused(function: Callable[..., Any], x: torch.Tensor, hx: list[torch.Tensor],
          pair: list[torch.Tensor] | None, params: list[torch.Tensor], has_bias: bool,
          bidirectional: bool, batch_first: bool, alone: bool) -> Sequence[torch.Tensor]:
    """torch's fused kernel ``function`` (``torch.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``) over
    every step of ``x``: ``paired`` where ``pair`` (``pair_of``) is given, on one thread where
    ``alone`` (``runs_alone``; a trace keeps the call, not the count). torch's outputs (Y, the
    final states)."""
    return on_one_thread_if(alone, _call, function, x, hx, pair, params, has_bias, bidirectional,
                            batch_first)


def _call(function, x, hx, pair, params, has_bias, bidirectional, batch_first):
    if pair:
        return paired(function.__name__, x, hx, pair, params, has_bias, batch_first)
    # an LSTM on weights reordered for oneDNN once (not in a trace: it would keep neither the
    # grad mode nor, as constants, oneDNN's tensors)
    if not tracing() and recurrent_packed.packable(function.__name__, x, params):
        return recurrent_packed.lstm(x, hx, params, has_bias, bidirectional, batch_first)
    return function(x, hx if len(hx) > 1 else hx[0], params, has_bias, 1, 0.0, False,
                    bidirectional, batch_first)


def params_of(W: torch.Tensor, R: torch.Tensor, B: torch.Tensor | None,  # noqa: N803
              order: list[int], mode: int | None = None, layout: int = 0) -> list[torch.Tensor]:
    """torch's flat weight list (per direction w_ih, w_hh[, b_ih, b_hh]), kept with W for the next
    call while W, R and B are the same tensors, unchanged (their version counters): reordering the
    gates costs more than the kernel itself on a short sequence. On the GPU a kept list is made
    views of one buffer (``_in_one_buffer``)."""
    tensors = [t for t in (W, R, B) if t is not None]
    # an inference tensor has no version; a trace must compute the weights from W where W is an
    # input of the trace (a kept list would become a constant of it), not where W is a constant
    constant = trace_constants(tensors)
    cacheable = (constant or not tracing()) and not any(t.is_inference() for t in tensors)
    versions = [t._version for t in tensors] if cacheable else None
    kept = _PARAMS.get(W) if cacheable else None
    if kept is not None and kept[0] is R and kept[1] is B and kept[2] == versions:
        return kept[3]
    with untraced(constant):
        params = []
        for d in range(W.shape[0]):
            params += [_reordered(W[d], order), _reordered(R[d], order)]
            if B is not None:  # ONNX's [Wb, Rb] are torch's b_ih, b_hh
                params += [_reordered(b, order) for b in B[d].chunk(2)]
    if cacheable:
        if W.is_cuda and mode is not None:
            _in_one_buffer(params, W, R, mode, layout)  # may count as a write to W's views
            versions = [t._version for t in tensors]
        _PARAMS[W] = (R, B, versions, params)
    return params


CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
"""cuDNN's RNN modes (torch.backends.cudnn.rnn.get_cudnn_mode) by torch's function name."""


def _in_one_buffer(params, W, R, mode, layout):
    """``params`` made views of one buffer, as ``nn.RNN.flatten_parameters`` does: cuDNN otherwise
    copies them into one at every call (and warns "RNN module weights are not part of single
    contiguous chunk of memory" each time). Where torch can't, they stay as they are."""
    if not torch._use_cudnn_rnn_flatten_weight():
        return
    try:
        with torch.no_grad():
            torch._cudnn_rnn_flatten_weight(params, len(params) // W.shape[0], W.shape[-1], mode,
                                            R.shape[-1], 0, 1, bool(layout), W.shape[0] == 2)
    except RuntimeError as exc:
        log.debug("recurrent weights not flattened for cuDNN (%s)", exc)


def tracing() -> bool:
    """Whether torch is tracing this call (TorchScript's trace, make_fx, torch.compile)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or get_proxy_mode() is not None


def trace_constants(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether TorchScript is tracing and each of ``tensors`` is a constant of the trace (a
    partition's weights, not an input of the graph being traced). What is computed from them alone
    may then be computed once, outside the trace: a frozen graph does not fold the gate reorder
    (an index and a flatten a weight: 16 calls a run for a bidirectional LSTM; the VAD's traced
    partition 0.207-0.215 -> 0.163-0.166 ms, 1 thread, this project's 2-core AMD EPYC)."""
    if not torch.jit.is_tracing():
        return False
    try:  # the tracer's value of an untracked tensor is a new constant node (dead: freeze drops it)
        return all(torch._C._get_value_trace(t).node().kind() == "prim::Constant"
                   for t in tensors)
    except (AttributeError, RuntimeError):  # a torch without the hook: computed in the trace
        return False


@contextlib.contextmanager
def untraced(pause: bool) -> Iterator[None]:
    """The tracer paused for the block where ``pause``: what it computes is a trace's constant."""
    state = torch._C._get_tracing_state() if pause else None
    if state is not None:
        torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        if state is not None:
            torch._C._set_tracing_state(state)


def _reordered(weights, order):
    """Gate-major ``weights`` (gates * hidden, ...) with their gates in ``order``."""
    if len(order) == 1:
        return weights
    return weights.unflatten(0, (len(order), -1))[order].flatten(0, 1)



# -- a bidirectional layer as one direction of twice the width ---------------------------------------
PAIRED_HIDDEN = {"gru": 64, "rnn_tanh": 64, "rnn_relu": 64}
"""The widest hidden size at which a bidirectional layer runs paired (``paired``), per fused kernel.
The pair's products are twice the work (block-diagonal weights), so it pays where the fixed cost per
call or per step is most of the layer's: torch's GRU and RNN loops (ATen calls a step). Measured,
CPU us a layer, 1 thread, this project's 2-core AMD EPYC at load 6-9, two directions / paired
(sequence, input, hidden): GRU 8,16,24 158 / 102; 32,32,32 694 / 398; 32,64,64 916 / 683;
80,64,48 1759 / 1153; 8,96,96 303 / 325; traced and frozen 8,12,20 166-187 / 113-118. Not oneDNN's
LSTM: its cost per call grows with the weights it reorders, and paired it was no faster (8,16,24
107 / 80 alone, 119 / 108 traced, but a whole model run layer by layer, 2 threads, load 5: the small
tier's lstm_bi2_dyn18 0.44-0.50 -> 0.55-0.64 ms, lstm_bi2_ts14 even)."""
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}  # (gates a step)
_PAIRS = WeakIdKeyDictionary()
"""W -> (torch's weight list, its pair): ``pair_of``'s, dropped with W."""


def pair_of(name: str, W: torch.Tensor, params: list[torch.Tensor],  # noqa: N803
            has_bias: bool) -> list[torch.Tensor] | None:
    """A bidirectional layer's weights (``params``: per direction w_ih, w_hh[, b_ih, b_hh], torch's
    gate order) as one direction's of twice the hidden size: each gate's rows of both directions
    one after the other, the weights block-diagonal. None where the layer is wider than
    ``PAIRED_HIDDEN`` or torch traces for make_fx or torch.compile (which take no TorchScript
    function). Kept with ONNX's ``W`` while ``params`` is the same list (``params_of``'s); a
    TorchScript trace computes them from its weights (its freeze folds that)."""
    hidden = params[1].shape[1]
    if hidden > PAIRED_HIDDEN.get(name, 0) or torch.compiler.is_compiling() or \
            get_proxy_mode() is not None:
        return None
    kept = _PAIRS.get(W)
    if kept is not None and kept[0] is params:
        return kept[1]
    per, gates = len(params) // 2, GATES[name]
    first, second = params[:per], params[per:]
    pair = [_diagonal(a, b, gates) for a, b in zip(first[:2], second[:2])]
    pair += [torch.cat([a.unflatten(0, (gates, -1)), b.unflatten(0, (gates, -1))], 1).flatten()
             for a, b in zip(first[2:], second[2:])]
    if not torch.jit.is_tracing():
        _PAIRS[W] = (params, pair)
    return pair


def _diagonal(a: torch.Tensor, b: torch.Tensor, gates: int) -> torch.Tensor:
    """(gates * hidden, m) and (gates * hidden, n) as (gates * 2 hidden, m + n): per gate, a's rows
    over the first m columns, then b's over the last n, zeros elsewhere."""
    top = F.pad(a.unflatten(0, (gates, -1)), (0, b.shape[1]))
    bottom = F.pad(b.unflatten(0, (gates, -1)), (a.shape[1], 0))
    return torch.cat([top, bottom], 1).flatten(0, 1)


def paired(name: str, x: torch.Tensor, hx: list[torch.Tensor], pair: list[torch.Tensor],
           params: list[torch.Tensor], has_bias: bool, batch_first: bool) -> list[torch.Tensor]:
    """A bidirectional layer by one call of torch's fused kernel ``name`` on ``pair``
    (``pair_of``): its input the sequence beside itself reversed in time, its states both
    directions' side by side; torch's outputs as a bidirectional call's (Y with both directions'
    hidden side by side, the final states (2, batch, hidden)).

    A zero of the block times NaN or inf is NaN: where one direction meets a value not finite (in
    the input, a state or a weight), the other's steps from there on would be NaN too, and so
    would its final hidden state (NaN stays in a recurrence). Where that final state holds a NaN,
    the layer runs again as two directions on ``params``, so that NaN stays in its direction. A
    TorchScript function in a trace, so that the trace keeps that check (``_scripted``), and under
    a torch function mode (``fusion/traced.py``'s ``HostReads``, run before a trace, would take
    the check for a value of the inputs read on the host); the same source as Python elsewhere
    (``_python``: a TorchScript call from Python costs more than the pairing saves)."""
    scripted = torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled()
    function = _scripted() if scripted else _python()
    return function(name, x, hx, pair, params, has_bias, batch_first)


@functools.cache
def _scripted():
    """``_PAIRED`` compiled in a compilation unit of its own (as ``fusion/linear.py``'s product)."""
    return torch.jit.CompilationUnit(_PAIRED).paired


@functools.cache
def _python():
    """``_PAIRED`` as Python functions (this module's constant, not a file's text)."""
    namespace = {"torch": torch, "Tensor": torch.Tensor, "List": list}
    exec(compile(_PAIRED, "<recurrent_fused._PAIRED>", "exec"), namespace)  # noqa: S102
    return namespace["paired"]


_PAIRED = """
def fused(name: str, x: Tensor, hx: List[Tensor], params: List[Tensor], has_bias: bool,
          bidirectional: bool, batch_first: bool) -> List[Tensor]:
    if name == "lstm":
        y, h, c = torch.lstm(x, hx, params, has_bias, 1, 0.0, False, bidirectional, batch_first)
        return [y, h, c]
    if name == "gru":
        y, h = torch.gru(x, hx[0], params, has_bias, 1, 0.0, False, bidirectional, batch_first)
    elif name == "rnn_tanh":
        y, h = torch.rnn_tanh(x, hx[0], params, has_bias, 1, 0.0, False, bidirectional,
                              batch_first)
    else:
        y, h = torch.rnn_relu(x, hx[0], params, has_bias, 1, 0.0, False, bidirectional,
                              batch_first)
    return [y, h]

def paired(name: str, x: Tensor, hx: List[Tensor], pair: List[Tensor], params: List[Tensor],
           has_bias: bool, batch_first: bool) -> List[Tensor]:
    time = 1 if batch_first else 0
    batch = hx[0].size(1)
    wide = [state.transpose(0, 1).reshape(1, batch, -1) for state in hx]
    out = fused(name, torch.cat([x, x.flip(time)], 2), wide, pair, has_bias, False, batch_first)
    if bool(torch.isnan(out[1]).any()):
        return fused(name, x, hx, params, has_bias, True, batch_first)
    hidden = out[1].size(-1) // 2
    y = out[0]
    result = [torch.cat([y.narrow(2, 0, hidden), y.narrow(2, hidden, hidden).flip(time)], 2)]
    for final in out[1:]:
        result.append(final.view(batch, 2, hidden).transpose(0, 1))
    return result
"""
