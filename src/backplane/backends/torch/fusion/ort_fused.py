"""ONNX Runtime's transformer fusions (com.microsoft), as CpuAcc runs the plain ops they replace
(issue 29: "the optimized BERT no slower than the plain one").

- SkipLayerNormalization whose mean and inverse deviation no layer reads (a pre-norm decoder's
  has four outputs, the middle two empty; its sum is the next residual) computes y by torch's
  one-pass layer_norm, not from the statistics written out (six more passes over the sum: 7 a run
  in the ORT-optimized gpt_causal_ts15).
- FusedMatMul by a constant 2-D weight (ONNX Runtime's saved models fold a scale into it: alpha)
  is one Linear as a MatMul is (``linear.match_linear``: prepacked, its bias, activation or
  residual after it), the weight scaled at load; it ran as a plain product.
- A Linear (MatMul, Gemm, FusedMatMul by a constant) followed by FastGelu, BiasGelu or Gelu takes
  it as the plain model's Linear takes the GELU written out: its bias added to the Linear's, the
  GELU a post-op (oneDNN's, or torch's gelu after the product), where the optimized model ran the
  product without a bias, then the bias add and the GELU (two more passes over the widest
  activations: 4 FastGelus a run in the ORT-optimized gpt_causal_ts15).
"""

from __future__ import annotations

import numpy as np

from backplane.backends.torch.fusion.linear import match_linear
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.backends.torch.fusion.quantized import Matcher
from backplane.ir.graph import Layer

MS = "com.microsoft"


def match_skip_layer_norm(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The layer told not to compute its statistics, where it has them as outputs and none is
    read (``statistics`` 0: ``torch/kernels/contrib_transformer.skip_layer_normalization``)."""
    if layer.domain != MS or len(layer.outputs) < 2:  # y alone: torch's layer_norm already
        return None
    if any(name and (ctx.consumers.get(name) or name in ctx.graph.outputs)
           for name in layer.outputs[1:3]):
        return None
    fused = Layer(layer.name, layer.op_type, list(layer.inputs), list(layer.outputs),
                  {**layer.attrs, "statistics": 0}, layer.domain, layer.opset)
    return [layer], fused


def match_fused_matmul(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """FusedMatMul(x, B, alpha) with a constant (K, N) B as a MatMul by alpha * B: one Linear."""
    a = layer.attrs
    weight = ctx.const(layer.inputs[1])
    if layer.domain != MS or weight is None or weight.ndim != 2 or weight.dtype != F32 \
            or any(a.get(flag, 0) for flag in ("transA", "transB", "transBatchA", "transBatchB")):
        return None
    plain = Layer(layer.name, "MatMul", list(layer.inputs), list(layer.outputs), {}, "", 13)
    found = match_linear(plain, ctx)  # what a MatMul by B fuses with after it
    if found is None:
        return None
    group, fused = found
    alpha = float(a.get("alpha", 1.0))
    if alpha != 1.0:
        fused.attrs["weight"] = np.ascontiguousarray(weight.T * np.float32(alpha))
    return [layer, *group[1:]], fused


GELUS = {"FastGelu": "tanh", "BiasGelu": "none", "Gelu": "none"}
"""ONNX Runtime's GELUs -> torch's form of each (``approximate``)."""


def with_ort_gelu(matcher: Matcher) -> Matcher:
    """``matcher`` (a Linear's), its Linear taking the FastGelu, BiasGelu or Gelu that alone reads
    its output, where it has no post-op yet and the GELU's bias is a constant of its width."""
    def match(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
        found = matcher(layer, ctx)
        if found is None or found[1].op_type != "Linear":
            return found
        group, fused = found
        a, out = fused.attrs, fused.outputs[0]
        gelu = ctx.sole(out)
        if a.get("unary") or a.get("binary") or gelu is None or gelu.domain != MS \
                or gelu.op_type not in GELUS or gelu.inputs[0] != out:
            return found
        extra = ctx.const(gelu.inputs[1]) if len(gelu.inputs) > 1 and gelu.inputs[1] else None
        if len(gelu.inputs) > 1 and gelu.inputs[1] and (
                extra is None or extra.dtype != F32 or extra.shape != (a["weight"].shape[0],)):
            return found
        bias = a["bias"] if extra is None else extra if a["bias"] is None else a["bias"] + extra
        attrs = {**a, "bias": None if bias is None else np.ascontiguousarray(bias, F32),
                 "unary": ("gelu", [], GELUS[gelu.op_type])}
        return [*group, gelu], Layer(f"{fused.name}+{gelu.name}", "Linear", list(fused.inputs),
                                     [gelu.outputs[0]], attrs, fused.domain, fused.opset)
    return match
