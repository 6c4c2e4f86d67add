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
from backplane.backends.torch import gpu_jit, gpu_qlinear
from backplane.backends.torch.gpu_qlinear import (EXACT_F32, less_zero_point, qlinear_conv,
                                                  qlinear_matmul)
from backplane.backends.torch.gpu_small import Step
from backplane.ir.graph import Layer


def int8_steps(layers: Sequence[Layer], steps: list[Step | None],
               sole: Callable[[str], int | None], constants: dict[str, np.ndarray],
               uses: dict[str, int] | None = None) -> None:
    """QDQ round trips, MatMulInteger (with its float Cast) and QLinearConv with constant
    weights as their forms above, where they are exact so; with ``uses`` (the readers of each
    value, the subgraph's outputs counted), their chains (``_int8_chains``). Rewrites ``steps``
    in place."""
    own = [None if step is None else step[0] for step in steps]
    _grid_round_trips(layers, steps, sole, constants)
    centred = _dynamic_pairs(layers, steps, sole, constants)
    trips: set[int] = set()
    for index, layer in enumerate(layers):
        step = steps[index]
        if step is None or layer.domain or index in trips:
            continue
        if layer.op_type == "QuantizeLinear":
            trips.add(_round_trip(layers, steps, index, sole, constants))
        if layer.op_type in ("QuantizeLinear", "DequantizeLinear") and steps[index] is not None:
            made = _one_scale(layer, step[0], constants)
            if made is not None:
                steps[index] = (made, step[1], step[2])
        if layer.op_type in ("QLinearConv", "QLinearMatMul"):
            made = (qlinear_conv if layer.op_type == "QLinearConv" else qlinear_matmul)(
                layer, step[0], constants)
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
    if uses is not None:
        _int8_chains(layers, steps, own, sole, uses, constants)


def _int8_chains(layers: Sequence[Layer], steps: list[Step | None], own: list[Workload | None],
                 sole: Callable[[str], int | None], uses: dict[str, int],
                 constants: dict[str, np.ndarray]) -> None:
    """QuantizeLinear -> QLinearConv or QLinearMatMul (float32 sums) -> DequantizeLinear, the
    QOperator format's blocks, with fewer kernels and no 8-bit tensor between them: the
    DequantizeLinear that alone reads the product's integers is computed with its
    requantization (``gpu_jit.REQUANTIZE_DEQUANTIZE``), and a QuantizeLinear whose every reader
    is such a product of its zero point gives x - zx as float32 (``gpu_jit.QUANTIZE_CENTRED``),
    which the product reads as it is. The values are the layers' bit for bit. ``own``: the
    layers' own workloads."""
    for index, layer in enumerate(layers):
        if layer.op_type not in ("QLinearConv", "QLinearMatMul") or steps[index] is None \
                or own[index] is None or layer.domain:
            continue
        after = sole(layer.outputs[0])
        dq = None if after is None else layers[after]
        if after is None or dq is None or dq.op_type != "DequantizeLinear" or dq.domain \
                or steps[after] is None or dq.inputs[0] != layer.outputs[0]:
            continue
        params = _per_tensor(dq, constants)
        form = qlinear_conv if layer.op_type == "QLinearConv" else qlinear_matmul
        both = _then(own[index], own[after], len(layer.inputs))
        made = None if params is None or both is None else form(layer, both, constants,
                                                                params[:2])
        if made is not None:
            steps[index] = None
            steps[after] = (made, [*layer.inputs, *dq.inputs[1:]], dq.outputs)
    for index, layer in enumerate(layers):
        params = _per_tensor(layer, constants) if layer.op_type == "QuantizeLinear" else None
        if params is None or steps[index] is None or own[index] is None or layer.domain:
            continue
        name = layer.outputs[0]
        readers = [s for s in steps if s is not None and name in s[1]]
        if not readers or uses.get(name) != len(readers) or not all(
                getattr(s[0], "reads_centred", False) and list(s[1]).index(name) == 0
                and list(s[1]).count(name) == 1 and _same(constants, s[1][2], layer, params)
                for s in readers):
            continue
        steps[index] = (_quantize_centred(own[index], *params), steps[index][1], [name])


def _then(first: Workload | None, second: Workload | None, count: int) -> Workload | None:
    """``first`` on its ``count`` inputs, then ``second`` on its output and the rest: the two
    layers' own kernels, where a joined form does not run."""
    if first is None or second is None:
        return None

    def workload(*values: Any) -> tuple[Any, ...]:
        (y,) = first(*values[:count])
        return second(y, *values[count:])  # type: ignore[no-any-return]

    return workload


def _same(constants: dict[str, np.ndarray], zero: str, quantize: Layer,
          params: tuple[float, float, int, int]) -> bool:
    """Whether a product's x zero point is the QuantizeLinear's, value and type."""
    value = constants.get(zero)
    names = [*quantize.inputs, "", ""][1:3]
    mine = constants.get(names[1]) if names[1] else np.zeros((), np.uint8)
    return value is not None and mine is not None and value.size == 1 \
        and value.dtype == mine.dtype and float(value.reshape(())) == params[1]


def _quantize_centred(kernel: Workload, scale: float, zero: float, low: int,
                      high: int) -> Workload:
    """QuantizeLinear less its zero point, as float32 (``_int8_chains``); the layer's kernel
    where x is not float32 (its readers then take the integers)."""
    import torch

    kept: dict[Any, Any] = {}

    def workload(x: Any, *values: Any) -> tuple[Any, ...]:
        if not (gpu_qlinear.on_gpu(x) and x.dtype == torch.float32):
            return kernel(x, *values)  # type: ignore[no-any-return]
        if kept.get("device") != x.device:
            kept.update(device=x.device, s=torch.tensor(scale, device=x.device))
        if x.is_cuda:
            made = gpu_jit.call(gpu_jit.QUANTIZE_CENTRED, x, kept["s"], z=zero, low=low,
                                high=high)
            if made is not None:
                return (made,)
        q = torch.div(x, kept["s"]).round_().add_(zero).clamp_(low, high)
        return (q.nan_to_num_(0.0).sub_(zero),)

    workload.centred = (scale, zero, low, high)  # type: ignore[attr-defined]  # gpu_chains' too
    return workload


def _dynamic_pairs(layers: Sequence[Layer], steps: list[Step | None],
                   sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> set[int]:
    """DynamicQuantizeLinear whose uint8 value and zero point the one MatMulInteger with a
    constant B alone reads (ONNX Runtime's quantize_dynamic writes one before each): on CUDA in
    one Triton kernel where x is small (``gpu_triton``), else two (min and max; the value less its
    zero point as float32 with the scale and zero point, ``gpu_jit.DYNAMIC_QUANTIZE``; three where
    that one cannot be made) in place of about 28 (the kernel's float64 scalar arithmetic, its conversions, the product's
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
            from backplane.backends.torch import gpu_triton

            made = gpu_triton.dynamic_quantize(x)  # one kernel where x is small
            if made is not None:
                return made
            low, high = torch.aminmax(x)
            made = gpu_jit.call(gpu_jit.DYNAMIC_QUANTIZE, x, low, high, outputs=3)
            if made is not None:  # every element of the last two the same: one is a 0-d view
                centred, scales, zeros = made
                return centred, scales.as_strided((), ()), zeros.as_strided((), ())
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


def _one_scale(layer: Layer, kernel: Workload, constants: dict[str, np.ndarray],
               ) -> Workload | None:
    """A QuantizeLinear (float32 in) or DequantizeLinear (8- or 16-bit in, float32 out) of one
    constant per-tensor scale and zero point as one kernel on CUDA (``gpu_jit.QUANTIZE`` and a
    cast to the integer type; ``gpu_jit.DEQUANTIZE``), where torch's kernels take five and three
    (resnet_qlinear_ort15's six and seven); the layer's kernel for other inputs."""
    import torch

    params = _per_tensor(layer, constants)
    if params is None:
        return None
    scale, zero, low, high = params
    names = [*layer.inputs, "", ""][1:3]
    into = torch.from_numpy(np.asarray(constants.get(names[1], np.zeros((), np.uint8)))).dtype
    quantize = layer.op_type == "QuantizeLinear"
    kept: dict[Any, Any] = {}

    def workload(x: Any, *values: Any) -> tuple[Any, ...]:
        if x.is_cuda and x.numel() and (x.dtype == torch.float32 if quantize
                                        else x.dtype in (torch.uint8, torch.int8, torch.int16,
                                                         torch.uint16)):
            if kept.get("device") != x.device:  # the scale as a tensor: float32 the kernel's type
                kept.update(device=x.device, s=torch.tensor(scale, device=x.device))
            made = (gpu_jit.call(gpu_jit.QUANTIZE, x, kept["s"], z=zero, low=low, high=high)
                    if quantize else gpu_jit.call(gpu_jit.DEQUANTIZE, x, kept["s"], z=zero))
            if made is not None:
                return (made.to(into),) if quantize else (made,)
        return kernel(x, *values)  # type: ignore[no-any-return]

    return workload


def _round_trip(layers: Sequence[Layer], steps: list[Step | None], index: int,
                sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> int:
    """QuantizeLinear -> DequantizeLinear with one constant per-tensor scale and zero point z,
    the integers read by the DequantizeLinear alone (the QDQ format's activations), as
    clamp(rint(x / s), low - z, high - z) * s, a NaN (quantized to 0) coming back as -z * s: one
    kernel on CUDA (``gpu_jit.ROUND_TRIP``), else five in place of eight (CpuAcc's
    ``fusion/quantized.py`` computes it so: the same values as the two layers', the integers exact
    in float32). The DequantizeLinear's index where made, else -1."""
    after = sole(layers[index].outputs[0])
    dq = None if after is None else layers[after]
    if after is None or dq is None or dq.op_type != "DequantizeLinear" or dq.domain \
            or steps[after] is None or dq.inputs[0] != layers[index].outputs[0]:
        return -1
    into, back = _per_tensor(layers[index], constants), _per_tensor(dq, constants)
    if into is None or into != back:
        return -1
    scale, zero, low, high = into
    quantize, dequantize = steps[index][0], steps[after][0]  # type: ignore[index]
    count = len(layers[index].inputs)

    def workload(x: Any, *values: Any) -> tuple[Any, ...]:
        import torch

        if not (gpu_qlinear.on_gpu(x) and x.dtype == torch.float32):
            (q,) = quantize(x, *values[:count - 1])
            return dequantize(q, *values[count - 1:])  # type: ignore[no-any-return]
        if x.is_cuda:
            fused = gpu_jit.call(gpu_jit.ROUND_TRIP, x, s=scale, low=low - zero, high=high - zero,
                                 nan_value=float(np.float32(-zero * scale)))
            if fused is not None:
                return (fused,)
        t = torch.div(x, scale).round_().clamp_(low - zero, high - zero)
        return (t.nan_to_num_(-zero).mul_(scale),)

    workload.round_trip = (scale, low - zero, high - zero,  # type: ignore[attr-defined]
                           float(np.float32(-zero * scale)))  # gpu_chains writes it in a tree
    steps[index] = None
    steps[after] = (workload, [*layers[index].inputs, *dq.inputs[1:]], dq.outputs)
    return after


SELECTING = frozenset({"MaxPool", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose",
                       "Identity"})
"""Layers whose every output value is one of their input's values (a MaxPool's window always
holds one: its pads are under half the kernel)."""


def _grid_round_trips(layers: Sequence[Layer], steps: list[Step | None],
                      sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> None:
    """Round trips that give back what they read, dropped: a QuantizeLinear -> DequantizeLinear
    after a MaxPool, Flatten or reshaping of a DequantizeLinear of the same scale, zero point and
    type (resnet_qdq_ort17's after its MaxPool and its Flatten; ONNX Runtime's quantizer writes
    one after each such layer). Its input is (q - z) * s for an integer q of the type, NaN-free;
    rint((q - z) * s / s) is q - z (the two roundings are within 2^-23 of it, and |q - z| <= 65535
    leaves them far from a tie), inside the clamp: the same value back. The layer between then
    writes the DequantizeLinear's output itself. The DequantizeLinear before names its zero
    point (without one its integers' type is not known here: an int32 x would pass the clamp)."""
    made = {layer.outputs[0]: i for i, layer in enumerate(layers) if layer.outputs}
    for index, layer in enumerate(layers):
        if layer.op_type != "QuantizeLinear" or layer.domain or steps[index] is None:
            continue
        after = sole(layer.outputs[0])
        dq = None if after is None else layers[after]
        between = made.get(layer.inputs[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.domain or steps[after] is None \
                or dq.inputs[0] != layer.outputs[0] or between is None \
                or sole(layer.inputs[0]) != index:
            continue
        middle = layers[between]
        source = made.get(middle.inputs[0]) if middle.inputs else None
        params = _per_tensor(layer, constants)
        if middle.op_type not in SELECTING or middle.domain or len(middle.outputs) != 1 \
                or steps[between] is None or list(steps[between][2]) != middle.outputs \
                or source is None or layers[source].op_type != "DequantizeLinear" \
                or layers[source].domain or params is None \
                or not [*layers[source].inputs, "", ""][2] \
                or _per_tensor(dq, constants) != params \
                or _per_tensor(layers[source], constants) != params:
            continue
        kernel, reads, _ = steps[between]  # type: ignore[misc]
        steps[between] = (kernel, reads, dq.outputs)
        steps[index] = steps[after] = None


def _integer_columns(layer: Layer, constants: dict[str, np.ndarray]) -> np.ndarray | None:
    """MatMulInteger's B less its zero point, (K, N) float32, where B and its zero point are
    constants and every sum of A's row (8-bit less its zero point: within +-255) by a column is
    exact in float32."""
    names = [*layer.inputs, "", "", ""][:4]
    b = less_zero_point(names[1], names[3], constants, per=-1)
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
        if not (gpu_qlinear.on_gpu(A) and A.dtype in read and A.dim() >= 2
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
