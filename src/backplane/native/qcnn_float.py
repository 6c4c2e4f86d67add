"""What ONNX Runtime makes of DequantizeLinear -> Conv -> [Relu | Clip] -> QuantizeLinear, so that
the int8 plan computes what it computes, bit for bit.

Why: a QAT export (torch's fake quantization, fakequant_qdq_ts13) keeps its biases in float and
puts a Clip before a QuantizeLinear whose step it does not fill. ONNX Runtime's graph transformers
then decide per convolution:

- ``BiasQuantization``: a float bias of a Conv / Gemm between DequantizeLinears becomes
  ``DequantizeLinear(Cast(Round(bias / (x_scale * w_scale))), x_scale * w_scale)``, each step in
  float32 (Mul, Div, Round half to even), constant-folded: the integer bias of the fused
  QLinearConv, or ``int32 * scale`` back in float where the convolution stays float;
- ``ReluQuantFusion``: a Relu before a QuantizeLinear whose zero point is the type's low end is
  dropped (redundant);
- ``ClipQuantFusion``: a Clip is dropped where its bounds hold the QuantizeLinear's whole range
  (``min - low`` and ``high - max`` at most float32's epsilon, ``low = scale * (qmin - zero)``);
- a Relu or Clip that stays keeps the Conv out of the QDQ fusion: it runs in float (FusedConv),
  its weights and input dequantized, then QuantizeLinear. A depthwise one is MLAS's im2col and
  one-row SGEMM per channel (``MlasSgemmKernelM1Avx``: the taps in groups of four, each group's
  products added left to right, then to the running sum, no FMA); ``fdwconv_q`` in qcnn.c does
  the same operations in that order.
"""

from __future__ import annotations

import math

import numpy as np

from backplane.ir.graph import Layer
from backplane.native.qcnn import ALIGN, Planner, Unplannable

F32 = np.float32
QMIN = {"u8": 0, "s8": -128}
QMAX = {"u8": 255, "s8": 127}


def bias(bias: np.ndarray | None, x_scale: F32, w_scale: np.ndarray,
         oc: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(the integer bias a fused convolution adds, or None for a float one; the float bias). A
    folded DequantizeLinear of int32 (a multiple of about x_scale * w_scale) is its integers, as
    ONNX Runtime adds them; any other float bias stays the graph's float (ONNX Runtime's
    BiasQuantization rounds it to int32 steps: fakequant_qdq_ts13's logits move by 4e-4 of their
    scale from the graph's, where CpuRef and ONNX Runtime unoptimized agree to 1e-7)."""
    if bias is None:
        return np.zeros(oc, np.int64), np.zeros(oc, F32)
    if bias.size not in (1, oc):
        raise Unplannable(f"a bias of {bias.shape} for {oc} channels")
    folded = np.broadcast_to(bias.reshape(-1), (oc,)).astype(F32)
    units = folded.astype(np.float64) / (np.float64(x_scale) * w_scale.astype(np.float64))
    if np.abs(units).max(initial=0) >= 2 ** 30:
        raise Unplannable("a bias beyond int32")
    off = np.abs(units - np.rint(units)) - 4e-6 * np.abs(units)  # (a scale recovered an ulp off
    if off.max(initial=0) <= 1e-3:  # moves a large integer bias a little): integers, folded
        return np.rint(units).astype(np.int64), folded
    return None, folded


def float_bias(p: Planner, bias_f: np.ndarray, x_scale: F32, w_scale: np.ndarray,
               y_scale: F32, blocks: int) -> int:
    """The record field in2 of a convolution with a float bias: the byte offset of its biases,
    then x_scale * w_scale, each ``blocks`` * OCB long, then y_scale (qcnn_float.h's
    requantize_f)."""
    from backplane.native.qcnn import OCB

    padded = np.zeros((2, blocks * OCB), F32)
    padded[0, :bias_f.size] = bias_f
    padded[1, :bias_f.size] = F32(x_scale) * np.asarray(w_scale, F32)
    return p.param(np.concatenate([padded.reshape(-1), np.array([y_scale], F32)]))


def redundant(p: Planner, between: Layer, q: Layer, y_step: tuple[F32, int, str]) -> bool:
    """Whether ONNX Runtime drops the Relu or Clip ``between`` a convolution and its
    QuantizeLinear ``q`` (both fusions need q's zero point given)."""
    scale, zero, kind = y_step
    if len(q.inputs) < 3 or not q.inputs[2]:
        return False
    if between.op_type == "Relu":
        return zero == QMIN[kind]
    low, high = clip_bounds(p, between)
    lower = F32(scale) * F32(QMIN[kind] - zero)
    upper = F32(scale) * F32(QMAX[kind] - zero)
    eps = np.finfo(F32).eps
    return not (eps < F32(low) - lower or eps < upper - F32(high))


def clip_bounds(p: Planner, clip: Layer) -> tuple[float, float]:
    """A Clip's constant bounds (inputs from opset 11, attributes before), infinite where absent."""
    low, high = (p.const(n) if n else None for n in (*clip.inputs[1:3], "", "")[:2])
    if any(n and p.const(n) is None for n in clip.inputs[1:3]):
        raise Unplannable(f"{clip.name}: a Clip of computed bounds")
    low = clip.attrs.get("min") if low is None else low
    high = clip.attrs.get("max") if high is None else high
    return (-math.inf if low is None else float(low), math.inf if high is None else float(high))


def depthwise_float(p: Planner, layer: Layer, x_name: str, x_step: tuple[F32, int],
                    weight: np.ndarray, bias_f: np.ndarray, y_name: str,
                    y_step: tuple[F32, int, str], geometry: tuple, bounds: tuple[float, float]
                    ) -> bool:
    """The record of a depthwise convolution run in float (see above), MLAS's operations in
    MLAS's order; False where the convolution is not depthwise."""
    from backplane.native.qcnn_layers import RANGES

    x = p.quantized(x_name)
    n, c, h, w = x.dims
    oc, icg, kh, kw = weight.shape
    (sh, sw), (dh, dw), (pt, pl), (pb, pr), group = geometry
    if not (group > 1 and group == c == oc and icg == 1):
        return False
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (w + pl + pr - (kw - 1) * dw - 1) // sw + 1
    ph = max(h + pt, (oh - 1) * sh + (kh - 1) * dh + 1)
    pw = max(w + pl, (ow - 1) * sw + (kw - 1) * dw + 1)
    p.scratch = max(p.scratch, -(-n * ph * pw * c * 4 // ALIGN) * ALIGN)
    taps = np.ascontiguousarray(weight.reshape(oc, kh * kw).T, F32)  # [tap][channel]
    y = p.new(y_name, (n, oc, oh, ow), y_step[2], y_step[:2])
    lo, hi = RANGES[y_step[2]]
    p.record("fdwconv_q", in_=x.offset, out=y.offset, dims=x.dims, oh=oh, ow=ow, oc=oc, kh=kh,
             kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt, pl=pl, ph=ph, pw=pw,
             woff=p.param(taps), boff=p.param(np.ascontiguousarray(bias_f, F32)),
             moff=p.param(np.array([x_step[0], y_step[0]], F32)), zx=x_step[1],
             zy=y_step[1], lo=lo, hi=hi, signed=int(x.kind == "s8"),
             x1=1 + p.param(np.array(bounds, F32)))
    p.macs += n * oh * ow * oc * kh * kw
    return True


def hard_sigmoid(p: Planner, layer: Layer, index: int) -> None:
    """HardSigmoid in float32 (ONNX Runtime runs it between a DequantizeLinear and a
    QuantizeLinear unfused): alpha * x + beta, each step rounded, then clamped to [0, 1]."""
    x = p.real(layer.inputs[0])
    y = p.new(layer.outputs[0], x.shape, "f")
    a = layer.attrs
    p.record("hsig_f", in_=x.offset, out=y.offset, dims=x.dims, moff=p.param(np.array(
        [a.get("alpha", 0.2), a.get("beta", 0.5)], F32)))


def mul(p: Planner, layer: Layer, index: int) -> None:
    """Mul of two float tensors of one shape (a hard-swish's x * HardSigmoid(x))."""
    a, b = (p.real(n) for n in layer.inputs[:2])
    if a.shape != b.shape:
        raise Unplannable(f"{layer.name}: Mul of {a.shape} and {b.shape}")
    y = p.new(layer.outputs[0], a.shape, "f")
    p.record("mul_f", in_=a.offset, in2=b.offset, out=y.offset, dims=a.dims)
