"""GpuAcc's QLinearConv and QLinearMatMul with constant weights inside a captured subgraph, as
exact float32 sums (``gpu_int8.py`` makes them, and their chains with the QuantizeLinear before and
the DequantizeLinear after).

An 8-bit product's integers (x less its zero point within +-255, the weights less theirs) sum
exactly in float32 wherever every partial sum stays below 2^24 (``EXACT_F32``), in any order; the
kernels (``kernels/quantization.py``) sum in float64, which cuDNN runs at a fraction of float32's
speed: on an H100, resnet_qlinear_ort15's six float64 convolutions were 123 of its replay's 331 us
of kernels. The requantization (float64 product by the float32 multiplier, rounded, plus the zero
point, saturated) is one kernel on CUDA (``gpu_jit.REQUANTIZE``). The values are the kernels' bit
for bit.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch import gpu_jit
from backplane.ir.graph import Layer


def on_gpu(tensor: Any) -> bool:
    """Where these forms run (the tests run them on the CPU through this)."""
    return bool(tensor.is_cuda)


EXACT_F32 = float(1 << 24)
"""Integers of magnitude below 2^24 are exact in float32, and so is every sum of them that stays
below it, in any order: an 8-bit product whose partial sums are bounded so is exact in float32
(TF32 and bf16 products too: 8-bit operands fit their mantissas)."""


def less_zero_point(name: str, zero: str, constants: dict[str, np.ndarray],
                    per: int) -> np.ndarray | None:
    """A constant 8-bit tensor less its constant zero point (None where either is not a constant,
    or not 8-bit), in float64; ``per``: the axis a 1-d zero point runs along."""
    value = constants.get(name)
    if value is None or value.dtype not in (np.uint8, np.int8):
        return None
    if not zero:
        return value.astype(np.float64)
    z = constants.get(zero)
    if z is None or z.dtype != value.dtype:
        return None
    z = z.astype(np.float64)
    if z.size > 1:
        z = z.reshape([-1 if d == per % value.ndim else 1 for d in range(value.ndim)])
    return value.astype(np.float64) - z.reshape(()) if z.size == 1 else value - z


def qlinear_conv(layer: Layer, kernel: Workload, constants: dict[str, np.ndarray],
                 dequantize: tuple[float, float] | None = None) -> Workload | None:
    """QLinearConv with every input but x constant, as ``kernels.quantization.q_linear_conv``
    computes it with its constant parts made once: the convolution of x - zx by the weights less
    their zero points, the bias in it, times the multiplier, rounded, plus zy, saturated. The sum
    is in float32 where every partial sum stays below 2^24 (``EXACT_F32``: resnet_qlinear_ort15's
    six), by torch's own convolution (``_exact_conv``), the requantization one kernel on CUDA
    (``_requantized``); else in float64 (the int32 sum the kernel wraps is exact where it stays
    within int32's range): on an H100 cuDNN's float64 convolutions took most of that model's
    replay. A float32 x is x - zx already (``gpu_int8._int8_chains``); ``dequantize``: the
    (scale, zero point) of the DequantizeLinear that alone reads y, its float32 value the
    output."""
    import torch

    names = [*layer.inputs, ""][:9]
    rest = [n for i, n in enumerate(names) if i != 0 and n]
    if not all(n in constants for n in rest):
        return None
    w = less_zero_point(names[3], names[5], constants, per=0)
    if w is None or w.ndim < 3:
        return None
    bias = constants[names[8]].astype(np.float64) if names[8] else None
    reach = 255 * np.abs(w.reshape(w.shape[0], -1)).sum(1).max(initial=0) \
        + (0 if bias is None else np.abs(bias).max(initial=0))
    if reach >= 2 ** 31:
        return None  # the kernel's int32 sum wraps
    exact32 = bool(reach < EXACT_F32)  # every partial sum an integer below 2^24
    if dequantize is not None and not exact32:
        return None
    wide = np.float32 if exact32 else np.float64
    spatial = [1] * (w.ndim - 2)
    c = {n: torch.from_numpy(np.ascontiguousarray(constants[n])) for n in rest}
    if c[names[2]].numel() != 1 or c[names[7]].numel() != 1:
        return None  # not per-tensor: the kernel's own broadcasting
    w_scale = c[names[4]].float().reshape(-1, *spatial)
    multiplier = c[names[1]].float() * w_scale / c[names[6]].float()  # float32, as the kernel
    zero_y = c[names[7]].reshape(())
    attrs = {k: layer.attrs[k] for k in ("auto_pad", "dilations", "group", "kernel_shape", "pads",
                                         "strides") if k in layer.attrs}
    made = {"w": torch.from_numpy(w.astype(wide)),
            "b": None if bias is None else torch.from_numpy(bias.astype(wide)),
            "m": multiplier if exact32 else multiplier.double(), "zy": zero_y.double()}
    zero_x = float(c[names[2]].reshape(()))
    x_type = c[names[2]].dtype
    info = torch.iinfo(zero_y.dtype)
    kept: dict[str, Any] = {}

    def workload(x: Any, *values: Any) -> tuple[Any, ...]:
        centred = exact32 and x.dtype == torch.float32  # x - zx, from gpu_int8._int8_chains
        if not (on_gpu(x) and (x.dtype == x_type or centred) and x.dim() == w.ndim):
            return kernel(x, *values)  # type: ignore[no-any-return]
        if kept.get("device") != x.device:
            kept.update({k: None if v is None else v.to(x.device) for k, v in made.items()},
                        device=x.device)
        if exact32:
            acc = _exact_conv(x if centred else torch.sub(x, zero_x), kept["w"], kept["b"], attrs)
            return (_requantized(acc, kept["m"], zero_y, dequantize),)
        from backplane.backends.torch.kernels.nn import conv

        (acc,) = conv(torch.sub(x.double(), zero_x), kept["w"], kept["b"], **attrs)
        y = acc.mul_(kept["m"]).round_().add_(kept["zy"])
        return (y.clamp_(info.min, info.max).to(zero_y.dtype),)

    workload.reads_centred = exact32  # type: ignore[attr-defined]
    return workload


_CUDNN_OFF = threading.Lock()
"""torch's cuDNN switch is process-wide: two threads each reading it, switching it off and putting
back what they read could leave it off for every later convolution."""


def _exact_conv(x: Any, w: Any, b: Any, attrs: dict[str, Any]) -> Any:
    """The convolution of integers held in float32 with cuDNN off: torch's own (im2col and one
    cuBLAS product per image) is a plain sum of products, exact in any order where every partial
    sum stays below 2^24, and TF32 holds 8-bit values exactly too; cuDNN may choose a Winograd
    or FFT algorithm, whose transforms round. A capture records the kernels launched here, so
    the switch is turned at the warm-ups and the capture, not at a replay."""
    import torch

    from backplane.backends.torch.kernels.nn import conv

    c = torch._C
    with _CUDNN_OFF:
        was = c._get_cudnn_enabled()
        c._set_cudnn_enabled(False)
        try:
            (acc,) = conv(x, w, b, **attrs)
        finally:
            c._set_cudnn_enabled(was)
    return acc


def _requantized(acc: Any, multiplier: Any, zero_y: Any,
                 dequantize: tuple[float, float] | None = None) -> Any:
    """An exact float32 sum of integers times a float32 multiplier, as the kernels requantize
    it: in float64, rounded half to even, plus the zero point, saturated to its type. One kernel
    and the cast on CUDA (``gpu_jit.REQUANTIZE``); the sum rounded first, as there.
    ``dequantize`` (scale, zero point): that integer's DequantizeLinear instead of the cast, in
    the same kernel (``gpu_jit.REQUANTIZE_DEQUANTIZE``)."""
    import torch

    info = torch.iinfo(zero_y.dtype)
    if acc.is_cuda:
        bounds = {"zy": float(zero_y), "low": info.min, "high": info.max}
        y = (gpu_jit.call(gpu_jit.REQUANTIZE, acc, multiplier, **bounds) if dequantize is None
             else gpu_jit.call(gpu_jit.REQUANTIZE_DEQUANTIZE, acc, multiplier, **bounds,
                               s=dequantize[0], zd=dequantize[1]))
        if y is not None:
            return y.to(zero_y.dtype) if dequantize is None else y
    y = acc.round().double().mul_(multiplier.double()).round_().add_(float(zero_y))
    y = y.clamp_(info.min, info.max)
    if dequantize is None:
        return y.to(zero_y.dtype)
    return y.float().sub_(dequantize[1]).mul_(dequantize[0])


def qlinear_matmul(layer: Layer, kernel: Workload, constants: dict[str, np.ndarray],
                   dequantize: tuple[float, float] | None = None) -> Workload | None:
    """QLinearMatMul with every input but A constant (per-tensor A and output parameters): A less
    its zero point by B less its (made once) as one float32 product, exact where every partial
    sum stays below 2^24, then requantized (``_requantized``), where the kernel sums in float64
    and requantizes in six more (resnet_qlinear_ort15's head). A float32 A and ``dequantize`` as
    ``_qlinear_conv``'s."""
    import torch

    names = [*layer.inputs, ""][:8]
    if not all(n and n in constants for n in names[1:]) \
            or any(constants[names[i]].size != 1 for i in (1, 2, 6, 7)):
        return None
    b = less_zero_point(names[3], names[5], constants, per=-1)
    b_scale = constants[names[4]]
    if b is None or b.ndim != 2 or b_scale.size not in (1, b.shape[1]) \
            or 255 * np.abs(b).sum(0).max(initial=0) >= EXACT_F32:
        return None
    c = {i: torch.from_numpy(np.ascontiguousarray(constants[names[i]]).reshape(-1))
         for i in (1, 4, 6)}
    made = {"b": torch.from_numpy(b.astype(np.float32)),
            "m": c[1].float() * c[4].float() / c[6].float()}  # float32, as the kernel
    zero_a = float(constants[names[2]].reshape(()))
    a_type = torch.from_numpy(np.asarray(constants[names[2]])).dtype
    zero_y = torch.from_numpy(np.ascontiguousarray(constants[names[7]]).reshape(()))
    kept: dict[str, Any] = {}

    def workload(a: Any, *values: Any) -> tuple[Any, ...]:
        centred = a.dtype == torch.float32
        if not (on_gpu(a) and (a.dtype == a_type or centred) and a.dim() >= 2
                and a.shape[-1] == b.shape[0]):
            return kernel(a, *values)  # type: ignore[no-any-return]
        if kept.get("device") != a.device:
            kept.update({k: v.to(a.device) for k, v in made.items()}, device=a.device)
        product = torch.matmul(a if centred else torch.sub(a, zero_a), kept["b"])
        return (_requantized(product, kept["m"], zero_y, dequantize),)

    workload.reads_centred = True  # type: ignore[attr-defined]
    return workload
