"""A dynamically quantized MatMul (``fusion/dynamic_quant.py``'s ``DynamicQuantMatMul``) as one
call of C (``dynquant.c``) inside CpuAcc's traces: x's range, scale and zero point, x quantized and
centred, its product with the centred weight, the scales and the bias.

Why: in torch ops the layer is about 20 trace ops (the grid's 14 on 0-d tensors, the product's
and the scales'), 1-3 us each on tensors of a few hundred values, where ONNX Runtime's
DynamicQuantizeMatMul is one kernel: the small tier's quantized GPT (nine such layers) ran at
twice its float twin's time. Its products stay exact (the sums MatMulInteger's int32 ones), so
the outputs are CpuRef's, bit for bit, as the torch route's are.

Where: a layer on the CPU in float32 under ``CpuAcc.native`` "auto" where the library builds
(``usable``); the trace holds one op, ``backplane::dynamic_quant_matmul``, whose CPU kernel calls
the C function on the tensors' memory. Where x's range is not finite (a NaN or an infinity), the
kernel takes torch's route (``dynamic_grid``: CpuRef's NaN case) instead.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from backplane.native.build import NativeUnavailable, library

VERSION = 1
"""``dynquant.c``'s ``backplane_dynquant_version``."""
_FUNCTIONS: list[Any] = []


def _function() -> Any:
    """The C function, typed (raises ``NativeUnavailable``)."""
    if not _FUNCTIONS:
        lib = library("dynquant", VERSION)
        function = lib.backplane_dynquant_matmul
        pointer, size = ctypes.c_void_p, ctypes.c_long
        function.argtypes = [pointer, size, size, pointer, size, pointer, size, pointer, pointer]
        function.restype = ctypes.c_int
        _FUNCTIONS.append(function)
    return _FUNCTIONS[0]


def usable(mode: str) -> bool:
    """Whether the layer runs natively: ``CpuAcc.native`` ``mode`` "auto" and the library here."""
    if mode != "auto":
        return False
    try:
        _function()
    except NativeUnavailable:
        return False
    return True


def weight_by_columns(weight: Any) -> torch.Tensor:
    """The fusion's (N, K) centred weight as the C reads it: (K, N), row-major."""
    return torch.from_numpy(weight).t().float().contiguous()


def _matmul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    depth, cols = weight.shape
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty((*x.shape[:-1], cols))
    rows = x.numel() // depth if depth else 0
    if not x.numel():
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    if rows:
        function = _FUNCTIONS[0] if _FUNCTIONS else _function()
        code = function(x.data_ptr(), rows, depth, weight.data_ptr(), cols, w_scale.data_ptr(),
                        w_scale.numel(), None if bias is None else bias.data_ptr(), y.data_ptr())
        if code == 0:
            return y
        if code == 2:
            raise MemoryError("the native dynamic quantized product could not allocate")
    return _torch_route(x, weight, w_scale, bias)


def _torch_route(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """CpuRef's steps on tensors (``dynamic_grid``: a NaN in x makes the scale 1 and the zero
    point 0), where x's range is not finite or x is empty."""
    from backplane.backends.torch.kernels.contrib_quant import dynamic_grid

    centred, scale = dynamic_grid(x)
    y = torch.matmul(centred, weight).mul_(w_scale * scale)
    return y.add_(bias) if bias is not None else y


def _abstract(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[1]))


_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
_LIBRARY.define("dynamic_quant_matmul(Tensor x, Tensor weight, Tensor w_scale, Tensor? bias) "
                "-> Tensor")
_LIBRARY.impl("dynamic_quant_matmul", _matmul, "CPU")
_LIBRARY.impl("dynamic_quant_matmul", _abstract, "Meta")


def matmul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's product, scales and bias: the op (one op in a trace)."""
    return torch.ops.backplane.dynamic_quant_matmul(x, weight, w_scale, bias)
