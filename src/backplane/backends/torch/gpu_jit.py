"""GpuAcc's elementwise chains as one CUDA kernel each, compiled by torch's jiterator (NVRTC).

Inside a captured graph every kernel costs its 1-2 us of replay however small (bench/gpu_profile.py:
resnet_qdq_ort17's fourteen QDQ round trips were 70 of its 89 kernels; gpt_dynquant_ort15's nine
DynamicQuantizeLinear about 250 of its 347, mostly on 0-d tensors). A chain written as one CUDA
function runs in one. Each kernel here computes what the layers' torch kernels compute, in the
same order and types (``kernels/quantization.py``), so the values are theirs bit for bit.

A kernel is made at its first call (the warm-up before a capture, never inside one) and kept for
the process; where it cannot be made (no NVRTC, a compile refused) ``call`` answers None for that
type (jiterator compiles per type: a float16 refusal leaves the float32 kernel) once and
ever after, and the caller runs torch's kernels. During a trace (``GpuAcc.compile``'s make_fx,
torch.compile) it answers None too: a kernel launched outside torch's dispatcher would be missing
from the traced graph.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

ROUND_TRIP = """template <typename T> T backplane_qdq(T x, T s, T low, T high, T nan_value) {
    if (x != x) { return nan_value; }
    T q = rintf(__fdiv_rn(x, s));
    q = q < low ? low : q;
    return (q > high ? high : q) * s;
}"""
"""QuantizeLinear -> DequantizeLinear of one per-tensor scale s and zero point z (low and high:
the integer type's range less z): clamp(rint(x / s), low, high) * s, NaN (quantized to 0) to
-z * s. ``__fdiv_rn`` divides IEEE-rounded, as QuantizeLinear does: torch.div by a Python scalar
on CUDA multiplies by its reciprocal, an ulp off at some ties."""

DYNAMIC_PARAMS = """template <typename T> void backplane_dql_params(T lo, T hi, T& scale, T& zero) {
    double low = lo > 0 ? 0.0 : (double)lo;
    double high = hi < 0 ? 0.0 : (double)hi;
    float s = high > low ? (float)((high - low) / 255.0) : 1.0f;
    float z = rintf(__fdiv_rn(-(float)low, s));
    scale = s;
    zero = z != z ? 0.0f : (z < 0.0f ? 0.0f : (z > 255.0f ? 255.0f : z));
}"""
"""DynamicQuantizeLinear's scale and zero point from its input's min and max, as
``kernels.quantization.dynamic_quantize_linear``: the range widened to hold 0, the scale in float64
rounded once to float32 (1 for an empty or NaN range), the zero point rint(-low / scale) saturated
to uint8 (NaN, cast to uint8 on CUDA, is 0), as a float."""

DYNAMIC_CENTRED = """template <typename T> T backplane_dql_centred(T x, T s, T z) {
    T q = rintf(__fdiv_rn(x, s)) + z;
    q = q != q ? 0.0f : (q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q));
    return q - z;
}"""
"""DynamicQuantizeLinear's uint8 value less its zero point, as a float32 integer: what
MatMulInteger's float product reads (``gpu_int8._matmul_integer``: A widened, less its zero
point)."""

DYNAMIC_QUANTIZE = """template <typename T> void backplane_dql(T x, T lo, T hi, T& centred, T& scale,
                                                      T& zero) {
    double low = lo > 0 ? 0.0 : (double)lo;
    double high = hi < 0 ? 0.0 : (double)hi;
    float s = high > low ? (float)((high - low) / 255.0) : 1.0f;
    float z = rintf(__fdiv_rn(-(float)low, s));
    z = z != z ? 0.0f : (z < 0.0f ? 0.0f : (z > 255.0f ? 255.0f : z));
    float q = rintf(__fdiv_rn(x, s)) + z;
    q = q != q ? 0.0f : (q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q));
    centred = q - z;
    scale = s;
    zero = z;
}"""
"""``DYNAMIC_PARAMS`` then ``DYNAMIC_CENTRED`` in one kernel over x, its min and max: each element
computes the scale and zero point itself (the same float64 and float32 steps, so the same
values) and writes them beside its centred value; a 0-d view of one element of each is the
layer's scale and zero point. One kernel where the two were two, at a write of two floats an
element more (gpt_dynquant_ort15's rows are 256 to 1024 elements)."""

REQUANTIZE = """template <typename T> T backplane_requantize(T acc, T m, T zy, T low, T high) {
    double y = rint(rint((double)acc) * (double)m) + (double)zy;
    y = y < (double)low ? (double)low : y;
    return (T)(y > (double)high ? (double)high : y);
}"""
"""QLinearConv's and QLinearMatMul's requantization of their float32 sum (integers, exact:
``gpu_qlinear.py``) by the float32 multiplier, as ``kernels.quantization.q_linear_conv``: the
product in float64 (of two float32 values: exact), rounded half to even, plus the output's zero
point, saturated; the integer as a float32 value, one cast from the output type. The sum is
rounded first (a no-op for an exact sum)."""

REQUANTIZE_DEQUANTIZE = """template <typename T> T backplane_requantize_dq(T acc, T m, T zy, T low,
                                                                 T high, T s, T zd) {
    double y = rint(rint((double)acc) * (double)m) + (double)zy;
    y = y < (double)low ? (double)low : y;
    return ((T)(y > (double)high ? (double)high : y) - zd) * s;
}"""
"""``REQUANTIZE``, then the DequantizeLinear that alone reads its integer (scale s, zero point
zd): y - zd exact in float32, the product rounded once, as ``DEQUANTIZE``."""

QUANTIZE = """template <typename T> T backplane_quantize(T x, T s, T z, T low, T high) {
    if (x != x) { return 0; }
    T q = rintf(__fdiv_rn(x, s)) + z;
    q = q < low ? low : q;
    return q > high ? high : q;
}"""
"""QuantizeLinear of one per-tensor scale and zero point, as the kernel's float32 form:
rint(x / s) IEEE-divided, plus z, saturated (NaN to 0, as CUDA's cast and NumPy's give it); the
integer as a float32 value, one cast from the output type."""

QUANTIZE_CENTRED = """template <typename T> T backplane_quantize_centred(T x, T s, T z, T low,
                                                                    T high) {
    if (x != x) { return -z; }
    T q = rintf(__fdiv_rn(x, s)) + z;
    q = q < low ? low : q;
    return (q > high ? high : q) - z;
}"""
"""``QUANTIZE`` less its zero point: what the QLinearConv and QLinearMatMul reading it subtract
first (``gpu_int8._int8_chains``); NaN (quantized to 0) is -z."""

DEQUANTIZE = """template <typename T> T backplane_dequantize(T x, T s, T z) {
    return (x - z) * s;
}"""
"""DequantizeLinear of one per-tensor scale and zero point to float32: x - z exact, the product
rounded once, as the kernel's float32 form. ``x`` arrives widened to float32: the scale is a
float32 tensor, which makes float32 the kernel's type."""

_made: dict[str, Any] = {}
_refused: set[tuple[str, Any]] = set()  # (code, type) jiterator could not make or run


def call(code: str, *tensors: Any, outputs: int = 1, **scalars: float) -> Any:
    """``code``'s kernel over ``tensors`` (its scalars by name), or None where it cannot run."""
    if _tracing():
        return None
    kernel = _made.get(code, False)
    refused = (code, tensors[0].dtype if tensors else None)  # jiterator compiles per type
    if kernel is None or refused in _refused:
        return None
    try:
        if kernel is False:
            from torch.cuda import jiterator

            kernel = (jiterator._create_jit_fn(code, **dict.fromkeys(scalars, 0.0))
                      if outputs == 1 else
                      jiterator._create_multi_output_jit_fn(code, outputs,
                                                            **dict.fromkeys(scalars, 0.0)))
            _made[code] = kernel
        return kernel(*tensors, **scalars)
    except Exception as exc:  # noqa: BLE001 - no NVRTC, or it refused: torch's kernels instead
        log.info("GpuAcc: an elementwise chain stays torch's kernels (%s)", exc)
        _refused.add(refused)
        return None


def _tracing() -> bool:
    import torch

    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        return bool(torch.compiler.is_compiling() or get_proxy_mode() is not None)
    except Exception:  # noqa: BLE001 - a torch without these: take it as tracing
        return True
