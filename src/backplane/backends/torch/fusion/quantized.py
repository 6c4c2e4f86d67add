"""QuantizeLinear -> DequantizeLinear on a float tensor (the QDQ format's activations): one
``QuantDequant`` layer, the round trip as a few in-place torch calls on one tensor.

Why: ONNX Runtime's QDQ models and QAT exports put such a pair after nearly every layer; as two
layers each one made a uint8 tensor and a float64 one, and as many calls again as the layer it
follows. The weights' DequantizeLinear of a constant is folded to a float constant before fusion
(the optimizer's constant folding), so the Conv or Gemm between the pairs becomes a FusedConv or a
Linear as in a float model, and the whole subgraph may become one OneDnnGraph.

What the pair computes, as CpuRef does it (``reference/kernels/quant.py``), in float32 throughout:
q = clamp(rint(x / s_q) + z_q, low, high), a NaN quantized to 0 (NumPy's and torch's cast of NaN
to an 8-bit integer), then y = (q - z_dq) * s_dq. The division is a division (torch's
``fake_quantize_per_tensor_affine`` multiplies by 1 / s, which rounds 15 of 600 ties otherwise),
rint rounds half to even, every step is exact on integers below 2^24, and float32's product of an
integer and a float32 scale is the float64 product rounded once, as CpuRef's.

Also shared by ``qlinear``: ``quant_params`` (a quantization's constant scale and zero point, shaped
for the tensor) and ``to_grid`` (x quantized, as float32 integers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context
from backplane.ir.graph import Layer

RANGES = {np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
          for t in (np.int8, np.uint8, np.int16, np.uint16)}
"""The integer types the fused layers quantize to, and their ranges (exact in float32)."""


def quant_params(layer: Layer, ctx: Context, scale_at: int, rank: int | None,
                 axis: int | None = None) -> dict[str, Any] | None:
    """The constant float32 scale and zero point read at ``layer.inputs[scale_at]`` and the one
    after, shaped to broadcast against a tensor of ``rank`` along ``axis`` (the layer's own where
    None), with the quantized type's range: or None where they are not constants this can take
    (a computed or blocked scale, another type, a per-axis scale of a tensor of unknown rank)."""
    if layer.attrs.get("block_size", 0) or layer.attrs.get("precision", 0):
        return None
    names = layer.inputs[scale_at:scale_at + 2]
    scale = ctx.const(names[0])
    zero_name = names[1] if len(names) > 1 else ""
    zero = ctx.const(zero_name)
    if scale is None or scale.dtype != F32 or (zero_name and zero is None):
        return None
    dtype = zero.dtype if zero is not None else _declared_type(layer)
    if dtype not in RANGES or (zero is not None and zero.size != scale.size):
        return None
    zero = np.zeros(scale.shape, np.float32) if zero is None else zero.astype(np.float32)
    if scale.size > 1:
        if rank is None or scale.ndim != 1:
            return None
        axis = (layer.attrs.get("axis", 1) if axis is None else axis) % rank
        shape = [-1 if d == axis else 1 for d in range(rank)]
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    low, high = RANGES[dtype]
    return {"scale": np.ascontiguousarray(scale.reshape(scale.shape if scale.size > 1 else ())),
            "zero": np.ascontiguousarray(zero.reshape(zero.shape if zero.size > 1 else ())),
            "low": low, "high": high}


def _declared_type(layer: Layer) -> np.dtype:
    """QuantizeLinear's output type without a zero point: ``output_dtype`` (21), else uint8."""
    from backplane.frontends.onnx_types import onnx_to_numpy_dtype

    declared = layer.attrs.get("output_dtype", 0)
    return np.dtype(onnx_to_numpy_dtype(declared)) if declared else np.dtype(np.uint8)


def match_quant_dequant(quantize: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """QuantizeLinear -> DequantizeLinear of a float32 tensor, constant scales and zero points,
    the integer tensor read by the DequantizeLinear alone."""
    x, q = quantize.inputs[0], quantize.outputs[0]
    dequantize = ctx.sole(q)
    if dequantize is None or dequantize.op_type != "DequantizeLinear" or dequantize.domain:
        return None
    if ctx.graph.info(x).dtype != F32 or dequantize.attrs.get("output_dtype", 0) not in (0, 1):
        return None
    shape = ctx.graph.info(x).shape
    rank = len(shape) if shape is not None else None
    into, back = quant_params(quantize, ctx, 1, rank), quant_params(dequantize, ctx, 1, rank)
    if into is None or back is None or (into["low"], into["high"]) != (back["low"], back["high"]):
        return None
    attrs = {"into": into, "back": back}
    fused = Layer(f"{quantize.name}+{dequantize.name}", "QuantDequant", [x],
                  [dequantize.outputs[0]], attrs, FUSED_DOMAIN, 1)
    return [quantize, dequantize], fused


def torch_params(params: dict[str, Any]) -> tuple[Any, Any, int, int]:
    """(scale, zero point, low, high): a per-tensor scale and zero point as Python floats (exact:
    float32 values), per-axis ones as float32 tensors."""
    from backplane.backends.torch.backend import _numpy_to_torch

    scale, zero = params["scale"], params["zero"]
    if scale.ndim == 0:
        return float(scale), float(zero), params["low"], params["high"]
    return _numpy_to_torch(scale), _numpy_to_torch(zero), params["low"], params["high"]


def to_grid(x: Any, params: tuple[Any, Any, int, int]) -> Any:
    """x quantized (a new float32 tensor of integers): clamp(rint(x / s) + z), NaN to 0."""
    import torch

    scale, zero, low, high = params
    q = torch.round(x / scale)
    return q.add_(zero).clamp_(low, high).nan_to_num_(0.0)


def quant_dequant_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The round trip on one new tensor: to the grid, then back with the DequantizeLinear's scale."""
    into = torch_params(layer.attrs["into"])
    scale, zero, _, _ = torch_params(layer.attrs["back"])

    def run(x):
        return (to_grid(x, into).sub_(zero).mul_(scale),)
    return run
