"""Network torch kernels beyond nn.py: RNN, GRU and LSTM; ConvTranspose and Col2Im; the
normalizations (Instance, Group, RMS, Lp, MeanVariance, LRN); LpPool, GlobalLpPool and MaxUnpool;
AffineGrid, GridSample and RoiAlign.

The recurrent layers run as one call of torch's fused kernel (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh`` / ``rnn_relu``, what nn.LSTM / GRU / RNN call; oneDNN's LSTM on the CPU) where
ONNX's attributes are what it computes: the default activations (RNN's Tanh or Relu), no clip, full
sequences, LSTM without peepholes (or all zero) and input_forget, GRU with linear_before_reset=1.
Elsewhere they step through time as CpuRef does (every ONNX option: directions, the activations
torch has, clip, sequence_lens, initial states, peepholes, layouts), every step's input projection
in one matrix product before the loop, the recurrent one per step. Statistics of float16 inputs are
computed in float32 (``stash_type``), as CpuRef and ONNX Runtime do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils.weak import WeakIdKeyDictionary

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import AUTO_PADS, spatial_pads
from backplane.backends.reference.kernels.rnn import weights_contradiction
from backplane.backends.torch.kernels.common import FLOATS, NUMBERS, ints
from backplane.ir.graph import Layer, TensorInfo

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
"""W -> (R, B, the three's versions, torch's weight list): ``_params``'s, dropped with W."""

Cell = Callable[[torch.Tensor, list[torch.Tensor], int], list[torch.Tensor]]


def _native(function, order, X, W, R, B, states, direction, layout):
    """All steps and directions in one call of torch's fused kernel (``torch.lstm``, ``torch.gru``,
    ``torch.rnn_tanh``, ``torch.rnn_relu``, what nn.LSTM / GRU / RNN call): Y and the final states,
    shaped as ONNX's."""
    hidden, bidirectional = R.shape[-1], direction == "bidirectional"
    params = _params(W, R, B, order, CUDNN_MODES.get(function.__name__), layout)
    if X.shape[layout] == 1:
        return _one_step(STEP_CELLS[function.__name__], X, params, B is not None, states, layout)
    # (W's directions: torch refuses a count other than 1 or 2)
    # torch runs backward only as a bidirectional's second half: reverse alone runs forward on
    # the flipped sequence (time is axis `layout`), and its Y is flipped back
    reverse = direction == "reverse"
    x = X.flip(layout) if reverse else X
    # torch's states are (dirs, batch, hidden) in both layouts
    hx = [(s.transpose(0, 1) if layout else s).contiguous() for s in states]
    small = runs_alone(X.shape[1 - layout], R.shape[1], R.shape[2])
    out, *final = _on_one_thread_if(small and X.device.type == "cpu", function, x,
                                    hx if len(hx) > 1 else hx[0], params, B is not None, 1, 0.0,
                                    False, bidirectional, bool(layout))
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


def _one_step(cell, X, params, has_bias, states, layout):
    """One time step of every direction by ``cell`` (forward and backward are the same step):
    Y and the final states, shaped as ``_native``'s."""
    x = X.select(layout, 0)  # (batch, input)
    per = 4 if has_bias else 2
    finals: list[list[torch.Tensor]] = [[] for _ in states]
    for d in range(len(params) // per):
        weights = params[d * per:(d + 1) * per] + ([None, None] if not has_bias else [])
        carried = [s.select(layout, d) for s in states]  # (batch, hidden)
        out = cell(x, tuple(carried) if len(carried) > 1 else carried[0], *weights)
        for kept, value in zip(finals, out if isinstance(out, tuple) else (out,)):
            kept.append(value)
    # (dirs, batch, hidden), or batch first
    final = [f[0].unsqueeze(layout) if len(f) == 1 else torch.stack(f, dim=layout) for f in finals]
    # Y (1, dirs, batch, hidden), or (batch, 1, dirs, hidden): a copy, not a view of Y_h (each
    # output is the caller's alone)
    return final[0].unsqueeze(layout).clone(), final


def runs_alone(batch: int, gate_rows: int, hidden: int) -> bool:
    """Whether a fused kernel of this batch and recurrent weight (gates * hidden, hidden) runs on
    one thread (``ONE_THREAD_BELOW``)."""
    return batch * gate_rows * hidden < ONE_THREAD_BELOW


def _on_one_thread_if(alone, function, *args):
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


def _params(W, R, B, order, mode=None, layout=0):
    """torch's flat weight list (per direction w_ih, w_hh[, b_ih, b_hh]), kept with W for the next
    call while W, R and B are the same tensors, unchanged (their version counters): reordering the
    gates costs more than the kernel itself on a short sequence. On the GPU a kept list is made
    views of one buffer (``_in_one_buffer``)."""
    tensors = [t for t in (W, R, B) if t is not None]
    # an inference tensor has no version; a trace must compute the weights from W (a kept list
    # would become a constant of the trace where W may be an input)
    cacheable = not _tracing() and not any(t.is_inference() for t in tensors)
    versions = [t._version for t in tensors] if cacheable else None
    kept = _PARAMS.get(W) if cacheable else None
    if kept is not None and kept[0] is R and kept[1] is B and kept[2] == versions:
        return kept[3]
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


def _tracing() -> bool:
    """Whether torch is tracing this call (TorchScript's trace, make_fx, torch.compile)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or get_proxy_mode() is not None


def _reordered(weights, order):
    """Gate-major ``weights`` (gates * hidden, ...) with their gates in ``order``."""
    if len(order) == 1:
        return weights
    return weights.unflatten(0, (len(order), -1))[order].flatten(0, 1)


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
    return (x @ W.flatten(0, 1).T + bias.flatten()).unflatten(-1, (W.shape[0], -1))


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
    h0 = _initial(initial_h, X, dirs, hidden, layout)
    # torch's GRU applies the reset gate after the recurrent product: linear_before_reset=1 only
    if linear_before_reset and _natively(X, sequence_lens, clip, layout, names,
                                         ["Sigmoid", "Tanh"] * dirs):
        y, (y_h,) = _native(torch.gru, GRU_ORDER, X, W, R, B, [h0], direction, layout)
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


def lstm(X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None,
         activation_alpha=None, activation_beta=None, activations=None, clip=None,
         direction="forward", hidden_size=None, input_forget=0, layout=0, *, n_outputs=3):
    dirs, hidden = W.shape[0], W.shape[1] // 4
    names = list(activations or ["Sigmoid", "Tanh", "Tanh"] * dirs)
    h0 = _initial(initial_h, X, dirs, hidden, layout)
    c0 = _initial(initial_c, X, dirs, hidden, layout)
    # peepholes of zeros change nothing (read on the CPU only, as sequence_lens)
    no_peepholes = P is None or (P.device.type == "cpu" and not P.any())
    if no_peepholes and not input_forget and _natively(X, sequence_lens, clip, layout, names,
                                                       ["Sigmoid", "Tanh", "Tanh"] * dirs):
        y, (y_h, y_c) = _native(torch.lstm, LSTM_ORDER, X, W, R, B, [h0, c0], direction, layout)
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


def check_rnn(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("activation_alpha") or layer.attrs.get("activation_beta"):
        return "activation_alpha / activation_beta not supported"
    unknown = [a for a in layer.attrs.get("activations", []) if a not in ACTIVATIONS]
    if unknown:
        return f"activation(s) {unknown} not supported (known: {list(ACTIVATIONS)})"
    return weights_contradiction(layer, inputs)


# -- ConvTranspose, Col2Im -------------------------------------------------------------------------
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_transpose(X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    # torch pads both ends alike and caps output_padding: the whole result, then cut here
    full = _CONV_TRANSPOSE[rank](X, W, None, strides, 0, 0, group, dilations)
    begins, sizes = _transpose_crop(full.shape[2:], X.shape[2:], strides, auto_pad, output_padding,
                                    output_shape, pads)
    widths = [w for b, s, f in zip(reversed(begins), reversed(sizes), reversed(full.shape[2:]))
              for w in (-b, b + s - f)]
    y = F.pad(full, widths)  # negative widths crop, positive ones add zeros
    return (y if B is None else y + B.reshape(-1, *[1] * rank),)


def _transpose_crop(full, ins, strides, auto_pad, output_padding, output_shape, pads):
    """Where the output starts in the unpadded result, and its size, per spatial axis."""
    rank = len(full)
    extra = list(output_padding or [0] * rank)
    if pads is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        sizes = list(output_shape[-rank:]) if output_shape else [i * s for i, s in zip(ins, strides)]
        totals = [f + e - o for f, e, o in zip(full, extra, sizes)]
        return [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals], sizes
    pads = list(pads or [0] * 2 * rank)
    if output_shape:
        return pads[:rank], list(output_shape[-rank:])
    return pads[:rank], [f + e - b - a for f, e, b, a in zip(full, extra, pads[:rank], pads[rank:])]


def check_conv_transpose(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if inputs and inputs[0].shape is not None and not 3 <= len(inputs[0].shape) <= 5:
        return f"ConvTranspose of rank {len(inputs[0].shape)} (torch has 1 to 3 spatial axes)"
    return None


def col2im(input, image_shape, block_shape, dilations=None, pads=None, strides=None):  # noqa: A002
    image, kernel = ints(image_shape), ints(block_shape)
    rank = len(image)
    dilations, strides = dilations or [1] * rank, strides or [1] * rank
    pads = pads or [0] * 2 * rank
    padded = [n + pads[i] + pads[i + rank] for i, n in enumerate(image)]
    blocks = [(p - d * (k - 1) - 1) // s + 1 for p, k, d, s in zip(padded, kernel, dilations, strides)]
    n, channels = input.shape[0], input.shape[1] // max(math.prod(kernel), 1)
    columns = input.reshape(n, channels, *kernel, *blocks)
    output = torch.zeros((n, channels, *padded), dtype=input.dtype, device=input.device)
    # every block's value at one kernel offset at a time, in CpuRef's order (the same sums)
    for offset in _offsets(kernel):
        window = tuple(slice(o * d, o * d + (b - 1) * s + 1, s)
                       for o, d, b, s in zip(offset, dilations, blocks, strides))
        output[(slice(None), slice(None), *window)] += columns[(slice(None), slice(None), *offset)]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(rank))
    return (output[(slice(None), slice(None), *crop)],)


def _offsets(kernel):
    """Every offset of a kernel, row-major."""
    if not kernel:
        return [()]
    return [(o, *rest) for o in range(kernel[0]) for rest in _offsets(kernel[1:])]


# -- normalizations --------------------------------------------------------------------------------
def _stash(x):
    """x in float32 at least: statistics of float16 are taken in float32."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _per_channel(values, rank):
    return values.reshape(-1, *[1] * (rank - 2))


def instance_normalization(input, scale, B, epsilon=1e-5):  # noqa: A002
    x = _stash(input)
    var, mean = torch.var_mean(x, dim=tuple(range(2, x.dim())), correction=0, keepdim=True)
    y = (x - mean) / torch.sqrt(var + epsilon)
    return ((y * _per_channel(scale, x.dim()) + _per_channel(B, x.dim())).to(input.dtype),)


def group_normalization(X, scale, bias, epsilon=1e-5, num_groups=1, stash_type=1):
    grouped = _stash(X).reshape(X.shape[0], num_groups, -1)
    var, mean = torch.var_mean(grouped, dim=-1, correction=0, keepdim=True)
    y = ((grouped - mean) / torch.sqrt(var + epsilon)).reshape(X.shape)
    return ((y * _per_channel(scale, X.dim()) + _per_channel(bias, X.dim())).to(X.dtype),)


def group_normalization_v18(X, scale, bias, epsilon=1e-5, num_groups=1):
    # opset 18: one scale and bias per group, repeated over the group's channels
    repeat = X.shape[1] // num_groups
    return group_normalization(X, scale.repeat_interleave(repeat), bias.repeat_interleave(repeat),
                               epsilon, num_groups)


def rms_normalization(X, scale, axis=-1, epsilon=1e-5, stash_type=1):
    x = _stash(X)
    axes = tuple(range(axis % X.dim(), X.dim()))
    rms = torch.sqrt((x * x).mean(dim=axes, keepdim=True) + epsilon)
    return ((x / rms * scale).to(X.dtype),)


def lrn(X, size, alpha=0.0001, beta=0.75, bias=1.0):
    # the sum of squares over channels [c - floor((size-1)/2), c + ceil((size-1)/2)]; torch's
    # local_response_norm centres an even window the other way
    squares = (X * X).movedim(1, -1)
    padded = F.pad(squares, ((size - 1) // 2, size // 2))
    square_sum = padded.unfold(-1, size, 1).sum(dim=-1).movedim(-1, 1)
    return (X / (bias + alpha / size * square_sum) ** beta,)


def lp_normalization(input, axis=-1, p=2):  # noqa: A002
    norm = (input.abs() ** p).sum(dim=axis, keepdim=True) ** (1 / p)
    return (torch.where(norm == 0, 0, input / norm).to(input.dtype),)


def mean_variance_normalization(X, axes=(0, 2, 3)):
    axes = tuple(axes)
    mean = X.mean(dim=axes, keepdim=True)
    std = torch.sqrt((X * X).mean(dim=axes, keepdim=True) - mean * mean)
    return ((X - mean) / (std + 1e-9),)


def check_lrn(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if inputs and inputs[0].shape is not None and len(inputs[0].shape) < 2:
        return f"LRN of rank {len(inputs[0].shape)} (no channel axis)"
    return None


# -- pools -----------------------------------------------------------------------------------------
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def lp_pool(X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None,
            strides=None):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(X.shape[2:], kernel_shape, strides, dilations, auto_pad, pads)
    ends = [e + x for e, x in zip(ends, _ceil_extras(X.shape[2:], kernel_shape, strides, dilations,
                                                     begins, ends, ceil_mode))]
    widths = [w for b, e in zip(reversed(begins), reversed(ends)) for w in (b, e)]
    powers = F.pad(X.abs() ** p, widths).reshape(-1, 1, *[n + b + e for n, b, e
                                                         in zip(X.shape[2:], begins, ends)])
    # the sum over each window: a convolution with ones, one plane at a time
    ones = torch.ones((1, 1, *kernel_shape), dtype=X.dtype, device=X.device)
    sums = _CONV[rank](powers, ones, None, strides, 0, dilations)
    return ((sums ** (1 / p)).reshape(*X.shape[:2], *sums.shape[2:]),)


def _ceil_extras(spatial, kernel, strides, dilations, begins, ends, ceil_mode):
    """The end padding ceil_mode adds so that its last window exists (it must start inside the
    input or its begin padding)."""
    extras = []
    for size, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begins, ends):
        extent = (k - 1) * d + 1
        count = (size + b + e - extent) / s + 1
        out = -int(-count // 1) if ceil_mode else int(count // 1)
        if ceil_mode and (out - 1) * s >= size + b:
            out -= 1
        extras.append(max(0, (out - 1) * s + extent - (size + b + e)))
    return extras


def global_lp_pool(X, p=2):
    sums = (X.abs() ** p).sum(dim=tuple(range(2, X.dim())), keepdim=True)
    return (sums ** (1 / p),)


def max_unpool(X, I, output_shape=None, kernel_shape=None, pads=None, strides=None):  # noqa: N803
    # I holds MaxPool's flat indices into the unpooled tensor of the default shape; a larger
    # output_shape adds zeros after the end of each axis
    rank = X.dim() - 2
    strides, pads = list(strides or [1] * rank), list(pads or [0] * 2 * rank)
    spatial = [(size - 1) * s + k - b - e for size, s, k, b, e
               in zip(X.shape[2:], strides, kernel_shape, pads[:rank], pads[rank:])]
    unpooled = torch.zeros((*X.shape[:2], *spatial), dtype=X.dtype, device=X.device)
    unpooled.reshape(-1)[I.reshape(-1).long()] = X.reshape(-1)
    if output_shape is None:
        return (unpooled,)
    target = ints(output_shape)
    widths = [w for n, t in zip(reversed(unpooled.shape), reversed(target)) for w in (0, t - n)]
    return (F.pad(unpooled, widths),)


def check_lp_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if "kernel_shape" not in layer.attrs:
        return "kernel_shape attribute missing"
    if not 1 <= len(layer.attrs["kernel_shape"]) <= 3:
        return f"LpPool over {len(layer.attrs['kernel_shape'])} axes (torch convolves 1 to 3)"
    return None


# -- sampling --------------------------------------------------------------------------------------
_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest",
               "cubic": "bicubic", "bicubic": "bicubic"}
"""ONNX's GridSample modes (opset 16's names and opset 20's) as torch names them."""


def _wide(*tensors):
    """The float type to compute in: the widest of the inputs', float32 at least."""
    wide = torch.float32
    for t in tensors:
        wide = torch.promote_types(wide, t.dtype)
    return wide


def affine_grid(theta, size, align_corners=0):
    # theta (N, r, r+1) maps the homogeneous base grid (x, y[, z], 1) of the output to the input;
    # torch's affine_grid puts a size-1 axis at 0 where ONNX's linspace puts it at -1
    spatial = ints(size)[2:]
    wide = _wide(theta)
    axes = [torch.linspace(-1, 1, n, dtype=wide, device=theta.device) if align_corners else
            (2 * torch.arange(n, dtype=wide, device=theta.device) + 1) / n - 1 for n in spatial]
    mesh = torch.meshgrid(*axes, indexing="ij") if axes else []
    ones = torch.ones(spatial, dtype=wide, device=theta.device)
    base = torch.stack([*mesh[::-1], ones], dim=-1).reshape(-1, len(spatial) + 1)
    grid = base @ theta.to(wide).transpose(1, 2)  # (N, points, r)
    return (grid.reshape(theta.shape[0], *spatial, len(spatial)).to(theta.dtype),)


def grid_sample(X, grid, align_corners=0, mode="linear", padding_mode="zeros"):
    wide = _wide(X, grid)
    y = F.grid_sample(X.to(wide), grid.to(wide), _GRID_MODES[mode], padding_mode,
                      bool(align_corners))
    return (y.to(X.dtype),)


def check_grid_sample(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "linear")
    padding = layer.attrs.get("padding_mode", "zeros")
    if mode not in _GRID_MODES:
        return f"GridSample mode {mode!r} not known (known: {list(_GRID_MODES)})"
    if padding not in ("zeros", "border", "reflection"):
        return f"GridSample padding_mode {padding!r} not known (known: zeros, border, reflection)"
    rank = len(inputs[0].shape) if inputs and inputs[0].shape is not None else None
    if rank is not None and rank not in (4, 5):
        return f"GridSample of rank {rank} (torch samples 2 or 3 spatial axes)"
    if rank == 5 and _GRID_MODES[mode] == "bicubic":
        return "GridSample cubic over 3 spatial axes (torch's is 2-D only)"
    if _GRID_MODES[mode] == "bicubic" and padding != "zeros":
        # ONNX folds a coordinate outside the image into it before taking the 4 x 4 taps; torch
        # folds each tap instead
        return f"GridSample cubic with padding_mode {padding!r} (torch folds taps, not points)"
    return None


def check_affine_grid(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    size = inputs[1].shape if len(inputs) > 1 else None
    if size is not None and size != (4,) and size != (5,):
        return f"AffineGrid of size {size} (torch makes 2-D and 3-D grids)"
    return None


KERNELS: KernelTable = {
    "AffineGrid": {20: affine_grid},
    "GridSample": {16: grid_sample},
    "RNN": {7: rnn},
    "GRU": {7: gru},
    "LSTM": {7: lstm},
    "ConvTranspose": {1: conv_transpose},
    "Col2Im": {18: col2im},
    "InstanceNormalization": {6: instance_normalization},
    "GroupNormalization": {18: group_normalization_v18, 21: group_normalization},
    "RMSNormalization": {23: rms_normalization},
    "LRN": {1: lrn},
    "LpNormalization": {1: lp_normalization},
    "MeanVarianceNormalization": {9: mean_variance_normalization},
    "LpPool": {2: lp_pool},
    "GlobalLpPool": {2: global_lp_pool},
    "MaxUnpool": {9: max_unpool},
}

CHECKS = {
    "RNN": check_rnn,
    "GRU": check_rnn,
    "LSTM": check_rnn,
    "ConvTranspose": check_conv_transpose,
    "LRN": check_lrn,
    "LpPool": check_lp_pool,
    "GridSample": check_grid_sample,
    "AffineGrid": check_affine_grid,
}

INPUT_DTYPES = {**{op: FLOATS for op in KERNELS}, "Col2Im": NUMBERS}
