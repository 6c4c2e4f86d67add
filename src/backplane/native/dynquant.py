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

import numpy as np
import torch

from backplane.native.build import NativeUnavailable, library

VERSION = 3
"""``dynquant.c``'s ``backplane_dynquant_version``."""
_FUNCTIONS: list[Any] = []
BYTES_DEPTH = 65_000
"""The longest product on bytes: 255 * 128 * depth stays within int32 (vpdpbusd's sums)."""


def _function() -> Any:
    """The C functions, typed: the float product's, then the one on bytes (or None where the
    library is built without VNNI). Raises ``NativeUnavailable``."""
    if not _FUNCTIONS:
        lib = library("dynquant", VERSION)
        pointer, size = ctypes.c_void_p, ctypes.c_long
        found = []
        for name in ("backplane_dynquant_matmul", "backplane_dynquant_bytes"):
            function = getattr(lib, name)
            function.argtypes = [pointer, size, size, pointer, size, pointer, size, pointer,
                                 pointer]
            function.restype = ctypes.c_int
            found.append(function)
        at = lib.backplane_dynquant_bytes_at
        at.argtypes = [pointer, size, pointer, pointer]
        at.restype = ctypes.c_int
        found.append(at)
        if not lib.backplane_dynquant_has_bytes():
            found[1] = found[2] = None
        _FUNCTIONS.extend(found)
    return _FUNCTIONS[0]


def on_bytes() -> bool:
    """Whether the library here multiplies bytes (AVX-512 VNNI: ``backplane_dynquant_bytes``)."""
    try:
        _function()
    except NativeUnavailable:
        return False
    return _FUNCTIONS[1] is not None


def usable(mode: str) -> bool:
    """Whether the layer runs natively: ``CpuAcc.native`` ``mode`` "auto" and the library here."""
    if mode != "auto":
        return False
    try:
        _function()
    except NativeUnavailable:
        return False
    return True


def weight_by_columns(weight: Any) -> torch.Tensor | tuple[torch.Tensor, int, int]:
    """The fusion's (N, K) centred weight as the C reads it: (K, N) float32, row-major; or, where
    the library multiplies bytes and every value is a signed byte, ``pack``'s (bytes, K, N)."""
    values = np.asarray(weight)
    cols, depth = values.shape
    if on_bytes() and depth <= BYTES_DEPTH and values.size and \
            -128 <= int(values.min()) and int(values.max()) <= 127:
        return pack(values), depth, cols
    return torch.from_numpy(values).t().float().contiguous()


def pack(weight: np.ndarray) -> torch.Tensor:
    """An (N, K) weight of signed bytes for ``backplane_dynquant_bytes``: [ceil(N / 16)]
    [ceil(K / 4)][16][4] int8, zero past K and N, then each column's sum as int32 bytes."""
    cols, depth = weight.shape
    blocks, quads = -(-cols // 16), -(-depth // 4)
    padded = np.zeros((blocks * 16, quads * 4), np.int8)
    padded[:cols, :depth] = weight
    tiles = padded.reshape(blocks, 16, quads, 4).transpose(0, 2, 1, 3).reshape(-1)
    sums = padded.astype(np.int32).sum(1, dtype=np.int32)
    return torch.from_numpy(np.concatenate([tiles, sums.view(np.int8)]).copy())


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


def _matmul_bytes(x: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, depth: int, cols: int) -> torch.Tensor:
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty((*x.shape[:-1], cols))
    rows = x.numel() // depth if depth else 0
    if rows:
        held = getattr(packed, LAYER, None)
        if held is None or held[1] is not w_scale or held[2] is not bias:
            held = _layer(packed, w_scale, bias, depth, cols)
        code = _FUNCTIONS[2](x.data_ptr(), rows, held[0], y.data_ptr())
        if code == 0:
            return y
        if code == 2:
            raise MemoryError("the native dynamic quantized product could not allocate")
    if not x.numel():
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    return _torch_route(x, unpack(packed, depth, cols), w_scale, bias)


LAYER = "_backplane_dynquant_layer"
"""The attribute of a packed weight holding its layer's constants for ``backplane_dynquant_bytes_at``
(made at its first call: the tensors a trace passes are its constants, the same objects each call)."""


def _layer(packed: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, depth: int,
           cols: int) -> tuple[int, torch.Tensor, torch.Tensor | None, Any]:
    """(the constants' array's address, w_scale, bias, the array), set on ``packed``: the array
    holds the three tensors' addresses, and the tuple holds the tensors, so they outlive it."""
    values = (ctypes.c_int64 * 6)(packed.data_ptr(), depth, cols, w_scale.data_ptr(),
                                  w_scale.numel(), 0 if bias is None else bias.data_ptr())
    held = (ctypes.addressof(values), w_scale, bias, values)
    setattr(packed, LAYER, held)
    return held


def unpack(packed: torch.Tensor, depth: int, cols: int) -> torch.Tensor:
    """``pack``'s weight as the float path's (K, N) float32."""
    blocks, quads = -(-cols // 16), -(-depth // 4)
    tiles = packed[:blocks * quads * 64].reshape(blocks, quads, 16, 4).permute(0, 2, 1, 3)
    return tiles.reshape(blocks * 16, quads * 4)[:cols, :depth].t().float().contiguous()


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
_LIBRARY.define("dynamic_quant_matmul_bytes(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias, "
                "int depth, int cols) -> Tensor")
_LIBRARY.impl("dynamic_quant_matmul_bytes", _matmul_bytes, "CPU")
_LIBRARY.impl("dynamic_quant_matmul_bytes",
              lambda x, packed, w_scale, bias, depth, cols: x.new_empty((*x.shape[:-1], cols)),
              "Meta")


def matmul(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, int, int],
           w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's product, scales and bias: the op (one op in a trace); ``weight`` as
    ``weight_by_columns`` made it."""
    if isinstance(weight, tuple):
        return torch.ops.backplane.dynamic_quant_matmul_bytes(x, weight[0], w_scale, bias,
                                                              weight[1], weight[2])
    return torch.ops.backplane.dynamic_quant_matmul(x, weight, w_scale, bias)
