"""oneDNN's LSTM on weights reordered for it once, not at every call.

Why: ``torch.lstm`` on the CPU calls ``aten::mkldnn_rnn_layer`` once a direction, and ideep
reorders both weight matrices into oneDNN's blocked layout at each call (``jit:uni`` reorders,
ONEDNN_VERBOSE: 0.03-0.13 ms a direction at hidden 128 on this project's AMD EPYC); with grad mode
on (CpuAcc's runs) it also takes oneDNN's training primitive (its ``ref`` implementation, a
workspace written). torch has the reorder as an op of its own
(``mkldnn::_reorder_mkldnn_rnn_layer_weight``, what inductor's freezing pass packs an LSTM's
weights with), and ``mkldnn_rnn_layer`` takes its result without reordering again where it runs
the inference primitive (grad mode off). Here each direction's weights are reordered once, kept
with torch's weight tensors, and the layer runs one ``mkldnn_rnn_layer`` a direction under
``no_grad``: the values of torch's inference primitive bit for bit (its training one's differ by
about 1e-7). A layer of 100 steps, hidden 128, both directions, 1 thread, CPU us (p10): input 64
2985 -> 2753, input 256 4230 -> 3721 (load 8.7; torch.lstm under no_grad against this).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

LSTM_MODE = 2
"""ideep's rnn_kind for an LSTM (``mkldnn_rnn_layer``'s ``mode``)."""
_PACKED = WeakIdKeyDictionary()
"""A direction's input weight -> (its recurrent weight, reverse, the versions, the reordered
pair), dropped with it."""


def packable(name: str, x: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
    """Whether an LSTM of ``params`` (torch's list) on ``x`` can run by ``lstm``: float32 on the
    CPU, torch built with oneDNN and its use on, and no input that needs a gradient."""
    return (name == "lstm" and x.device.type == "cpu" and x.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()
            and not any(t.requires_grad for t in (x, *params)))


def lstm(x: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
         has_bias: bool, bidirectional: bool, batch_first: bool) -> list[torch.Tensor]:
    """``torch.lstm(x, hx, params, has_bias, 1, 0.0, False, bidirectional, batch_first)``'s
    outputs (Y with the directions' hidden side by side, the final h and c (dirs, batch,
    hidden)) by one ``mkldnn_rnn_layer`` a direction on weights reordered once (``_reordered``),
    under ``no_grad``."""
    per = 4 if has_bias else 2
    hidden = params[1].shape[1]
    time_first = (x.transpose(0, 1) if batch_first else x).contiguous()
    h, c = (s.contiguous() for s in hx)
    ys, hs, cs = [], [], []
    with torch.no_grad():
        for d in range(2 if bidirectional else 1):
            w_ih, w_hh, *biases = params[d * per:(d + 1) * per]
            packed = _reordered(w_ih, w_hh, hidden, bool(d), has_bias, list(time_first.shape))
            b_ih, b_hh = biases if has_bias else (w_ih.new_zeros(0), w_hh.new_zeros(0))
            y, h_d, c_d, _ = torch.ops.aten.mkldnn_rnn_layer(
                time_first, *packed, b_ih, b_hh, h[d:d + 1], c[d:d + 1], bool(d), [],
                LSTM_MODE, hidden, 1, has_bias, False, False, False)
            ys.append(y)
            hs.append(h_d)
            cs.append(c_d)
    y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
    return [y.transpose(0, 1) if batch_first else y, torch.cat(hs), torch.cat(cs)]


def _reordered(w_ih, w_hh, hidden, reverse, has_bias, sizes):
    """A direction's two weights in oneDNN's layout for its LSTM primitive, made at the first
    call and kept while they are the same tensors, unchanged (their version counters); the layout
    is chosen for the input's sizes (another length is reordered again at its call, as before)."""
    versions = None if w_ih.is_inference() else (w_ih._version, w_hh._version)
    kept = _PACKED.get(w_ih)
    if kept is not None and kept[0] is w_hh and kept[1] == reverse and kept[2] == versions:
        return kept[3]
    with torch.no_grad():
        packed = tuple(torch.ops.mkldnn._reorder_mkldnn_rnn_layer_weight(
            w_ih, w_hh, hidden, reverse, has_bias, False, sizes))
    _PACKED[w_ih] = (w_hh, reverse, versions, packed)
    return packed
