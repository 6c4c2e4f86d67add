"""A float32 ScaledDotAttention (``fusion/attention.py``: Q K^T scaled, masked, softmax, times V)
as one call of C (``attention.c``) inside CpuAcc's traces.

Why: torch runs the layer as ``baddbmm``, ``softmax`` and ``bmm`` over a (heads, L, S) tensor of
scores, written and read again by each, then a copy that merges the heads. The C keeps a block of
8 query rows' scores in L1 from the product to the softmax to the product with V, never computes
the keys a causal mask hides (each is the fill: half a GPT's products), and writes the output in
the merged-heads layout (``MERGED``), so that the exporter's Transpose and Reshape after it are
views. The full tier's tagger (4 heads, L = S = 128, head size 16, a padding mask), 1 thread,
thread CPU, load 8-12: torch's ops 92-98 us a layer, this op 67 with its kernel in C
(``attention_op.h``), 73 with the kernel in Python. Float32 sums in another order than torch's,
a rounding or so apart.

Where: ``CpuAcc.native`` "auto", float32 on the CPU, the library built (``usable``); in a trace
the op ``backplane::native_attention_c``, whose kernel is the C itself where torch has its stable
C ABI (``in_c``; else, and for operands the C does not take, ``backplane::native_attention``,
the kernel in Python). On the calling thread, at any thread count: a call's items run on
torch's own OpenMP team (libgomp's GOMP_parallel, handed to the C) ran the tagger at 44 ms a
run instead of 2.7 where the team was forced to two threads at load 9 (a region's end waits for
a thread the scheduler has not run), 780-1020 us a call against 154 at load 4, and in a test
process the team's second thread sometimes took no item at all (left for a quiet machine to
measure: the docs' open items).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from typing import Any

import torch

from backplane.native import stable_abi
from backplane.native.build import NativeUnavailable, library

log = logging.getLogger("backplane.native")

VERSION = 3
"""``attention.c``'s ``backplane_attention_version``."""
NO_DIAGONAL = (1 << 63) - 1
"""``attention.c``'s NO_DIAGONAL: no causal diagonal."""
_FUNCTIONS: list[Any] = []
_PLANS: dict[tuple[Any, ...], Plan | None] = {}
"""The plans made, by the operands' shapes and strides and the layer's constants (None: torch's
ops take those operands)."""
MOST_PLANS = 256
"""Plans kept at most (then the dict starts again: a session of many signatures)."""
POINTERS = 6
"""A plan's first values, the pointers a call writes: q, k, v, mask, cond, out."""
ARGUMENTS = 34
"""A plan's values (``attention.c``'s A_COUNT)."""
ABI = ("aoti_torch_get_data_ptr", "aoti_torch_get_dim", "aoti_torch_get_numel",
       "aoti_torch_get_sizes", "aoti_torch_get_strides", "aoti_torch_get_dtype",
       "aoti_torch_get_device_type", "aoti_torch_empty_strided", "aoti_torch_delete_tensor_object",
       "aoti_torch_call_dispatcher", "aoti_torch_check",
       "torch_exception_get_what_without_backtrace")
"""The functions of torch's stable C ABI ``backplane_attention_op`` calls, in the order
``backplane_attention_bind`` reads them (then the float32 and bool dtype codes and the CPU's
device code); the last, an error's message, may be missing (torch before 2.10)."""
_LOCK = threading.Lock()
_BOUND: list[Any] = []
"""The torch::Library holding the C kernel (never freed), or empty where torch has no stable ABI."""



def _function() -> Any:
    """``backplane_attention``, typed, the op's C kernel registered first (raises
    ``NativeUnavailable``)."""
    if not _FUNCTIONS:
        with _LOCK:  # one registration (CpuAcc's background threads load too)
            if not _FUNCTIONS:
                lib = library("attention", VERSION)
                if lib.backplane_attention_arguments() != ARGUMENTS:
                    raise NativeUnavailable("the attention library's plan is not this module's")
                typed(lib)
                handle = register(lib, "native_attention_c")
                _BOUND.extend([] if handle is None else [handle])
                _FUNCTIONS.append(lib.backplane_attention)
    return _FUNCTIONS[0]


def register(lib: ctypes.CDLL, name: str) -> ctypes.c_void_p | None:
    """``lib``'s ``backplane_attention_op`` as the CPU kernel of ``backplane::name``, the stable
    ABI's functions handed to ``lib`` first (``ABI``, ``native/stable_abi``): the torch::Library
    holding it (kept: freeing it drops the kernel), or None where torch lacks them (the op's
    Python kernel stays)."""
    calls = stable_abi.addresses(ABI[:-1], optional=ABI[-1:])
    codes = stable_abi.codes(["aoti_torch_dtype_float32", "aoti_torch_dtype_bool",
                              "aoti_torch_device_type_cpu"])
    if calls is None or codes is None:
        log.debug("backplane::%s keeps its Python kernel: no stable ABI here", name)
        return None
    lib.backplane_attention_bind((ctypes.c_int64 * (len(calls) + 3))(*calls, *codes))
    kernel = ctypes.cast(lib.backplane_attention_op, ctypes.c_void_p).value
    return stable_abi.register(kernel or 0, "backplane", name)


def in_c() -> bool:
    """Whether ``backplane::native_attention_c``'s kernel is the C, not its Python one."""
    try:
        _function()
    except NativeUnavailable:
        return False
    return bool(_BOUND)


def typed(lib: ctypes.CDLL) -> Any:
    """``lib``'s (a build's) ``backplane_attention``, typed."""
    lib.backplane_attention.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.backplane_attention.restype = ctypes.c_int
    return lib.backplane_attention


def usable(mode: str) -> bool:
    """Whether ScaledDotAttention layers run natively: ``CpuAcc.native`` ``mode`` "auto" and the
    library here."""
    if mode != "auto":
        return False
    try:
        _function()
    except NativeUnavailable:
        return False
    return True


class Plan:
    """One signature's call: the C's arguments (``attention.c``'s A_*: the pointers first,
    written at each call, then sizes and strides), fill and alpha, the output's shape and the
    permutation that makes the result of it."""

    __slots__ = ("values", "floats", "shape", "order")

    def __init__(self, values: list[int], floats: tuple[float, float], shape: tuple[int, ...],
                 order: tuple[int, ...] | None) -> None:
        self.values = (ctypes.c_int64 * len(values))(*values)
        self.floats = (ctypes.c_float * 2)(*floats)
        self.shape, self.order = shape, order


def _strides(x: torch.Tensor | None, batch: tuple[int, ...],
             tail: tuple[int, int] | None = None) -> list[int]:
    """(batch, head, row, column) strides of ``x`` (..., R, C) broadcast to ``batch`` + ``tail``
    (its own (R, C) where None) as (B, H): the batch's leading axes flattened into B, the last
    batch axis H; zeros where it broadcasts (``_NotFlat`` where they do not flatten)."""
    if x is None:
        return [0, 0, 0, 0]
    x = x.expand(*batch, *(tail or x.shape[-2:]))
    sizes, strides = x.shape, x.stride()
    lead = [(n, s) for n, s in zip(sizes[:-3], strides[:-3]) if n != 1]
    if any(s0 != s1 * n1 for (_, s0), (n1, s1) in zip(lead, lead[1:])):
        raise _NotFlat
    return [lead[-1][1] if lead else 0, *strides[-3:]]


class _NotFlat(Exception):
    """An operand's batch axes do not flatten as a view: torch's ops take the call."""


def plan_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          cond: torch.Tensor | None, invert: int, diagonal: int, fill: float,
          alpha: float) -> Plan | None:
    """The plan of these operands, or None where the C does not take them (a last axis not
    contiguous, batch axes that do not flatten, another dtype)."""
    batch, (L, E), (S, Ev) = tuple(q.shape[:-2]), q.shape[-2:], v.shape[-2:]
    if not batch or any(x.stride(-1) != 1 and x.shape[-1] != 1 for x in (q, k, v)) or \
            any(x.dtype != torch.float32 for x in (q, k, v)) or \
            (mask is not None and (mask.dtype != torch.float32)) or \
            (cond is not None and cond.dtype != torch.bool):
        return None
    B, H = math.prod(batch[:-1]), batch[-1]
    shape, order = MERGED.get(len(batch), lambda *_: ((*batch, L, Ev), None))(*batch, L, Ev)
    out = torch.empty(shape) if order is None else torch.empty(shape).permute(order)
    try:
        parts = [*(_strides(x, batch) for x in (q, k, v)),
                 *(_strides(x, batch, (L, S)) for x in (mask, cond)), _strides(out, batch)]
    except _NotFlat:
        return None
    (qs, ks, vs, ms, cs, os_) = parts
    values = [0] * POINTERS + [B, H, L, S, E, Ev, *qs[:3], *ks[:3], *vs[:3], *ms, *cs,
                               *os_[:3], invert, diagonal]
    return Plan(values, (fill, alpha), shape, order)


MERGED = {1: lambda h, L, Ev: ((L, h, Ev), (1, 0, 2)),
          2: lambda b, h, L, Ev: ((b, L, h, Ev), (0, 2, 1, 3))}
"""The output's memory by q's batch axes, and the permutation that makes the (..., L, Ev) result
of it: the heads side by side in each row, as the exporters' Transpose then Reshape read it
(torch.nn.MultiheadAttention's (B H, L, E) and the written-out (B, H, L, E)), so that those are
views, not a copy; other batch ranks contiguous."""


def call(function: Any, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         mask: torch.Tensor | None, cond: torch.Tensor | None) -> torch.Tensor:
    """The attention of ``plan`` (made for these operands' shapes and strides) by ``function``
    (``backplane_attention`` of a build: the session's, or another CPU's in the tests)."""
    out = torch.empty(plan.shape)
    values = plan.values
    values[0], values[1], values[2] = q.data_ptr(), k.data_ptr(), v.data_ptr()
    values[3] = 0 if mask is None else mask.data_ptr()
    values[4] = 0 if cond is None else cond.data_ptr()
    values[5] = out.data_ptr()
    if function(values, plan.floats):
        raise MemoryError("native attention: its work memory was not had")
    return out if plan.order is None else out.permute(plan.order)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               cond: torch.Tensor, invert: int, diagonal: int, fill: float,
               alpha: float) -> torch.Tensor:
    """The op's kernel in Python (ctypes around the same C): the op where torch has no stable
    ABI, and the C kernel's route for operands it does not take. An empty mask or cond: none."""
    mask = mask if mask.numel() else None
    cond = cond if cond.numel() else None
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
           None if mask is None else (mask.shape, mask.stride(), mask.dtype),
           None if cond is None else (cond.shape, cond.stride(), cond.dtype),
           q.dtype, k.dtype, v.dtype, invert, diagonal, fill, alpha)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= MOST_PLANS:
            _PLANS.clear()
        plan = _PLANS.setdefault(key, plan_of(q, k, v, mask, cond, invert, diagonal, fill, alpha))
    if plan is None:
        return _merged(_torch_attention(q, k, v, mask, cond, invert, diagonal, fill, alpha))
    return call(_FUNCTIONS[0] if _FUNCTIONS else _function(), plan, q, k, v, mask, cond)


def _merged(result: torch.Tensor) -> torch.Tensor:
    """``result`` (..., L, Ev) in the layout a plan's output has (``MERGED``), whichever route
    made it: a trace records the views after the op (the exporters' Transpose and Reshape) for
    that layout, and inductor's fake kernel (``_abstract``) gives it too."""
    *batch, L, Ev = result.shape
    if len(batch) not in MERGED:
        return result
    shape, order = MERGED[len(batch)](*batch, L, Ev)
    out = result.new_empty(shape).permute(order)
    out.copy_(result)
    return out


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, cond: torch.Tensor | None, invert: int,
                     diagonal: int, fill: float, alpha: float) -> torch.Tensor:
    """The same in torch's ops, for operands the C does not take."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * alpha
    if mask is not None:
        scores = scores + mask
    elif cond is not None:
        scores = scores.masked_fill(cond if not invert else ~cond, fill)
    elif diagonal != NO_DIAGONAL:
        L, S = scores.shape[-2:]
        hidden = torch.ones(L, S, dtype=torch.bool, device=scores.device).triu(diagonal)
        scores = scores.masked_fill(hidden, fill)
    return torch.matmul(torch.softmax(scores, -1), v)


def _abstract(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              cond: torch.Tensor, invert: int, diagonal: int, fill: float,
              alpha: float) -> torch.Tensor:
    batch, L, Ev = q.shape[:-2], q.shape[-2], v.shape[-1]
    if len(batch) not in MERGED:
        return q.new_empty((*batch, L, Ev))
    shape, order = MERGED[len(batch)](*batch, L, Ev)
    return q.new_empty(shape).permute(order)  # the layout the kernels give (``_merged``)


SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor cond, int invert, int diagonal, "
          "float fill, float alpha) -> Tensor")
"""Both ops' arguments: no mask or condition is an empty tensor (the stable ABI's kernel takes
no optional tensor)."""
_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
for _name in ("native_attention", "native_attention_c"):
    _LIBRARY.define(_name + SCHEMA)
    _LIBRARY.impl(_name, _abstract, "Meta")
_LIBRARY.impl("native_attention", _attention, "CPU")
_NONE = torch.empty(0)


def scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           cond: torch.Tensor | None = None, invert: bool = False, diagonal: int | None = None,
           fill: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
    """softmax(alpha Q K^T masked) V of float32 q (..., L, E), k (..., S, E) (K, not its
    transpose), v (..., S, Ev) of one batch shape; ``mask`` added to the scores, or ``cond``
    (bool) putting ``fill`` where it is true (false with ``invert``), or ``diagonal``: keys j >=
    i + diagonal take ``fill`` (a causal condition); masks (..., L, S) broadcast over the batch.
    The result (..., L, Ev), for a batch of one or two axes a view of the merged-heads layout
    (``MERGED``). The op's kernel is the C where the stable ABI is here (``in_c``)."""
    op = torch.ops.backplane.native_attention_c if in_c() else torch.ops.backplane.native_attention
    return op(q, k, v, _NONE if mask is None else mask, _NONE if cond is None else cond,
              int(invert), NO_DIAGONAL if diagonal is None else int(diagonal), float(fill),
              float(alpha))
