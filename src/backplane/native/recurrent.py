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

VERSION = 3
"""``recurrent.c``'s ``backplane_recurrent_version``: the calls' signatures this module makes."""
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
        "seq", "dirs", "batch", "I", "H", "direction", "xt", "xb", "sd", "sb", "yt", "yd", "yb",
        "linear_before_reset", "xd")]


_FUNCTIONS: list[Any] = []
_SHAPES: dict[tuple[Any, ...], tuple[_Shape, tuple[int, ...], tuple[int, ...]]] = {}
"""A call's sizes and strides -> their structure and its outputs' shapes (made once: ctypes fills
one slower than it passes the pointers; never changed after, so threads share them)."""


def _library() -> Any:
    """The library, its functions typed (raises ``NativeUnavailable``)."""
    lib = library("recurrent", VERSION)
    if not _FUNCTIONS:
        pointers = [ctypes.c_void_p] * 9
        for function, count in ((lib.backplane_lstm, 9), (lib.backplane_gru, 7)):
            function.argtypes = [ctypes.POINTER(_Shape)] + pointers[:count]
            function.restype = ctypes.c_int
        lib.backplane_packed_floats.argtypes = [ctypes.c_int64] * 5
        lib.backplane_packed_floats.restype = ctypes.c_int64
        _FUNCTIONS[:] = [lib.backplane_lstm, lib.backplane_gru]
    return lib


def _functions() -> list[Any]:
    """The library's LSTM and GRU (raises ``NativeUnavailable``)."""
    return _FUNCTIONS if _FUNCTIONS else (_library(), _FUNCTIONS)[1]


def usable(X: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether this layer runs natively: ``MODE`` "auto" and ``computes``."""
    return MODE.get() == "auto" and computes(X, *weights)


def computes(X: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether the C loop computes this layer: float32 on the CPU, steps to take, and the library
    here."""
    return X.device.type == "cpu" and X.dtype == torch.float32 and X.numel() > 0 \
        and all(w is None or w.dtype == torch.float32 for w in weights) and built()


def built() -> bool:
    """Whether the library is here (built, loaded, of this module's ``VERSION``)."""
    try:
        _functions()
    except NativeUnavailable:
        return False
    return True


DEFAULTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"]}


def steps_in_c(layer: Any, graph: Any, native: str) -> bool:
    """Whether a trace made under ``CpuAcc.native`` ``native`` runs ``layer`` (an ONNX LSTM or
    GRU of ``graph``) as this C loop, as ``kernels/recurrent``'s ``_in_c`` will decide it: the
    default activations, no clip, no input_forget, no peepholes (or constant zeros), a static
    float32 input of more than one step, the library here. Such a layer's steps run on the calling
    thread whatever torch's count, so ``traced._alone``'s reason to keep a recurrent layer out of
    traces on a busy machine (a trace keeps torch's ops, not the thread count its kernel sets)
    does not hold for it: left out, the small tier's lstm_bi2_ts14 lost its one native call
    (2 threads, load 6.6, a warm route cache: 307 us a run against 9.5 with it traced;
    crnn_paddle_ts12 582 against 196)."""
    a, op = layer.attrs, layer.op_type
    if native != "auto" or op not in DEFAULTS or layer.domain or len(layer.inputs) < 3:
        return False
    direction = a.get("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    dirs = 2 if direction == "bidirectional" else 1
    names = [v.decode() if isinstance(v, bytes) else str(v) for v in a.get("activations") or []]
    if (names and names != DEFAULTS[op] * dirs) or a.get("clip") is not None \
            or a.get("input_forget", 0) or a.get("activation_alpha") or a.get("activation_beta"):
        return False
    if op == "LSTM" and len(layer.inputs) > 7 and layer.inputs[7]:
        peepholes = graph.constants.get(layer.inputs[7])
        if peepholes is None or peepholes.any():
            return False
    info = graph.info(layer.inputs[0])
    layout = int(a.get("layout", 0))
    if info is None or not info.is_static or len(info.shape) != 3 or layout not in (0, 1) \
            or info.shape[layout] <= 1 or any(str(graph.info(n).dtype) != "float32"
                                              for n in layer.inputs[:3] if n):
        return False
    return built()


def _packed(M: torch.Tensor) -> torch.Tensor:
    """M (dirs, outputs, K) as the C loop reads it: per direction the outputs in blocks of ``BW``
    (the last padded with zeros), each block's K rows contiguous, (dirs, blocks * K * BW)."""
    dirs, rows, k = M.shape
    blocks = -(-rows // BW)
    t = F.pad(M.transpose(1, 2), (0, blocks * BW - rows))  # (dirs, K, blocks * BW)
    return t.reshape(dirs, k, blocks, BW).transpose(1, 2).reshape(dirs, -1)


def _padded(bias: torch.Tensor) -> torch.Tensor:
    rows = bias.shape[1]
    return F.pad(bias, (0, -(-rows // BW) * BW - rows))


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
    return run(kind, weights, R.shape[-1], X, sequence_lens, h0, c0, direction, layout,
               linear_before_reset)


STACKED_BYTES = 1 << 17
"""The largest ``[W, R]`` of a direction (float32 bytes) the C loop reads at every step; a larger
one (the full tier's layers: 442-786 KB, past this CPU's 512 KB L2 for two directions) has its
input projection made before the loop, one GEMM of every step (``prepared``'s ``projected``), and
the loop reads R alone. Full tier, 1 thread, load 6.8-7.8, thread CPU ms a run, torch's routes /
C reading [W, R]: lstm_bi2_ts14 8.45 / 6.44, crnn_paddle_ts12 26.1 / 28.9."""


def prepared(kind: str, W, R, B, linear_before_reset=0, project: bool | None = None
             ) -> tuple[Any, ...]:
    """The weights and biases as the C loop reads them, every direction's (in a frozen trace,
    constants; a caller that keeps them makes them once): LSTM ``[W, R]`` to its four gates;
    GRU ``[W, R]`` to z and r, then with linear_before_reset W_h and R_h apart (R_h's product
    is reset, its bias with it), without it ``[W_h, R_h]`` (read with ``r * h``). Where ``[W, R]``
    is larger than ``STACKED_BYTES`` a direction (or ``project`` says so), the same with no rows
    of W, and W with the biases outside the reset for the projection before the loop (else those
    two are None)."""
    dirs, gates, hidden = W.shape[0], 4 if kind == "lstm" else 3, R.shape[-1]
    if B is None:
        B = W.new_zeros((dirs, 2 * gates * hidden))
    w_b, r_b = B[:, :gates * hidden], B[:, gates * hidden:]
    zr, h = slice(0, 2 * hidden), slice(2 * hidden, 3 * hidden)
    inputs: tuple[Any, Any] = (None, None)
    if project is None:
        project = gates * hidden * (W.shape[-1] + hidden) * 4 > STACKED_BYTES
    if project:
        if kind == "lstm":
            outside, inside = w_b + r_b, torch.zeros_like(r_b)
        else:  # (a GRU's Rb_h stays with the loop: inside the reset, or beside R_h's product)
            outside = torch.cat([w_b[:, zr] + r_b[:, zr], w_b[:, h]], 1)
            inside = torch.cat([torch.zeros_like(r_b[:, zr]), r_b[:, h]], 1)
        inputs = (W.flatten(0, 1), outside.flatten())
        W, w_b, r_b = W[:, :, :0], torch.zeros_like(w_b), inside  # the loop's products read h
    if kind == "lstm":
        mats, biases = [torch.cat([W, R], 2)], [w_b + r_b]
    elif linear_before_reset:
        mats = [torch.cat([W[:, zr], R[:, zr]], 2), W[:, h], R[:, h]]
        biases = [w_b[:, zr] + r_b[:, zr], w_b[:, h], r_b[:, h]]
    else:
        mats = [torch.cat([W[:, zr], R[:, zr]], 2), torch.cat([W[:, h], R[:, h]], 2)]
        biases = [w_b[:, zr] + r_b[:, zr], w_b[:, h] + r_b[:, h]]
    return (torch.cat([_packed(m) for m in mats], 1).contiguous(),
            torch.cat([_padded(b) for b in biases], 1).contiguous(), *inputs)


def run(kind: str, weights, hidden: int, X, sequence_lens, h0, c0, direction, layout,
        linear_before_reset=0):
    """``layer`` on ``prepared``'s weights of a layer of ``hidden``."""
    packed, bias, w_in, b_in = weights
    dirs = packed.shape[0]
    projected = int(w_in is not None)
    if projected:  # every step's input projection first, in X's layout
        X = F.linear(X, w_in, b_in)
    batch = X.shape[1 - layout]
    shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    lens = None if sequence_lens is None else sequence_lens.to(torch.int64)
    direction = {"forward": 0, "reverse": 1, "bidirectional": 2}[direction]
    if kind == "lstm":
        return torch.ops.backplane.native_lstm(X, packed, bias, _states(h0, shape),
                                               _states(c0, shape), lens, direction, layout, hidden,
                                               projected)
    return torch.ops.backplane.native_gru(X, packed, bias, _states(h0, shape), lens, direction,
                                          layout, hidden, linear_before_reset, projected)


def _shape(sizes: tuple[int, ...], strides: tuple[int, ...], dirs: int, hidden: int,
           direction: int, layout: int, linear_before_reset: int,
           projected: int) -> tuple[_Shape, tuple[int, ...], tuple[int, ...]]:
    """The call's sizes and the strides of x (the input, or with ``projected`` its projections:
    ``sizes``, ``strides``), Y and the states in ONNX's ``layout``; and Y's and the states'
    shapes. Made once a key and kept: the op's own Python is most of its cost at the corpus's
    sizes (gru_tm3's layer of 13 steps, hidden 20: 4.2 us of ctypes and C in a call of 22 us)."""
    key = (sizes, strides, dirs, hidden, direction, layout, linear_before_reset, projected)
    plan = _SHAPES.get(key)
    if plan is None:
        seq, batch = (sizes[1], sizes[0]) if layout else (sizes[0], sizes[1])
        xt, xb = (strides[1], strides[0]) if layout else (strides[0], strides[1])
        if layout:  # Y (batch, seq, dirs, hidden), states (batch, dirs, hidden)
            ys, ss = (dirs * hidden, hidden, seq * dirs * hidden), (hidden, dirs * hidden)
            y, states = (batch, seq, dirs, hidden), (batch, dirs, hidden)
        else:  # Y (seq, dirs, batch, hidden), states (dirs, batch, hidden)
            ys, ss = (dirs * batch * hidden, batch * hidden, hidden), (batch * hidden, hidden)
            y, states = (seq, dirs, batch, hidden), (dirs, batch, hidden)
        plan = _SHAPES[key] = (_Shape(seq, dirs, batch, 0 if projected else sizes[2], hidden,
                                      direction, xt, xb, *ss, *ys, linear_before_reset,
                                      sizes[2] // dirs if projected else 0), y, states)
    return plan


def _empty(shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh float32 tensor, its sizes as separate arguments: 1.25 us from Python against 2.0
    for a tuple of them (1 thread, this AMD EPYC, load 5). Not NumPy's memory (1.3 us): a run's
    output in it is not "fresh" (``runtime/fresh_outputs.py``: not resizable) and the runtime
    searches the inputs and constants for it."""
    return torch.empty(*shape)


def _lstm(x, packed, bias, h0, c0, lens, direction, layout, hidden, projected):
    if x.stride(-1) != 1:
        x = x.contiguous()
    shape, ys, ss = _shape(x.shape, x.stride(), packed.shape[0], hidden, direction, layout, 0,
                           projected)
    y, y_h, y_c = _empty(ys), _empty(ss), _empty(ss)
    if h0 is not None:
        h0 = h0 if h0.is_contiguous() else h0.contiguous()
    if c0 is not None:
        c0 = c0 if c0.is_contiguous() else c0.contiguous()
    if lens is not None:
        lens = lens if lens.is_contiguous() else lens.contiguous()
    if (_FUNCTIONS or _functions())[0](shape, x.data_ptr(), packed.data_ptr(), bias.data_ptr(),
                     None if h0 is None else h0.data_ptr(), None if c0 is None else c0.data_ptr(),
                     None if lens is None else lens.data_ptr(), y.data_ptr(), y_h.data_ptr(),
                     y_c.data_ptr()):
        raise MemoryError("the native LSTM could not allocate its work memory")
    return y, y_h, y_c


def _gru(x, packed, bias, h0, lens, direction, layout, hidden, linear_before_reset, projected):
    if x.stride(-1) != 1:
        x = x.contiguous()
    shape, ys, ss = _shape(x.shape, x.stride(), packed.shape[0], hidden, direction, layout,
                           linear_before_reset, projected)
    y, y_h = _empty(ys), _empty(ss)
    if h0 is not None:
        h0 = h0 if h0.is_contiguous() else h0.contiguous()
    if lens is not None:
        lens = lens if lens.is_contiguous() else lens.contiguous()
    if (_FUNCTIONS or _functions())[1](shape, x.data_ptr(), packed.data_ptr(), bias.data_ptr(),
                     None if h0 is None else h0.data_ptr(),
                     None if lens is None else lens.data_ptr(), y.data_ptr(), y_h.data_ptr()):
        raise MemoryError("the native GRU could not allocate its work memory")
    return y, y_h


_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
_LIBRARY.define("native_lstm(Tensor x, Tensor packed, Tensor bias, Tensor? h0, Tensor? c0, "
                "Tensor? lens, int direction, int layout, int hidden, int projected) "
                "-> (Tensor, Tensor, Tensor)")
_LIBRARY.define("native_gru(Tensor x, Tensor packed, Tensor bias, Tensor? h0, Tensor? lens, "
                "int direction, int layout, int hidden, int linear_before_reset, int projected) "
                "-> (Tensor, Tensor)")
_LIBRARY.impl("native_lstm", _lstm, "CPU")
_LIBRARY.impl("native_gru", _gru, "CPU")
