"""GpuAcc's int8 layers with constant operands inside a captured subgraph, in fewer kernels.

A CUDA graph replays every kernel its capture recorded, each 1-2 us of an H100's time however
small (bench/gpu_profile.py). The small tier's int8 models spent most of their replays on
conversions: each QuantizeLinear -> DequantizeLinear round trip of an activation eight kernels
(resnet_qdq_ort17's fourteen, fakequant_qdq_ts13's; their weights' DequantizeLinear is folded by
the optimizer), and the integer products widened their constant operands to float64 at every run
(gpt_dynquant_ort15's nine MatMulInteger, resnet_qlinear_ort15's six QLinearConv).

- A round trip of one constant per-tensor scale and zero point: one kernel of its own on CUDA
  (``gpu_jit.ROUND_TRIP``), five of torch's where it cannot be made (``_round_trip``).
- A MatMulInteger with a constant B (and the float Cast that alone reads it) as one float32
  product of A less its zero point by B less its zero point, made once (``_matmul_integer``).
- A QLinearConv with constant weights, scales and zero points: the float64 convolution of x less
  its zero point by the weights less theirs made once, the bias in the convolution, the
  requantization by a multiplier made once (``_qlinear_conv``).

Each gives the layers' own values bit for bit: the products are sums of integers, exact wherever
every partial sum stays within the type's integers (checked on the constants: ``EXACT_F32``, and
int32's range where the layer's int32 sum wraps), and the round trip's integers are exact in
float32. Each keeps the layers' own kernels for other inputs (not 8-bit or float32, not on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch import gpu_jit
from backplane.backends.torch.gpu_small import Step
from backplane.ir.graph import Layer


def _on_gpu(tensor: Any) -> bool:
    """Where these forms run (the tests run them on the CPU through this)."""
    return bool(tensor.is_cuda)


EXACT_F32 = float(1 << 24)
"""Integers of magnitude below 2^24 are exact in float32, and so is every sum of them that stays
below it, in any order: an 8-bit product whose partial sums are bounded so is exact in float32
(TF32 and bf16 products too: 8-bit operands fit their mantissas)."""


def int8_steps(layers: Sequence[Layer], steps: list[Step | None],
               sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> None:
    """QDQ round trips, MatMulInteger (with its float Cast) and QLinearConv with constant
    weights as their forms above, where they are exact so. Rewrites ``steps`` in place."""
    centred = _dynamic_pairs(layers, steps, sole, constants)
    for index, layer in enumerate(layers):
        step = steps[index]
        if step is None or layer.domain:
            continue
        if layer.op_type == "QuantizeLinear":
            _round_trip(layers, steps, index, sole, constants)
        if layer.op_type == "QLinearConv":
            made = _qlinear_conv(layer, step[0], constants)
            if made is not None:
                steps[index] = (made, step[1], step[2])
        if layer.op_type != "MatMulInteger":
            continue
        b_columns = _integer_columns(layer, constants)
        if b_columns is None:
            continue
        after = sole(layer.outputs[0])
        cast = None if after is None else layers[after]
        if cast is not None and steps[after] is not None and cast.op_type == "Cast" \
                and not cast.domain and int(cast.attrs.get("to", 0)) == 1:  # to float32
            steps[index] = None
            fused = _matmul_integer(step[0], b_columns, True, index in centred)
            steps[after] = (fused, step[1], cast.outputs)  # type: ignore[index]
        else:
            steps[index] = (_matmul_integer(step[0], b_columns, False, index in centred),
                            step[1], step[2])


def _dynamic_pairs(layers: Sequence[Layer], steps: list[Step | None],
                   sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> set[int]:
    """DynamicQuantizeLinear whose uint8 value and zero point the one MatMulInteger with a
    constant B alone reads (ONNX Runtime's quantize_dynamic writes one before each): on CUDA in
    three kernels (min and max, scale and zero point, the value less its zero point as float32)
    in place of about 28 (the kernel's float64 scalar arithmetic, its conversions, the product's
    widening). The MatMulInteger's indices, which read that float32 value as it is."""
    centred: set[int] = set()
    for index, layer in enumerate(layers):
        step = steps[index]
        if step is None or layer.domain or layer.op_type != "DynamicQuantizeLinear" \
                or len(layer.outputs) != 3:
            continue
        after = sole(layer.outputs[0])
        mmi = None if after is None else layers[after]
        if mmi is None or mmi.op_type != "MatMulInteger" or mmi.domain or steps[after] is None \
                or [*mmi.inputs, "", ""][:3:2] != layer.outputs[:3:2] \
                or sole(layer.outputs[2]) != after or _integer_columns(mmi, constants) is None:
            continue
        width = _integer_columns(mmi, constants).shape[0]  # type: ignore[union-attr]
        steps[index] = (_dynamic_quantize(step[0], width), step[1], step[2])
        centred.add(after)
    return centred


def _dynamic_quantize(kernel: Workload, width: int) -> Workload:
    """DynamicQuantizeLinear giving (x's uint8 value less its zero point, as float32; the scale;
    the zero point, as float32) on CUDA where the product takes it (rows of ``width``), its own
    three outputs elsewhere."""
    import torch

    def workload(x: Any) -> tuple[Any, ...]:
        if x.is_cuda and x.dtype == torch.float32 and x.numel() and x.dim() >= 2 \
                and x.shape[-1] == width:
            low, high = torch.aminmax(x)
            made = gpu_jit.call(gpu_jit.DYNAMIC_PARAMS, low, high, outputs=2)
            if made is not None:
                scale, zero = made
                centred = gpu_jit.call(gpu_jit.DYNAMIC_CENTRED, x, scale, zero)
                if centred is not None:
                    return centred, scale, zero
        return kernel(x)  # type: ignore[no-any-return]

    return workload


RANGES = {np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
          for t in (np.int8, np.uint8, np.int16, np.uint16)}


def _per_tensor(layer: Layer, constants: dict[str, np.ndarray],
                ) -> tuple[float, float, int, int] | None:
    """A QuantizeLinear's or DequantizeLinear's constant per-tensor float32 scale and zero point
    (as floats: exact) and the integer type's range; None for any other (blocked, a float8 or
    declared type without a zero point, a DequantizeLinear to another float type)."""
    attrs = layer.attrs
    floats = (0,) if layer.op_type == "QuantizeLinear" else (0, 1)  # its declared output type
    if attrs.get("block_size", 0) or attrs.get("precision", 0) \
            or attrs.get("output_dtype", 0) not in floats:
        return None
    names = [*layer.inputs, "", ""][1:3]
    scale = constants.get(names[0])
    zero = constants.get(names[1]) if names[1] else np.zeros((), np.uint8)
    if scale is None or zero is None or scale.dtype != np.float32 or scale.size != 1 \
            or zero.size != 1 or zero.dtype not in RANGES:
        return None
    return float(scale.reshape(())), float(zero.reshape(())), *RANGES[zero.dtype]


def _round_trip(layers: Sequence[Layer], steps: list[Step | None], index: int,
                sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> None:
    """QuantizeLinear -> DequantizeLinear with one constant per-tensor scale and zero point z,
    the integers read by the DequantizeLinear alone (the QDQ format's activations), as
    clamp(rint(x / s), low - z, high - z) * s, a NaN (quantized to 0) coming back as -z * s: one
    kernel on CUDA (``gpu_jit.ROUND_TRIP``), else five in place of eight (CpuAcc's
    ``fusion/quantized.py`` computes it so: the same values as the two layers', the integers exact
    in float32)."""
    after = sole(layers[index].outputs[0])
    dq = None if after is None else layers[after]
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain or steps[after] is None \
            or dq.inputs[0] != layers[index].outputs[0]:
        return
    into, back = _per_tensor(layers[index], constants), _per_tensor(dq, constants)
    if into is None or into != back:
        return
    scale, zero, low, high = into
    quantize, dequantize = steps[index][0], steps[after][0]  # type: ignore[index]
    count = len(layers[index].inputs)

    def workload(x: Any, *values: Any) -> tuple[Any, ...]:
        import torch

        if not (_on_gpu(x) and x.dtype == torch.float32):
            (q,) = quantize(x, *values[:count - 1])
            return dequantize(q, *values[count - 1:])  # type: ignore[no-any-return]
        if x.is_cuda:
            fused = gpu_jit.call(gpu_jit.ROUND_TRIP, x, s=scale, low=low - zero, high=high - zero,
                                 nan_value=float(np.float32(-zero * scale)))
            if fused is not None:
                return (fused,)
        t = torch.div(x, scale).round_().clamp_(low - zero, high - zero)
        return (t.nan_to_num_(-zero).mul_(scale),)

    steps[index] = None
    steps[after] = (workload, [*layers[index].inputs, *dq.inputs[1:]], dq.outputs)


def _centred(name: str, zero: str, constants: dict[str, np.ndarray], per: int) -> np.ndarray | None:
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


def _integer_columns(layer: Layer, constants: dict[str, np.ndarray]) -> np.ndarray | None:
    """MatMulInteger's B less its zero point, (K, N) float32, where B and its zero point are
    constants and every sum of A's row (8-bit less its zero point: within +-255) by a column is
    exact in float32."""
    names = [*layer.inputs, "", "", ""][:4]
    b = _centred(names[1], names[3], constants, per=-1)
    if b is None or b.ndim != 2 or 255 * np.abs(b).sum(0).max(initial=0) >= EXACT_F32:
        return None
    return b.astype(np.float32)


def _matmul_integer(kernel: Workload, b_columns: np.ndarray, as_float: bool,
                    centred: bool = False) -> Workload:
    """A @ (B - zb) as one float32 product on CUDA (three kernels: A's widening, its zero point
    taken, the product; int32 after unless ``as_float``, where a Cast to float32 read it), against
    A and B widened to float64, the product, its int64 and int32 conversions (and the Cast's).
    ``centred``: a float32 A is already less its zero point (``_dynamic_quantize``): one kernel."""
    import torch

    kept: dict[Any, Any] = {}

    def workload(A: Any, B: Any, a_zero: Any = None,  # noqa: N803
                 b_zero: Any = None) -> tuple[Any, ...]:
        read = (torch.float32,) if centred and A.dtype == torch.float32 else (torch.uint8,
                                                                             torch.int8)
        if not (_on_gpu(A) and A.dtype in read and A.dim() >= 2
                and A.shape[-1] == b_columns.shape[0]):
            (product,) = kernel(A, B, a_zero, b_zero)
            return (product.float(),) if as_float else (product,)
        if kept.get("device") != A.device:
            kept.update(device=A.device, b=torch.from_numpy(b_columns).to(A.device))
        a = A if A.dtype == torch.float32 else A.float()
        if a_zero is not None and A.dtype != torch.float32:
            a = a.sub_(a_zero.reshape(-1, 1))  # per row of A, as the kernel's (float: exact)
        product = torch.matmul(a, kept["b"])
        return (product,) if as_float else (product.to(torch.int32),)

    return workload


def _qlinear_conv(layer: Layer, kernel: Workload, constants: dict[str, np.ndarray],
                  ) -> Workload | None:
    """QLinearConv with every input but x constant, as ``kernels.quantization.q_linear_conv``
    computes it with its constant parts made once: the float64 convolution of x - zx by the
    weights less their zero points, the bias in it (the int32 sum the kernel wraps is exact
    where it stays within int32's range), times the multiplier, rounded, plus zy, saturated."""
    import torch

    names = [*layer.inputs, ""][:9]
    rest = [n for i, n in enumerate(names) if i != 0 and n]
    if not all(n in constants for n in rest):
        return None
    w = _centred(names[3], names[5], constants, per=0)
    if w is None or w.ndim < 3:
        return None
    bias = constants[names[8]].astype(np.float64) if names[8] else None
    reach = 255 * np.abs(w.reshape(w.shape[0], -1)).sum(1).max(initial=0) \
        + (0 if bias is None else np.abs(bias).max(initial=0))
    if reach >= 2 ** 31:
        return None  # the kernel's int32 sum wraps
    spatial = [1] * (w.ndim - 2)
    c = {n: torch.from_numpy(np.ascontiguousarray(constants[n])) for n in rest}
    w_scale = c[names[4]].float().reshape(-1, *spatial)
    multiplier = (c[names[1]].float() * w_scale / c[names[6]].float()).double()  # as the kernel
    zero_y = c[names[7]]
    attrs = {k: layer.attrs[k] for k in ("auto_pad", "dilations", "group", "kernel_shape", "pads",
                                         "strides") if k in layer.attrs}
    made = {"w": torch.from_numpy(w), "b": None if bias is None else torch.from_numpy(bias),
            "m": multiplier, "zy": zero_y.double(), "zx": c[names[2]].double()}
    info = torch.iinfo(zero_y.dtype)
    kept: dict[str, Any] = {}

    def workload(x: Any, *values: Any) -> tuple[Any, ...]:
        from backplane.backends.torch.kernels.nn import conv

        if not (_on_gpu(x) and x.dtype == zero_y.dtype and x.dim() == w.ndim):
            return kernel(x, *values)  # type: ignore[no-any-return]
        if kept.get("device") != x.device:
            kept.update({k: None if v is None else v.to(x.device) for k, v in made.items()},
                        device=x.device)
        (acc,) = conv(x.double().sub_(kept["zx"]), kept["w"], kept["b"], **attrs)
        y = acc.mul_(kept["m"]).round_().add_(kept["zy"])
        return (y.clamp_(info.min, info.max).to(zero_y.dtype),)

    return workload
