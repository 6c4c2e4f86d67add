"""A dynamically quantized MatMul (``fusion/dynamic_quant.py``'s ``DynamicQuantMatMul``) as one
call of C (``dynquant.c``) inside CpuAcc's traces: x's range, scale and zero point, x quantized and
centred, its product with the centred weight, the scales and the bias.

Why: in torch ops the layer is about 20 trace ops (the grid's 14 on 0-d tensors, the product's
and the scales'), 1-3 us each on tensors of a few hundred values, where ONNX Runtime's
DynamicQuantizeMatMul is one kernel: the small tier's quantized GPT (nine such layers) ran at
twice its float twin's time. Its products stay exact (the sums MatMulInteger's int32 ones), so
the outputs are CpuRef's, bit for bit, as the torch route's are.

Where: a layer on the CPU in float32 under ``CpuAcc.native`` "auto" where the library builds
(``usable``); the trace holds one op, ``backplane::dynamic_quant_matmul_c``, whose CPU kernel is
the C itself (``backplane_dynquant_op``), called by torch's dispatcher without Python: a boxed
kernel of torch's stable C ABI (``stable_abi``: its functions handed to the C as addresses read
from libtorch, so the C is still built without torch's headers).
The op's kernel in Python (``backplane::dynamic_quant_matmul``: ctypes around the same C) cost
~5 us a call around ~0.4 us of product, the quantized GPT's seven calls about a third of its run.
Where the C does not take x (not float32 on the CPU, not contiguous, empty, or its range not
finite: a NaN or an infinity), it hands the call on to that Python op, which takes torch's route
(``dynamic_grid``: CpuRef's NaN case); a torch without the stable ABI's functions runs the Python
op throughout.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

from backplane.native import stable_abi
from backplane.native.build import NativeUnavailable, library

VERSION = 4
"""``dynquant.c``'s ``backplane_dynquant_version``."""
_FUNCTIONS: list[Any] = []
_LOCK = threading.Lock()
ABI = ("aoti_torch_get_data_ptr", "aoti_torch_get_dim", "aoti_torch_get_numel",
       "aoti_torch_get_sizes", "aoti_torch_is_contiguous", "aoti_torch_get_dtype",
       "aoti_torch_get_device_type", "aoti_torch_empty_strided", "aoti_torch_delete_tensor_object",
       "aoti_torch_call_dispatcher", "aoti_torch_check",
       "torch_exception_get_what_without_backtrace")
"""The functions of torch's stable C ABI ``backplane_dynquant_op`` calls, in the order
``backplane_dynquant_bind`` reads them (then the float32 and int8 dtype codes and the CPU's device
code); the last, an error's message, may be missing (torch before 2.10)."""
_BOUND: list[Any] = []
"""The torch::Library holding the C kernel (never freed: freeing it drops the kernel), or empty
where torch has no stable ABI here."""
BYTES_DEPTH = 65_000
"""The longest product on bytes: 255 * 128 * depth stays within int32 (vpdpbusd's sums)."""


def _function() -> Any:
    """The C functions, typed: the float product's, then the one on bytes (or None where the
    library is built without VNNI). Raises ``NativeUnavailable``."""
    if not _FUNCTIONS:
        with _LOCK:  # one registration of the C kernel (CpuAcc's background threads load too)
            if not _FUNCTIONS:
                _load()
    return _FUNCTIONS[0]


def _load() -> None:
    """``_FUNCTIONS`` filled from the library, its op kernel registered first (``_bind``)."""
    lib = library("dynquant", VERSION)
    pointer, size = ctypes.c_void_p, ctypes.c_long
    found = []
    for name in ("backplane_dynquant_matmul", "backplane_dynquant_bytes"):
        function = getattr(lib, name)
        function.argtypes = [pointer, size, size, pointer, size, pointer, size, pointer, pointer]
        function.restype = ctypes.c_int
        found.append(function)
    at = lib.backplane_dynquant_bytes_at
    at.argtypes = [pointer, size, pointer, pointer]
    at.restype = ctypes.c_int
    found.append(at)
    if not lib.backplane_dynquant_has_bytes():
        found[1] = found[2] = None
    _bind(lib)
    _FUNCTIONS.extend(found)


def _bind(lib: ctypes.CDLL) -> None:
    """The C kernel registered as ``backplane::dynamic_quant_matmul_c``'s CPU kernel; nothing
    where this torch lacks the stable ABI's functions (the Python op runs instead)."""
    handle = register(lib, "backplane", "dynamic_quant_matmul_c")
    if handle is not None:
        _BOUND.append(handle)


def register(lib: ctypes.CDLL, namespace: str, name: str) -> ctypes.c_void_p | None:
    """``lib``'s ``backplane_dynquant_op`` as the CPU kernel of the op ``namespace::name`` (defined
    with ``SCHEMA``), the stable ABI's functions handed to ``lib`` first: the torch::Library
    holding it (keep it: freeing it drops the kernel), or None where torch lacks them."""
    calls = stable_abi.addresses(ABI[:-1], optional=ABI[-1:])
    codes = stable_abi.codes(["aoti_torch_dtype_float32", "aoti_torch_dtype_int8",
                              "aoti_torch_device_type_cpu"])
    if calls is None or codes is None:
        return None
    lib.backplane_dynquant_bind((ctypes.c_int64 * (len(calls) + 3))(*calls, *codes))
    kernel = ctypes.cast(lib.backplane_dynquant_op, ctypes.c_void_p).value
    return stable_abi.register(kernel or 0, namespace, name)


def in_c() -> bool:
    """Whether the op's kernel is the C (``backplane_dynquant_op``), not its Python one."""
    try:
        _function()
    except NativeUnavailable:
        return False
    return bool(_BOUND)


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


def _op(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor,
        residual: torch.Tensor, depth: int, cols: int) -> torch.Tensor:
    """``backplane::dynamic_quant_matmul``'s kernel in Python (ctypes): the op where the stable
    ABI is not here, and the C kernel's route for the x it does not take."""
    if x.shape[-1:] != (depth,):
        raise ValueError(f"x of shape {tuple(x.shape)} for a product of depth {depth}")
    if not _FUNCTIONS:
        _function()
    added = bias if bias.numel() else None
    if weight.dtype == torch.int8:
        y = _matmul_bytes(x, weight, w_scale, added, depth, cols)
    else:
        y = _matmul(x, weight, w_scale, added)
    if residual.numel():
        if residual.shape != y.shape:
            raise ValueError(f"a residual of shape {tuple(residual.shape)} added to a product "
                             f"of shape {tuple(y.shape)}")
        y = y.add_(residual)
    return y


def _matmul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    depth, cols = weight.shape
    x = x if x.is_contiguous() and x.dtype == torch.float32 else x.contiguous().float()
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
    x = x if x.is_contiguous() and x.dtype == torch.float32 else x.contiguous().float()
    y = torch.empty((*x.shape[:-1], cols))
    rows = x.numel() // depth if depth else 0
    if rows and _FUNCTIONS[2] is not None:
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


def _abstract(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor,
              residual: torch.Tensor, depth: int, cols: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], cols), dtype=torch.float32)


SCHEMA = ("(Tensor x, Tensor weight, Tensor w_scale, Tensor bias, Tensor residual, int depth, "
          "int cols) -> Tensor")
"""Both ops': the weight float32 (depth, cols) or ``pack``'s bytes, no bias or residual an empty
tensor (the stable ABI's kernel takes no optional tensor); the residual, of the result's shape,
added last (the graph's Add after the product)."""
_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
for _name in ("dynamic_quant_matmul", "dynamic_quant_matmul_c"):
    _LIBRARY.define(_name + SCHEMA)
    _LIBRARY.impl(_name, _abstract, "Meta")
_LIBRARY.impl("dynamic_quant_matmul", _op, "CPU")  # dynamic_quant_matmul_c's: the C (``_bind``)
_NONE = torch.empty(0)


def matmul(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, int, int],
           w_scale: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's product, scales, bias and residual: the op (one op in a trace), its kernel the
    C where ``in_c``; ``weight`` as ``weight_by_columns`` made it."""
    tensor, depth, cols = weight if isinstance(weight, tuple) else (weight, *weight.shape)
    op = torch.ops.backplane.dynamic_quant_matmul_c if _BOUND else \
        torch.ops.backplane.dynamic_quant_matmul
    return op(x, tensor, w_scale, _NONE if bias is None else bias,
              _NONE if residual is None else residual, depth, cols)
