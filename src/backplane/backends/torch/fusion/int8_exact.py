"""Whether torch's int8 kernels are exact on this CPU, and the ``CpuAcc.int8`` mode that follows.

With VNNI (AVX512-VNNI, AVX-VNNI) or AMX, a u8 x s8 product's sums are exact in 32 bits. Without
them (AVX2, AVX-512 without VNNI) oneDNN adds pairs of products in 16 bits and saturates: with
``ONEDNN_MAX_CPU_ISA=AVX2`` on this AMD EPYC a QDQ convolution on CpuAcc's int8 route was up to 26
quantization steps off CpuRef's, silently. So where a probe finds the kernels inexact, "auto"
takes the float routes, as "exact" does (CpuRef's values bit for bit); "kernels" stays the
caller's explicit choice.

The matrix products by ``torch._int_mm`` (s8 x s8, int32 sums: the QDQ Gemm / MatMul's int8
route, QGemm's) have a probe of their own, ``exact_int_mm``: on this AVX2 EPYC, whose u8 x s8
convolutions saturate, it sums exactly (random (128, 768) x (768, 768) int8 products equal to
int64 ones), so "kernels" is no warning there for them. But it is slow there, 9-36x float32's
product at 1 thread ((1, 512) x (512, 1000) 747 against 84 us, (16, 256) x (256, 256) 1314 / 62,
(128, 768) x (768, 768) 122 / 3.3 ms: no VNNI, no fast int8 path), so "auto" takes the float
products where the convolutions' probe fails, as it takes the float convolutions.
"""

from __future__ import annotations

import functools
import logging
import warnings

log = logging.getLogger("backplane.torch")


@functools.cache
def exact_kernels() -> bool:
    """Whether torch's quantized convolution and product give the exact sums of u8 x s8 products
    whose pairs overflow 16 bits (255 x 127 x 2 > 32767), probed once per process; False where
    they saturate or torch has no quantized kernels."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation of its quantized tensors
            x = torch.quantize_per_tensor(torch.full((1, 64, 4, 4), 255.0), 1.0, 0, torch.quint8)
            w = torch.quantize_per_tensor(torch.full((8, 64, 1, 1), 127.0), 1.0, 0, torch.qint8)
            packed = torch.ops.quantized.conv2d_prepack(w, None, [1, 1], [0, 0], [1, 1], 1)
            conv = torch.ops.quantized.conv2d(x.contiguous(memory_format=torch.channels_last),
                                              packed, 1e4, 0)
            rows = torch.quantize_per_tensor(torch.full((2, 64), 255.0), 1.0, 0, torch.quint8)
            weights = torch.quantize_per_tensor(torch.full((8, 64), 127.0), 1.0, 0, torch.qint8)
            linear = torch.ops.quantized.linear(
                rows, torch.ops.quantized.linear_prepack(weights, None), 1e4, 0)
    except (RuntimeError, AttributeError) as exc:
        log.debug("no int8 kernels to probe (%s)", exc)
        return False
    want = round(64 * 255 * 127 / 1e4)  # 207: the exact sum, requantized
    exact = all(bool((y.int_repr() == want).all()) for y in (conv, linear))
    if not exact:
        log.info("CpuAcc: this CPU's int8 kernels saturate (no VNNI): QDQ and QOperator layers "
                 "take their float routes (CpuAcc.int8=kernels forces the int8 ones)")
    return exact


@functools.cache
def exact_int_mm() -> bool:
    """Whether ``torch._int_mm``'s int8 x int8 product sums exactly where pairs of products
    overflow 16 bits (-128 x -128 twice is 32768), and where a kernel shifting A to uint8 would
    (127 + 128 = 255, times -128 twice: -65280), probed once per process; False where it
    saturates or is absent."""
    import torch

    rows = torch.full((2, 64), -128, dtype=torch.int8)
    rows[1] = 127
    weights = torch.full((64, 8), -128, dtype=torch.int8)
    try:
        product = torch._int_mm(rows, weights)
    except (RuntimeError, AttributeError) as exc:
        log.debug("no torch._int_mm to probe (%s)", exc)
        return False
    want = rows.long().sum(1, keepdim=True) * -128  # 1048576, -1040384
    return bool((product.long() == want).all())


SATURATING = ("CpuAcc.int8=kernels on a CPU whose int8 kernels saturate (no VNNI): u8 x s8 "
              "products are summed in pairs in 16 bits, so results may be off CpuRef's by many "
              "quantization steps (\"auto\" takes the exact float routes here)")


def mode(asked: str, product: bool = False) -> str:
    """The ``CpuAcc.int8`` mode to follow: "exact" for "auto" where the kernels are not (a CPU
    without VNNI; ``product``s by ``torch._int_mm`` too, exact there but slow). "kernels" stays
    the caller's choice, with a warning where its answers are not CpuRef's (for a ``product``:
    where ``exact_int_mm`` fails)."""
    if asked == "kernels" and not (exact_int_mm() if product else exact_kernels()):
        warnings.warn(SATURATING, RuntimeWarning, stacklevel=2)
    return "exact" if asked == "auto" and not exact_kernels() else asked
