"""A float32 Linear (``fusion/linear.py``'s fused MatMul [+ Add] and Gemm) as one call of C
(``linear.c``) over a weight packed once at load, inside CpuAcc's traces.

Why: at a transformer's sizes (8 to 64 rows of 64 to 1024) torch's products run well below what
this AVX2 machine does: MKL's and oneDNN's, 1 thread, thread CPU, in one process alternating with
ONNX Runtime's Gemm and this C (load 6-7): 32x256 by 256x768 382 (oneDNN packed) / 351 (MKL) /
283 (ORT) / 226 us (C), 32x1024 by 1024x256 568 / 496 / 429 / 352, 32x256 by 256x256 236 / 132 /
145 / 90, 8x64 by 64x192 45.5 / 14.8 / 17.8 / 5.5. The C is ``panel_product.h``'s register tile
over panels of 16 columns (the weight's K rows of 16 floats each), FMAs: 6 rows x 16 outputs in
8-float vectors (AVX2), 12 x 32 in 16-float ones where the CPU has AVX-512 (``rows``), twice the
rate (an AMD EPYC of family 26, 1 thread, thread CPU, torch's MKL / C: 32x256 by 256x768 129 / 50
us, 80x64 by 64x256 27.3 / 11.5). Float32 sums in another order than torch's, a rounding or so
apart (the outputs within the corpus tests' tolerances, not bit for bit).

Where: ``CpuAcc.native`` "auto", a float32 layer on the CPU whose input shape is known, the
library built (``usable``), a session of one thread (``CpuAcc.threads`` 1: the C runs on one;
should torch's count be more at a call, the op takes torch's linear on the plain weight), and at
least ``LARGE`` multiply-adds.
The trace holds one op, ``backplane::native_linear``; a trace for oneDNN Graph's fuser holds
torch's ``linear`` instead (the fuser takes ``aten::linear`` into its partitions).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from backplane.native.build import NativeUnavailable, library

VERSION = 1
"""``linear.c``'s ``backplane_linear_version``."""
NR = 16
"""``linear.c``'s panel width."""
LARGE = 1 << 20
"""The fewest multiply-adds a layer runs in C: below, the op's Python body (the output made, the
pointers read, the ctypes call: ~5-10 us) costs what the C saves over MKL's addmm (8x64 by 64x192
on Static Runtime, 1 thread, load 7: addmm 21.2, this op 22.5 us; the small tier's transformers
ran slower with it)."""
WIDE_ROWS = 12
"""``backplane_linear_rows()`` of a library built with AVX-512's tile (``panel_product.h``)."""
_FUNCTIONS: list[Any] = []
_ROWS: list[int] = []


def _functions() -> list[Any]:
    """(pack, product), typed (raises ``NativeUnavailable``)."""
    if not _FUNCTIONS:
        lib = library("linear", VERSION)
        pointer, size = ctypes.c_void_p, ctypes.c_long
        lib.backplane_linear_pack.argtypes = [pointer, size, size, pointer]
        lib.backplane_linear_pack.restype = None
        lib.backplane_linear.argtypes = [pointer, size, size, pointer, size, pointer, pointer]
        lib.backplane_linear.restype = None
        _FUNCTIONS[:] = [lib.backplane_linear_pack, lib.backplane_linear]
    return _FUNCTIONS


def rows() -> int:
    """The library's tile rows: 12 built with AVX-512, 6 with AVX2 or without (raises
    ``NativeUnavailable``)."""
    if not _ROWS:
        _functions()
        _ROWS.append(library("linear", VERSION).backplane_linear_rows())
    return _ROWS[0]


def usable(mode: str) -> bool:
    """Whether Linear layers run natively: ``CpuAcc.native`` ``mode`` "auto" and the library
    here."""
    if mode != "auto":
        return False
    try:
        _functions()
    except NativeUnavailable:
        return False
    return True


def pack(weight: Any, bias: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (N, K) float32 weight in panels as the C reads it, and the bias padded to whole
    panels (or None)."""
    w = np.ascontiguousarray(np.asarray(weight, np.float32))
    n, k = w.shape
    panels = -(-n // NR)
    packed = torch.empty(panels * k * NR)
    _functions()[0](w.ctypes.data, n, k, packed.data_ptr())
    padded = None
    if bias is not None:
        padded = torch.zeros(panels * NR)
        padded[:n] = torch.as_tensor(np.asarray(bias, np.float32).reshape(-1))
    return packed, padded


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
            weight: torch.Tensor, plain_bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    if x.dtype != torch.float32 or x.shape[-1] != k:
        return torch.nn.functional.linear(x, weight, plain_bias)
    rows = x.numel() // k if k else 0
    if not rows or torch.get_num_threads() > 1:  # the C runs on one thread
        return torch.nn.functional.linear(x, weight, plain_bias)
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty((*x.shape[:-1], n))
    (_FUNCTIONS or _functions())[1](x.data_ptr(), rows, k, packed.data_ptr(), n,
                                    None if bias is None else bias.data_ptr(), y.data_ptr())
    return y


def _abstract(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
              weight: torch.Tensor, plain_bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
_LIBRARY.define("native_linear(Tensor x, Tensor packed, Tensor? bias, Tensor weight, "
                "Tensor? plain_bias) -> Tensor")
_LIBRARY.impl("native_linear", _linear, "CPU")
_LIBRARY.impl("native_linear", _abstract, "Meta")


def product(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """x -> x weight^T + bias by the C (one op in a trace), torch's linear in a trace for oneDNN
    Graph's fuser."""
    from backplane.backends.torch.kernels.common import for_onednn_graph

    packed, padded = pack(weight.numpy(), None if bias is None else bias.numpy())
    op = torch.ops.backplane.native_linear

    def run(x: torch.Tensor) -> torch.Tensor:
        if for_onednn_graph():
            return torch.nn.functional.linear(x, weight, bias)
        return op(x, packed, padded, weight, bias)
    run.packed = packed  # type: ignore[attr-defined]
    return run
