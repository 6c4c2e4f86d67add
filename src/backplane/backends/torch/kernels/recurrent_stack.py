"""Stacked forward GRU layers as one, stepped by wavefronts (``fusion/recurrent_stack.py`` makes
the layer from an exporter's GRU -> Squeeze -> GRU chain).

Why: a stack of L recurrent layers over T steps costs, stepped layer after layer, L x T steps of a
few torch ops each, and at the corpus's sizes (batch 1, hidden 20) each op is 0.5-3 us of fixed
cost whatever its work: gru_tm3_ts13 (3 layers, 8 steps) ran 24 steps of five ops. Layer l's step
t needs only layer l - 1's step t and its own step t - 1, so at wavefront k every layer l takes its
step k - l at once: T + L - 1 wavefronts of five ops for all layers (one batched product of
``[u_l, h_l]`` (u_l the state of the layer below, h_l its own) by ``[[W_zr, W_h, 0], [R_zr, 0,
R_h]]``, the sigmoid of z and r, ``x_h + r * r_h`` and its tanh, the ``lerp`` to the new state).
The first layer's input projection, for every step, is one product before the loop (its u is
zero: an input's infinity never meets a zero block, which would make it NaN).

A layer that has not started or has finished at a wavefront keeps its state: its z gate's addend
is +1e30 there (sigmoid exactly 1, ``lerp`` gives the old state exactly); so do a sequence's steps
past its ``sequence_lens`` (its first layer's projection is zeroed there first: a padded step's
values are never read, as in ONNX Runtime). The zero blocks of the product meet only states of the
same layer or the one below, whose NaN the reference carries there too. The states live in one
buffer (wavefront, batch, layer, hidden) that the last layer's Y is read from; the final states
are each layer's after the last wavefront.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from backplane.backends.torch.kernels.recurrent_fused import trace_constants, untraced

IDLE = 1e30
"""The z gate's addend where a layer keeps its state (sigmoid gives 1.0 from about 17)."""
KEPT = 8
"""The sizes whose addends a stack keeps (a model's few signatures)."""


class GruStack:
    """The constants of L stacked forward GRU layers (linear_before_reset=1, the default
    activations, one hidden size), made once at load from ONNX's W, R, B per layer (B None: zeros):
    the product's blocks (L, 2H, 4H), each layer's biases (L, 4H) in the product's gate order
    (z, r, x_h, r_h), and the first layer's input weight (3H, input)."""

    def __init__(self, weights: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]):
        hidden = weights[0][1].shape[-1]
        layers = len(weights)
        blocks = np.zeros((layers, 2 * hidden, 4 * hidden), np.float32)
        bias = np.zeros((layers, 4 * hidden), np.float32)
        for layer, (w, r, b) in enumerate(weights):  # (1, 3H, in), (1, 3H, H), (1, 6H): z, r, h
            w, r = w[0], r[0]
            b = np.zeros(6 * hidden, np.float32) if b is None else b[0]
            if layer:  # the first layer's u is zero: its projection is made before the loop
                blocks[layer, :hidden, :3 * hidden] = w.T
            blocks[layer, hidden:, :2 * hidden] = r[:2 * hidden].T
            blocks[layer, hidden:, 3 * hidden:] = r[2 * hidden:].T
            bias[layer] = np.concatenate([b[:2 * hidden] + b[3 * hidden:5 * hidden],
                                          b[2 * hidden:3 * hidden], b[5 * hidden:]])
        self.hidden, self.layers = hidden, layers
        self.blocks = torch.from_numpy(blocks)
        self.bias = torch.from_numpy(bias)
        self.first = torch.from_numpy(np.ascontiguousarray(weights[0][0][0]))
        self._kept: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._as = {self.blocks.dtype: (self.blocks, self.first)}

    def __call__(self, x: torch.Tensor, sequence_lens: torch.Tensor | None,
                 initial: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's Y (seq, batch, H) and every layer's final state (L, batch, H) of ``x``
        (seq, batch, input), each layer starting from its ``initial`` (1, batch, H) or zeros."""
        steps, batch = _sizes(x)
        layers, hidden = self.layers, self.hidden
        waves = steps + layers - 1
        addend, states = self._made(x, sequence_lens, initial)
        blocks = self._typed(x.dtype)[0]
        row = batch * (layers + 1) * hidden
        # [u_l, h_l] of every wavefront: two neighbours of one row, (L, batch, 2H)
        pairs = states.as_strided((waves, layers, batch, 2 * hidden),
                                  (row, hidden, (layers + 1) * hidden, 1)).unbind(0)
        # each layer's state after wavefront k - 1, (waves + 1, L, batch, H)
        kept = states.as_strided((waves + 1, layers, batch, hidden),
                                 (row, hidden, (layers + 1) * hidden, 1), hidden).unbind(0)
        gates = x.new_empty((layers, batch, 4 * hidden))
        zr, x_h, r_h = gates.split([2 * hidden, hidden, hidden], -1)
        z, r = zr.chunk(2, -1)
        n = x.new_empty((layers, batch, hidden))
        for k in range(waves):
            torch.baddbmm(addend[k], pairs[k], blocks, out=gates)
            zr.sigmoid_()
            torch.addcmul(x_h, r, r_h, out=n).tanh_()
            torch.lerp(n, kept[k], z, out=kept[k + 1])
        # the last layer's step t after wavefront t + L - 1
        y = states.as_strided((steps, batch, hidden), (row, (layers + 1) * hidden, 1),
                              layers * row + layers * hidden)
        if sequence_lens is not None:  # Y is zero past a sequence's end
            y = y * (torch.arange(steps)[:, None] < sequence_lens[None, :]).unsqueeze(-1)
        return y, kept[-1].clone()

    def _made(self, x: torch.Tensor, sequence_lens: torch.Tensor | None,
              initial: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each wavefront's addend (L, batch, 4H), and the states' buffer (wavefront, batch, layer,
        hidden), the initial states in its first row and a column of zeros before the first
        layer's (its u). What depends on the sizes alone (and constant initial states) is made once,
        a trace's constants (``_addends``, ``_states``); the first layer's projection is added to a
        copy, and IDLE on the z gate past a sequence's end."""
        steps, batch = _sizes(x)
        layers, hidden = self.layers, self.hidden
        constant = torch.jit.is_tracing() and trace_constants([h for h in initial if h is not None])
        with untraced(torch.jit.is_tracing()):
            base = self._addends(steps, batch, x.dtype)
            start = self._states(steps, batch, x.dtype, initial if constant else [None])
        # (copies: a trace's constants are never written)
        addend, states = base.clone(), start.clone() if torch.jit.is_tracing() else start
        if not constant:
            for layer, h0 in enumerate(initial):
                if h0 is not None:
                    states[0, :, layer + 1] = h0[0]
        row = layers * batch * 4 * hidden
        first = addend.as_strided((steps, batch, 3 * hidden), (row, 4 * hidden, 1))
        projected = F.linear(x, self._typed(x.dtype)[1])  # (seq, batch, 3H)
        if sequence_lens is None:
            first.add_(projected)
            return addend.unbind(0), states
        past = torch.arange(steps)[:, None] >= sequence_lens[None, :]  # (seq, batch)
        first.add_(projected.masked_fill(past.unsqueeze(-1), 0.0))
        step = torch.arange(steps + layers - 1)[:, None] - torch.arange(layers)[None, :]
        past = (step[..., None] >= sequence_lens[None, None, :]).unsqueeze(-1)
        z = addend[..., :hidden]  # (waves, L, batch, H)
        z.masked_fill_(past, IDLE)
        return addend.unbind(0), states

    def _typed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks and the first layer's weight in ``dtype`` (a ``CpuAcc.precision`` subgraph's
        bfloat16), made once (outside a trace: its constants)."""
        if dtype not in self._as:
            with untraced(torch.jit.is_tracing()):
                self._as[dtype] = (self.blocks.to(dtype), self.first.to(dtype))
        return self._as[dtype]

    def _addends(self, steps: int, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """The addends (waves, L, batch, 4H) before the first layer's projection: the biases, IDLE
        on the z gate of a layer not started or finished; kept by sizes (the last few)."""
        key = (steps, batch, dtype)
        if key not in self._kept:
            layers, hidden = self.layers, self.hidden
            waves = steps + layers - 1
            step = torch.arange(waves)[:, None] - torch.arange(layers)[None, :]  # (waves, L)
            base = self.bias.to(dtype)[None, :, None, :].repeat(waves, 1, batch, 1)
            base[..., :hidden][(step < 0) | (step >= steps)] = IDLE
            if len(self._kept) >= KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = base
        return self._kept[key]

    def _states(self, steps: int, batch: int, dtype: torch.dtype,
                initial: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The states' buffer (waves + 1, batch, L + 1, H): zeros, ``initial`` in its first row."""
        layers = self.layers
        states = torch.zeros((steps + layers, batch, layers + 1, self.hidden), dtype=dtype)
        for layer, h0 in enumerate(initial):
            if h0 is not None:
                states[0, :, layer + 1] = h0[0]
        return states

class NativeStack:
    """The same stack in one op (``native/recurrent_stack.py``: a C call a layer, each its input
    projection then every step's recurrent product and gates): where the C loop is built and
    ``CpuAcc.native`` is "auto" (``fusion/recurrent_stack.py``), float32 inputs (others: the
    wavefronts). gru_tm3_ts13's three layers: one op, where the wavefronts were 10 of five ops
    (and an op a layer, 15-25 us each beyond its C, until the eighteenth session)."""

    def __init__(self, weights: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]):
        from backplane.native import recurrent as in_c
        from backplane.native import recurrent_stack

        hidden = weights[0][1].shape[-1]
        self.stack = recurrent_stack.Stack("gru", [in_c.prepared(
            "gru", *(None if v is None else torch.from_numpy(v) for v in (w, r, b)), 1)
            for w, r, b in weights], hidden, "forward", 1)

    def __call__(self, x: torch.Tensor, sequence_lens: torch.Tensor | None,
                 initial: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor,
                                                                  list[torch.Tensor]]:
        """As ``GruStack``'s: the last layer's Y (seq, batch, H); every layer's final state, a
        list of (1, batch, H)."""
        y, finals, _ = self.stack(x, sequence_lens, initial, [], True)
        return y, finals.split(1)


def _sizes(x: torch.Tensor) -> tuple[int, int]:
    """``x``'s steps and batch as numbers, not as ops of a trace (which is made for one shape)."""
    with untraced(torch.jit.is_tracing()):
        return int(x.shape[0]), int(x.shape[1])
