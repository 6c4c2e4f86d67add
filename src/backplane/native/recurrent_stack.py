"""Stacked LSTM or GRU layers, as exporters write them, in one op of one C call a layer
(``recurrent.c``): ``backplane::native_stack`` inside CpuAcc's traces.

Why: each op of ``recurrent.py`` costs 15-25 us beyond its C (the dispatcher's call into Python,
its outputs allocated, ctypes), where a whole layer of the corpus's sizes computes in 3-10 us;
between two layers an export reshapes Y (Transpose, Reshape: two ops more). Here the stack is one
op: layer l writes its Y as layer l + 1 reads it, (seq, batch, dirs, H), by the C loop's strides
(no copy), into a scratch buffer of the op's own; a layer whose ``[W, R]`` is large has its input
projected first as ``recurrent.run`` does. The weights are no arguments of the op (each tensor
the dispatcher hands to Python costs: gru_tm3's 18 of them, 20 us a call): the op names its
``Stack`` by a number. The kernels that reach it: ``GruStack`` (``kernels/recurrent_stack.py``)
and ``LstmStack`` (``fusion/recurrent_stack.py``), where ``CpuAcc.native`` is "auto" and the
library builds.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from backplane.native import recurrent as single

NONE = torch.empty(0)
"""An absent initial state in the op's lists (a trace takes no list of optional tensors)."""
DIRECTIONS = {"forward": 0, "reverse": 1, "bidirectional": 2}
_PLANS: dict[tuple[Any, ...], list[single._Shape]] = {}
"""A stack's sizes and strides -> each layer's call structure (made once, shared by threads)."""
_LAYOUTS: dict[int, Layout] = {}
"""Each stack's layout, by the number its op names it with (a few numbers each: kept for the
process, as the op of any trace made may read them)."""
_NUMBERS = itertools.count()


class Layout:
    """Where each layer's weights lie in a stack's one tensor of them (``Stack.weights``), in
    floats, and what the layers are."""

    def __init__(self, kind: str, weights: Sequence[tuple[Any, ...]], hidden: int,
                 direction: str, linear_before_reset: int) -> None:
        self.gru, self.hidden = int(kind == "gru"), hidden
        self.linear_before_reset = linear_before_reset
        self.direction, self.dirs = DIRECTIONS[direction], weights[0][0].shape[0]
        self.projected = tuple(w[2] is not None for w in weights)
        self.spare: dict[int, list[tuple[np.ndarray, int]]] = {}  # scratch buffers by size
        self.at: list[tuple[int, ...]] = []  # packed, bias; the projection's W, its shape, bias
        self.panels = [_panels(w[2], w[3]) for w in weights]  # (or None: F.linear projects)
        at = 0
        for w in weights:
            where = [at, at + w[0].numel()]
            at = where[1] + w[1].numel()
            if w[2] is not None:
                where += [at, *w[2].shape, at + w[2].numel()]
                at += w[2].numel() + w[3].numel()
            self.at.append(tuple(where))


def _panels(weight: Any, bias: Any) -> tuple[Any, ...] | None:
    """A projection's weight packed for linear.c's tile (and the bias padded, the C product's
    function), where that tile is AVX-512's; else None (torch's F.linear). Why: it runs 2.5 times
    torch's MKL at 1 thread here (AMD EPYC family 26, thread CPU, the full-tier CRNN's two
    projections: 160 x 128 x 768 124 / 313 us, 160 x 192 x 768 185 / 475), the full-tier CRNN
    at 1 thread 6.39 -> 5.76 ms a run (thread CPU, load 7-8, two pairs alternating)."""
    if weight is None:
        return None
    from backplane.native import linear
    from backplane.native.build import NativeUnavailable

    try:
        if linear.rows() < linear.WIDE_ROWS:
            return None
        packed, padded = linear.pack(weight.numpy(), bias.numpy())
    except NativeUnavailable:
        return None
    return packed, padded, linear._functions()[1]


class Stack:
    """Layers of one kind, direction and hidden size, their weights ``recurrent.prepared``'s (one
    a layer) in one tensor; a call runs them as one op. The weights are that op's argument, so a
    trace holds them; the layout is named by a number (each tensor the dispatcher hands to Python
    costs: gru_tm3's weights as 12 tensors a call cost more than its three layers' C)."""

    def __init__(self, kind: str, weights: Sequence[tuple[Any, ...]], hidden: int,
                 direction: str, linear_before_reset: int = 0) -> None:
        layout = Layout(kind, weights, hidden, direction, linear_before_reset)
        self.gru, self.dirs, self.hidden = layout.gru, layout.dirs, hidden
        self.weights = torch.cat([v.reshape(-1) for w in weights for v in w if v is not None])
        self.number = next(_NUMBERS)
        _LAYOUTS[self.number] = layout

    def __call__(self, x: torch.Tensor, sequence_lens: torch.Tensor | None,
                 h0: Sequence[torch.Tensor | None], c0: Sequence[torch.Tensor | None],
                 merged: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layers over x (seq, batch, I), time-major, layer l's Y (seq, dirs, batch, H) read
        by layer l + 1 as (seq, batch, dirs * H); ``h0``, ``c0`` (LSTM) a layer's initial states
        or None. The last layer's Y, (seq, batch, dirs * H) with ``merged`` (as the Transpose
        and Reshape after it make it), else ONNX's (seq, dirs, batch, H); the layers' final
        states (L * dirs, batch, H), as a Concat of each layer's makes them, and LSTM's cells
        (else an empty tensor). (Two outputs for them, not two lists: each tensor handed back to
        the dispatcher costs; and no view of them: a run's output that is a view is copied.)"""
        shape = (self.dirs, x.shape[1], self.hidden)

        def states(values: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
            return [NONE if v is None else single._states(v, shape) for v in values]

        lens = None if sequence_lens is None else sequence_lens.to(torch.int64)
        return torch.ops.backplane.native_stack(x, self.weights, states(h0),
                                                [] if self.gru else states(c0), lens,
                                                self.number, int(merged))


def _plan(sizes: tuple[int, ...], strides: tuple[int, ...], stack: Layout,
          merged: int) -> list[single._Shape]:
    """Each layer's call: x (the input, or its projection), Y and the states' strides."""
    key = (sizes, strides, stack.projected, stack.dirs, stack.gru, stack.hidden, stack.direction,
           stack.linear_before_reset, merged)
    plan = _PLANS.get(key)
    if plan is None:
        dirs, hidden, gates = stack.dirs, stack.hidden, 3 if stack.gru else 4
        seq, batch, width = sizes[0], sizes[1], dirs * hidden
        plan = []
        for layer, project in enumerate(stack.projected):
            inputs, xt, xb = (sizes[2], strides[0], strides[1]) if layer == 0 else \
                (width, batch * width, width)
            if project:  # (seq, batch, dirs * gates * H) from F.linear, contiguous
                inputs = dirs * gates * hidden
                xt, xb = batch * inputs, inputs
            last = layer == len(stack.projected) - 1
            ys = (dirs * batch * hidden, batch * hidden, hidden) if last and not merged else \
                (batch * width, hidden, width)  # ONNX's (seq, dirs, batch, H); (seq, batch, dirs, H)
            plan.append(single._Shape(seq, dirs, batch, 0 if project else inputs, hidden,
                                      stack.direction, xt, xb, batch * hidden, hidden, *ys,
                                      stack.linear_before_reset, gates * hidden if project else 0))
        _PLANS[key] = plan
    return plan


def _stack(x, weights, h0, c0, lens, number, merged):
    if x.stride(-1) != 1:
        x = x.contiguous()
    if lens is not None and not lens.is_contiguous():
        lens = lens.contiguous()
    stack = _LAYOUTS[number]
    gru, dirs, hidden, projected = stack.gru, stack.dirs, stack.hidden, stack.projected
    layers, (seq, batch) = len(projected), x.shape[:2]
    plan = _plan(x.shape, x.stride(), stack, merged)
    width = dirs * hidden
    y = single._empty((seq, batch, width) if merged else (seq, dirs, batch, hidden))
    hs = single._empty((layers * dirs, batch, hidden))
    cs = single._empty((layers * dirs, batch, hidden) if not gru else (0,))
    # every layer's Y but the last, (seq, batch, dirs, H): two buffers, read and written in
    # turn, kept for the next call (taken and put back whole: a thread beside takes another)
    size = seq * batch * width * 4
    spare = stack.spare.setdefault(size, [])
    scratch, between = spare.pop() if spare else _scratch(min(layers - 1, 2), size)
    call = (single._FUNCTIONS or single._functions())[gru]
    lens_at = None if lens is None else lens.data_ptr()
    source, base, step = x.data_ptr(), weights.data_ptr(), dirs * batch * hidden * 4
    h_at, c_at = hs.data_ptr(), None if gru else cs.data_ptr()
    for layer in range(layers):
        at = stack.at[layer]
        if projected[layer]:  # every step's input projection first, one GEMM
            given = x if layer == 0 else \
                torch.from_numpy(scratch[(layer - 1) % 2]).view(seq, batch, width)
            panels = stack.panels[layer]
            if panels is None:
                w_in = weights[at[2]:at[2] + at[3] * at[4]].view(at[3], at[4])
                inputs = F.linear(given, w_in, weights[at[5]:at[5] + at[3]])
            else:  # linear.c's tile: (seq * batch, I) by the packed W, contiguous out
                given = given if given.is_contiguous() else given.contiguous()
                inputs = single._empty((seq, batch, at[3]))
                packed, padded, product = panels
                product(given.data_ptr(), seq * batch, at[4], packed.data_ptr(), at[3],
                        padded.data_ptr(), inputs.data_ptr())
            source = inputs.data_ptr()
        target = y.data_ptr() if layer == layers - 1 else between + (layer % 2) * size
        start = h0[layer]
        if start.numel() and not start.is_contiguous():
            start = start.contiguous()
        if gru:
            failed = call(plan[layer], source, base + 4 * at[0], base + 4 * at[1],
                          start.data_ptr() if start.numel() else None, lens_at, target,
                          h_at + layer * step)
        else:
            cell = c0[layer]
            if cell.numel() and not cell.is_contiguous():
                cell = cell.contiguous()
            failed = call(plan[layer], source, base + 4 * at[0], base + 4 * at[1],
                          start.data_ptr() if start.numel() else None,
                          cell.data_ptr() if cell.numel() else None, lens_at, target,
                          h_at + layer * step, c_at + layer * step)
        if failed:
            raise MemoryError("the native recurrent stack could not allocate its work memory")
        source = target
    spare.append((scratch, between))
    return y, hs, cs


def _scratch(count: int, size: int) -> tuple[np.ndarray, int]:
    """``count`` buffers of ``size`` bytes and the first one's address."""
    scratch = np.empty((count, size // 4), np.float32)
    return scratch, scratch.ctypes.data


_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
_LIBRARY.define("native_stack(Tensor x, Tensor weights, Tensor[] h0, Tensor[] c0, Tensor? lens, "
                "int stack, int merged) -> (Tensor, Tensor, Tensor)")
_LIBRARY.impl("native_stack", _stack, "CPU")
