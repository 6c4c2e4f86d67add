"""ONNX Runtime's quantized matrix products (com.microsoft) by a constant weight, as one CpuAcc
layer computing their integer products as exact float32 products (``qlinear``'s way):

- QGemm (transA 0) becomes one ``QGemm``: A less its zero point, times the centred weight by
  Linear's measured route (MKL or oneDNN, the weight prepacked), C added as the bias, then
  times alpha * s_a * s_b in float32 and, with y's scale, quantized: the kernel's steps
  (``kernels/contrib_quant.q_gemm``), so CpuRef's values bit for bit.
- DynamicQuantizeMatMul becomes ``qlinear``'s ``DynamicQuantMatMul``: the same computation as
  the DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul [-> Add] it is ORT's fusion of.

Each is taken only where every sum stays below 2^24 (checked from the weight): otherwise the
kernel runs it, in float64. The kernels convert a constant weight at every call; these prepack it
once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context, compute_type
from backplane.backends.torch.fusion.qlinear import EXACT, _centred_weight, _zero_point
from backplane.backends.torch.fusion.qlinear_float import _in_float32
from backplane.backends.torch.fusion.quantized import RANGES
from backplane.ir.graph import Layer

CONTRIB = "com.microsoft"


def _weight(layer: Layer, ctx: Context, at: int, zero_at: int,
            transposed: bool) -> np.ndarray | None:
    """The constant 2-D weight (input ``at``) less its constant zero point (input ``zero_at``,
    per tensor or per column), as an (N, K) float32 matrix; None where it is not one."""
    zero_name = layer.inputs[zero_at] if zero_at < len(layer.inputs) else ""
    b, zero = ctx.const(layer.inputs[at]), ctx.const(zero_name)
    if b is None or b.ndim != 2 or (zero_name and zero is None):
        return None
    centred = _centred_weight(b, zero, per_row=transposed)  # (N, K) where transposed, else (K, N)
    if centred is None:
        return None
    return np.ascontiguousarray(centred if transposed else centred.T)


def match_qgemm(gemm: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """QGemm of a static 2-D A by a constant B (constant scales, zero points and C)."""
    if gemm.domain != CONTRIB or gemm.attrs.get("transA", 0) or len(gemm.inputs) < 6:
        return None
    weight = _weight(gemm, ctx, 3, 5, bool(gemm.attrs.get("transB", 0)))
    a_scale, b_scale = ctx.const(gemm.inputs[1]), ctx.const(gemm.inputs[4])
    x_zero, info = _zero_point(gemm.inputs[2], ctx), ctx.graph.info(gemm.inputs[0])
    names = [*gemm.inputs[6:], "", "", ""][:3]
    c, y_scale, y_zero = (ctx.const(name) for name in names)
    if weight is None or a_scale is None or a_scale.size != 1 or x_zero is None \
            or b_scale is None or b_scale.size not in (1, weight.shape[0]) \
            or not info.is_static or len(info.shape) != 2 \
            or any(name and value is None for name, value in zip(names, (c, y_scale, y_zero))):
        return None
    if c is not None and (c.dtype != np.int32 or c.size != weight.shape[0]):
        return None  # C: int32, one per column (a full (M, N) C is left to the kernel)
    (zero, (low, high)) = x_zero
    bias = None if c is None else c.astype(np.float64).reshape(-1)
    reach = max(high - zero, zero - low)
    largest = float(np.abs(weight).sum(axis=1).max()) * reach
    if largest + (0.0 if bias is None else float(np.abs(bias).max())) >= EXACT:
        return None
    multiplier = np.float32(gemm.attrs.get("alpha", 1.0)) * a_scale.astype(F32).reshape(()) \
        * b_scale.astype(F32).reshape(-1 if b_scale.size > 1 else ())
    attrs = {"weight": weight, "bias": None if bias is None else bias.astype(F32),
             "input_shape": list(info.shape), "unary": None, "binary": False,
             "output_shape": None, "x_zero": zero, "multiplier": np.array(multiplier, F32),
             "y": _output_grid(y_scale, y_zero, gemm, ctx),
             "int8": _int8_weight(gemm, ctx, info.dtype)}
    if names[1] and attrs["y"] is None:
        return None
    return [gemm], Layer(gemm.name, "QGemm", [gemm.inputs[0]], list(gemm.outputs), attrs,
                         FUSED_DOMAIN, 1)


def _int8_weight(gemm: Layer, ctx: Context, a_type: np.dtype) -> dict[str, Any] | None:
    """QGemm's B as a (K, N) int8 matrix where it is int8 with zero points 0 and A is 8-bit, and
    whether A is unsigned: the product may then be ``torch._int_mm``'s (``_int8_product``)."""
    b = ctx.const(gemm.inputs[3])
    zero = ctx.const(gemm.inputs[5]) if len(gemm.inputs) > 5 and gemm.inputs[5] else None
    if b is None or b.dtype != np.int8 or (zero is not None and zero.any()) \
            or a_type not in (np.dtype(np.uint8), np.dtype(np.int8)):
        return None
    return {"weight": np.ascontiguousarray(b.T if gemm.attrs.get("transB", 0) else b),
            "unsigned": a_type == np.dtype(np.uint8)}


def _int8_product(a: dict[str, Any]) -> Any:
    """A's integer product with an int8 B by ``torch._int_mm`` (int32, exact), less the zero
    point's share, plus C: the same integers as the float product (every sum below 2^24, as
    matched), from a weight a quarter its size (a ResNet head's (1, 128) x (128, 1000) ran 110-150
    us in float32 beside the convolutions, whose activations evict it from the caches each run);
    None where torch has no such product here, it is not exact (``int8_exact.exact_int_mm``) or
    it is slow: without VNNI (``exact_kernels`` fails) it is exact but 9-36x float32's product."""
    import torch

    from backplane.backends.torch.fusion.int8_exact import exact_int_mm, exact_kernels

    if a.get("int8") is None or not (exact_kernels() and exact_int_mm()):
        return None
    weight, unsigned = torch.from_numpy(a["int8"]["weight"]), a["int8"]["unsigned"]  # (K, N)
    bias = torch.zeros(weight.shape[1], dtype=torch.int32) if a["bias"] is None else \
        torch.from_numpy(np.rint(a["bias"]).astype(np.int32))
    # uint8 A less 128 is int8, so A - z is that plus (128 - z); through int16, which a trace
    # holds (TorchScript has no view as another dtype)
    offset = int(128 - a["x_zero"]) if unsigned else -int(a["x_zero"])
    correction = weight.sum(0, dtype=torch.int32).mul_(offset).add_(bias)

    def product(x):
        rows = x.to(torch.int16).sub_(128).to(torch.int8) if unsigned else x
        return (torch._int_mm(rows, weight).add_(correction).float(),)
    try:
        product(torch.zeros(a["input_shape"], dtype=torch.uint8 if unsigned else torch.int8))
    except RuntimeError:
        return None
    return product


def _output_grid(scale: np.ndarray | None, zero: np.ndarray | None, gemm: Layer,
                 ctx: Context) -> dict[str, Any] | None:
    """y's scale, zero point and range, where QGemm quantizes its output (else None)."""
    if scale is None or scale.size != 1 or scale.dtype != F32:
        return None
    dtype = zero.dtype if zero is not None else ctx.graph.info(gemm.inputs[0]).dtype
    if dtype not in RANGES or (zero is not None and zero.size != 1):
        return None
    return {"scale": np.array(scale.reshape(()), F32), "zero": 0 if zero is None
            else int(zero.reshape(())), "range": RANGES[dtype]}


def qgemm_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """A centred, the product by Linear's measured route (C as its bias), the scales, and the
    quantization where the layer has y's scale."""
    import torch

    from backplane.backends.torch.fusion.linear import linear_workload

    a = layer.attrs
    x_zero, multiplier = a["x_zero"], torch.from_numpy(np.array(a["multiplier"], F32))
    product = _int8_product(a)
    route = "float" if product is None else "int8"
    if product is None:
        float_product = linear_workload(_in_float32(layer), backend)
        product = lambda x: float_product(x.float().sub_(x_zero))  # noqa: E731
    dtype, grid = compute_type(a), a["y"]
    if grid is None:
        def run(x):
            (acc,) = product(x)
            return (acc.mul_(multiplier).to(dtype),)
        run.route = route  # type: ignore[attr-defined]
        return run
    scale, zero, (low, high) = torch.from_numpy(grid["scale"]), grid["zero"], grid["range"]
    integer = {RANGES[np.dtype(t)]: getattr(torch, t) for t in ("uint8", "int8")}[(low, high)]

    def run_quantized(x):
        (acc,) = product(x)
        y = acc.mul_(multiplier).div_(scale)
        return (torch.round(y).add_(zero).clamp_(low, high).to(integer),)
    run_quantized.route = route  # type: ignore[attr-defined]
    return run_quantized


def match_dynamic_quantize_matmul(matmul: Layer, ctx: Context,
                                  ) -> tuple[list[Layer], Layer] | None:
    """DynamicQuantizeMatMul of a static float32 A by a constant B (constant scale and zero
    point, per tensor or per column; a constant float32 bias)."""
    if matmul.domain != CONTRIB:
        return None
    weight = _weight(matmul, ctx, 1, 3, transposed=False)
    names = [*matmul.inputs[2:], "", ""][:3]  # b_scale, b_zero_point, bias
    scale, _, bias = (ctx.const(name) for name in names)
    info = ctx.graph.info(matmul.inputs[0])
    if weight is None or scale is None or scale.dtype != F32 \
            or scale.size not in (1, weight.shape[0]) or (names[2] and bias is None) \
            or (bias is not None and (bias.dtype != F32 or bias.shape != (weight.shape[0],))) \
            or info.dtype != F32 or not info.is_static or len(info.shape) < 2:
        return None
    if 255 * float(np.abs(weight).sum(axis=1).max()) >= EXACT:
        return None
    attrs = {"weight": weight, "bias": None, "input_shape": list(info.shape), "unary": None,
             "binary": False, "output_shape": None,
             "w_scale": np.array(scale.reshape(-1) if scale.size > 1 else scale.reshape(()), F32),
             "add": bias}
    return [matmul], Layer(matmul.name, "DynamicQuantMatMul", [matmul.inputs[0]],
                           list(matmul.outputs), attrs, FUSED_DOMAIN, 1)


def match_mat_mul_n_bits(matmul: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """MatMulNBits of a float32 A by constant blocks (constant scales, zero points and bias) as
    one ``Linear`` whose float32 weight is the blocks dequantized once here: at these models'
    sizes MKL's float product beats unpacking the blocks at every call (see docs/torch-backends.md,
    Quantized models)."""
    import torch

    from backplane.backends.torch.kernels.contrib_quant import n_bits_weight

    if matmul.domain != CONTRIB or len(matmul.inputs) < 3:
        return None
    names = [*matmul.inputs[1:], "", "", "", ""][:5]  # B, scales, zero_points, g_idx, bias
    b, scales, zero, _, bias = (ctx.const(name) for name in names)
    if b is None or scales is None or (names[2] and zero is None) or names[3] \
            or (names[4] and (bias is None or bias.dtype != F32)) \
            or ctx.graph.info(matmul.inputs[0]).dtype != F32:
        return None
    a = matmul.attrs
    try:
        weight = n_bits_weight(torch.from_numpy(b), torch.from_numpy(scales),
                               None if zero is None else torch.from_numpy(zero), K=a["K"],
                               N=a["N"], block_size=a["block_size"], bits=a.get("bits", 4))
    except (RuntimeError, KeyError):  # blocks of other sizes than K, N say: the kernel's error
        return None
    attrs = {"weight": np.ascontiguousarray(weight.numpy()),
             "bias": None if bias is None else np.ascontiguousarray(bias.reshape(-1)),
             "input_shape": list(ctx.shape(matmul.inputs[0]) or []), "unary": None,
             "binary": False, "output_shape": None}
    return [matmul], Layer(matmul.name, "Linear", [matmul.inputs[0]], list(matmul.outputs), attrs,
                           FUSED_DOMAIN, 1)
