"""ONNX's LSTM and GRU as one call of C over every step (``recurrent.c``), inside CpuAcc's traces.

Why: stepped in torch ops a recurrent step costs 6-14 us (5-7 ops of 1-4 us each; MKL's one-row
product runs its generic kernel on this project's AMD EPYC), where ONNX Runtime takes about 1 us a
layer-step; torch's fused kernels (oneDNN's LSTM, torch's GRU loop) pay tens of us a call around
their steps. Here every step's input projection is one matrix product (torch's, MKL's GEMM), and
the steps' recurrent products and gates one C loop, the weights packed once in the layout it reads
(``pack``: in a frozen trace, constants).

Where: a layer of the default activations, no clip, no peepholes (or all zero) and no
input_forget, float32 on the CPU, traced by ``fusion/traced.py`` while ``CpuAcc.native`` is "auto"
(``MODE``, set around the trace from the session's options) and the library builds here. The trace
holds one op, ``backplane::native_lstm`` / ``native_gru``, whose CPU kernel calls the C function
on the tensors' memory. With "off", without a compiler, or outside a trace, the torch routes run
as before (``kernels/recurrent.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from backplane.native.build import NativeUnavailable, library, mode

BW = 64
"""The C loop's block of outputs (``recurrent.c``'s ``BW``): the packed weights' inner size."""

MODE: contextvars.ContextVar[str] = contextvars.ContextVar("backplane_native_recurrent",
                                                          default="off")
""""auto" while a CpuAcc trace is made under ``CpuAcc.native`` "auto" (``natively``)."""


@contextlib.contextmanager
def natively(backend: Any) -> Iterator[None]:
    """``MODE`` from ``backend``'s options (``CpuAcc.native``) while a trace is made."""
    token = MODE.set(mode(backend.options))
    try:
        yield
    finally:
        MODE.reset(token)


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "seq", "dirs", "batch", "H", "direction", "xt", "xd", "xb", "sd", "sb", "yt", "yd", "yb",
        "linear_before_reset")]


_FUNCTIONS: list[Any] = []
_SHAPES: dict[tuple[int, ...], _Shape] = {}
"""A call's sizes and strides -> their structure (made once: ctypes fills one slower than it
passes the pointers; never changed after, so threads share them)."""


def _functions() -> tuple[Any, Any]:
    """The library's LSTM and GRU, typed (raises ``NativeUnavailable``)."""
    if not _FUNCTIONS:
        lib = library("recurrent")
        pointers = [ctypes.c_void_p] * 8
        for function, count in ((lib.backplane_lstm, 8), (lib.backplane_gru, 7)):
            function.argtypes = [ctypes.POINTER(_Shape)] + pointers[:count]
            function.restype = ctypes.c_int
        _FUNCTIONS[:] = [lib.backplane_lstm, lib.backplane_gru]
    return _FUNCTIONS[0], _FUNCTIONS[1]


def usable(X: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether this layer runs natively: ``MODE`` "auto" and ``computes``."""
    return MODE.get() == "auto" and computes(X, *weights)


def computes(X: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether the C loop computes this layer: float32 on the CPU, steps to take, and the library
    here."""
    if X.device.type != "cpu" or X.dtype != torch.float32 or X.numel() == 0 \
            or any(w is not None and w.dtype != torch.float32 for w in weights):
        return False
    try:
        _functions()
    except NativeUnavailable:
        return False
    return True


def pack(R: torch.Tensor, split: bool = False) -> torch.Tensor:
    """R (dirs, gates * H, H) as the C loop reads it: per direction R^T's columns in blocks of
    ``BW``, each block's H rows contiguous, the last block padded with zeros; with ``split`` (a GRU
    without linear_before_reset) the z, r gates' blocks, then h's."""
    if split:
        hidden = R.shape[-1]
        return torch.cat([pack(R[:, :2 * hidden]), pack(R[:, 2 * hidden:])], 1)
    dirs, rows, hidden = R.shape
    blocks = -(-rows // BW)
    t = F.pad(R.transpose(1, 2), (0, blocks * BW - rows))  # (dirs, H, blocks * BW)
    return t.reshape(dirs, hidden, blocks, BW).transpose(1, 2).contiguous()


def _states(value: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """An initial state as the C loop reads it: float32, ``shape`` (broadcast where ONNX's was)."""
    if value is None:
        return None
    value = value if value.dtype == torch.float32 else value.to(torch.float32)
    return value if tuple(value.shape) == shape else value.expand(shape)


def layer(kind: str, X, W, R, B, sequence_lens, h0, c0, direction, layout,
          linear_before_reset=0):
    """Y, Y_h (and LSTM's Y_c) of an ONNX LSTM (``kind`` "lstm") or GRU, shaped as ONNX's."""
    weights = prepared(kind, W, R, B, linear_before_reset)
    return run(kind, weights, X, sequence_lens, h0, c0, direction, layout, linear_before_reset)


def prepared(kind: str, W, R, B, linear_before_reset=0) -> tuple[torch.Tensor, ...]:
    """What a layer's calls read of its weights (in a frozen trace, constants; a caller that
    keeps them makes them once): W (dirs * gates * H, input), the biases added to the input
    projection, R packed (``pack``), and a GRU's Rb_h (dirs, H), added inside the reset."""
    dirs, gates = W.shape[0], 4 if kind == "lstm" else 3
    hidden = W.shape[1] // gates
    if B is None:
        bias, rbh = None, torch.zeros((dirs, hidden), dtype=W.dtype)
    elif kind == "lstm":
        bias, rbh = (B[:, :4 * hidden] + B[:, 4 * hidden:]).flatten(), None
    else:  # z's and r's recurrent biases with the input's; h's inside the reset, in C
        r_b = B[:, 3 * hidden:]
        bias = (B[:, :3 * hidden] + F.pad(r_b[:, :2 * hidden], (0, hidden))).flatten()
        rbh = r_b[:, 2 * hidden:].contiguous()
    packed = pack(R, kind == "gru" and not linear_before_reset)
    return W.flatten(0, 1), bias, packed, rbh


def run(kind: str, weights, X, sequence_lens, h0, c0, direction, layout,
        linear_before_reset=0):
    """``layer`` on ``prepared``'s weights."""
    weight, bias, packed, rbh = weights
    dirs, hidden = packed.shape[0], packed.shape[2]
    x = X.transpose(0, 1) if layout else X  # (seq, batch, input): the projection time first
    xw = F.linear(x, weight, bias)
    batch = x.shape[1]
    shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    lens = None if sequence_lens is None else sequence_lens.to(torch.int64)
    direction = {"forward": 0, "reverse": 1, "bidirectional": 2}[direction]
    if kind == "lstm":
        return torch.ops.backplane.native_lstm(xw, packed, _states(h0, shape), _states(c0, shape),
                                               lens, direction, layout)
    return torch.ops.backplane.native_gru(xw, packed, _states(h0, shape), rbh, lens, direction,
                                          layout, linear_before_reset)


def _shape(xw: torch.Tensor, dirs: int, hidden: int, direction: int, layout: int,
           linear_before_reset: int) -> _Shape:
    """The call's sizes and the strides of xw (seq, batch, dirs * gates, the last 1), Y and the
    states in ONNX's ``layout``."""
    seq, batch, width = xw.shape
    xt, xb, _ = xw.stride()
    key = (seq, batch, width, xt, xb, dirs, hidden, direction, layout, linear_before_reset)
    shape = _SHAPES.get(key)
    if shape is None:
        if layout:  # Y (batch, seq, dirs, hidden), states (batch, dirs, hidden)
            ys, ss = (dirs * hidden, hidden, seq * dirs * hidden), (hidden, dirs * hidden)
        else:  # Y (seq, dirs, batch, hidden), states (dirs, batch, hidden)
            ys, ss = (dirs * batch * hidden, batch * hidden, hidden), (batch * hidden, hidden)
        shape = _SHAPES[key] = _Shape(seq, dirs, batch, hidden, direction, xt, width // dirs, xb,
                                      *ss, *ys, linear_before_reset)
    return shape


def _outputs(xw: torch.Tensor, dirs: int, hidden: int, layout: int,
             count: int) -> list[torch.Tensor]:
    seq, batch = xw.shape[0], xw.shape[1]
    y = xw.new_empty((batch, seq, dirs, hidden) if layout else (seq, dirs, batch, hidden))
    states = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    return [y] + [xw.new_empty(states) for _ in range(count)]


def _address(value: torch.Tensor | None) -> int | None:
    return None if value is None else value.data_ptr()


def _contiguous(*values: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The values as the C loop reads them (held by the caller until the call returns)."""
    return [v if v is None or v.is_contiguous() else v.contiguous() for v in values]


def _lstm(xw, packed, h0, c0, lens, direction, layout):
    xw = xw if xw.stride(-1) == 1 else xw.contiguous()
    dirs, hidden = packed.shape[0], packed.shape[2]
    shape = _shape(xw, dirs, hidden, direction, layout, 0)
    y, y_h, y_c = _outputs(xw, dirs, hidden, layout, 2)
    h0, c0, lens = _contiguous(h0, c0, lens)
    if _functions()[0](shape, xw.data_ptr(), packed.data_ptr(), _address(h0), _address(c0),
                       _address(lens), y.data_ptr(), y_h.data_ptr(), y_c.data_ptr()):
        raise MemoryError("the native LSTM could not allocate its work memory")
    return y, y_h, y_c


def _gru(xw, packed, h0, rbh, lens, direction, layout, linear_before_reset):
    xw = xw if xw.stride(-1) == 1 else xw.contiguous()
    dirs, hidden = packed.shape[0], packed.shape[2]
    shape = _shape(xw, dirs, hidden, direction, layout, linear_before_reset)
    y, y_h = _outputs(xw, dirs, hidden, layout, 1)
    h0, rbh, lens = _contiguous(h0, rbh, lens)
    if _functions()[1](shape, xw.data_ptr(), packed.data_ptr(), _address(h0), _address(rbh),
                       _address(lens), y.data_ptr(), y_h.data_ptr()):
        raise MemoryError("the native GRU could not allocate its work memory")
    return y, y_h


_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
_LIBRARY.define("native_lstm(Tensor xw, Tensor packed, Tensor? h0, Tensor? c0, Tensor? lens, "
                "int direction, int layout) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define("native_gru(Tensor xw, Tensor packed, Tensor? h0, Tensor rbh, Tensor? lens, "
                "int direction, int layout, int linear_before_reset) -> (Tensor, Tensor)")
_LIBRARY.impl("native_lstm", _lstm, "CPU")
_LIBRARY.impl("native_gru", _gru, "CPU")
