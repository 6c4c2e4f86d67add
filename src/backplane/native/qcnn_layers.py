"""Each ONNX op's records for ``qcnn.plan``: one function an op, in ``PLANNERS``. A function checks
what the kernels take (raising ``Unplannable`` with the reason), packs the weights, places its
output and writes its records; a pattern's later layers (the QuantizeLinear after a QDQ
convolution) it marks done."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.ir.graph import Layer
from backplane.native import qcnn_bytes, qcnn_float, qcnn_weights
from backplane.native.qcnn import OCB, Pending, Planner, Unplannable, dims_of

F32 = np.float32
RANGES = {"u8": (0, 255), "s8": (-128, 127)}
KINDS = {np.dtype(np.uint8): "u8", np.dtype(np.int8): "s8"}


def _step(p: Planner, layer: Layer, at: int = 1) -> tuple[F32, int, str]:
    """A QuantizeLinear's or DequantizeLinear's per-tensor 8-bit step: (scale, zero, kind)."""
    scale, zero = p.const(layer.inputs[at]), p.const(layer.inputs[at + 1]) \
        if len(layer.inputs) > at + 1 else None
    if scale is None or scale.dtype != F32 or scale.size != 1 or layer.attrs.get("block_size") \
            or len(layer.inputs) > at + 1 and layer.inputs[at + 1] and zero is None:
        raise Unplannable(f"{layer.name}: a step not per tensor, or not constant")
    if zero is None and layer.attrs.get("output_dtype", 0) not in (0, 2):
        raise Unplannable(f"{layer.name}: output_dtype {layer.attrs.get('output_dtype')}")
    kind = KINDS.get(np.dtype(np.uint8) if zero is None else zero.dtype)
    if kind is None or zero is not None and zero.size != 1:
        raise Unplannable(f"{layer.name}: a zero point of {zero.dtype}, not 8-bit")
    return F32(scale.reshape(())), 0 if zero is None else int(zero.reshape(())), kind


def _index(p: Planner, layer: Layer) -> int:
    return next(i for i, lay in enumerate(p.layers) if lay is layer)


def quantize(p: Planner, layer: Layer, index: int) -> None:
    scale, zero, kind = _step(p, layer)
    x, out = layer.inputs[0], layer.outputs[0]
    pending = p.pending.get(x)
    if pending is not None and (pending.scale, pending.zero) == (scale, zero) \
            and p.quantized(pending.source).kind == kind:  # Q(DQ(x_q)) of one step: x_q
        p.values[out] = p.values[pending.source]
        return
    value = p.real(x)
    y = p.new(out, value.shape, kind, (scale, zero))
    lo, hi = RANGES[kind]
    p.record("quant", in_=value.offset, out=y.offset, dims=value.dims,
             moff=p.param(np.array([scale], F32)), zy=zero, lo=lo, hi=hi, signed=int(kind == "s8"))


def dequantize(p: Planner, layer: Layer, index: int) -> None:
    scale, zero, kind = _step(p, layer)
    source = p.quantized(layer.inputs[0])
    if source.kind != kind:
        raise Unplannable(f"{layer.name}: a {kind} step of a {source.kind} tensor")
    p.pending[layer.outputs[0]] = Pending(layer.inputs[0], scale, zero)


def _then_quantize(p: Planner, layer: Layer) -> tuple[Layer, tuple[F32, int, str], list[Layer],
                                                    tuple[float, float] | None]:
    """The QuantizeLinear that alone reads ``layer``'s output (through a Relu or a Clip of
    constant bounds that alone reads it), its step, the layers between and their bounds on the
    real value (None: no Relu or Clip)."""
    reader, between, bounds = p.sole_reader(layer.outputs[0]), [], None
    if reader is not None and reader.domain in ("", "ai.onnx") and reader.op_type in ("Relu",
                                                                                     "Clip"):
        bounds = (0.0, math.inf) if reader.op_type == "Relu" else qcnn_float.clip_bounds(p, reader)
        between = [reader]
        reader = p.sole_reader(reader.outputs[0])
    if reader is None or reader.op_type != "QuantizeLinear" or reader.domain not in ("", "ai.onnx"):
        raise Unplannable(f"{layer.name}: a float output (no QuantizeLinear alone reads it)")
    return reader, _step(p, reader), between, bounds


def qdq_conv(p: Planner, layer: Layer, index: int) -> None:
    """DequantizeLinear(x_q) -> Conv / Gemm / MatMul -> QuantizeLinear: one quantized product,
    its weight and bias the integers their folded constants were dequantized from."""
    pending = p.pending.get(layer.inputs[0])
    if pending is None or not _quantized_after(p, layer):
        _float_product(p, layer)
        return
    weight = p.const(layer.inputs[1])
    bias = p.const(layer.inputs[2]) if len(layer.inputs) > 2 and layer.inputs[2] else None
    a = layer.attrs
    if weight is None or weight.dtype != F32 or bias is not None and bias.dtype != F32 or \
            len(layer.inputs) > 2 and layer.inputs[2] and bias is None:
        raise Unplannable(f"{layer.name}: a weight or bias not a float32 constant")
    if layer.op_type == "Conv":
        kernel = weight
    elif layer.op_type == "Gemm":
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0) \
                or weight.ndim != 2:
            raise Unplannable(f"{layer.name}: a Gemm with alpha, beta or transA")
        kernel = (weight if a.get("transB", 0) else weight.T)[:, :, None, None]
    else:  # MatMul by a 2-d constant
        if weight.ndim != 2:
            raise Unplannable(f"{layer.name}: a MatMul by a {weight.ndim}-d constant")
        kernel = weight.T[:, :, None, None]
    found = qcnn_weights.integer_weight(weight if layer.op_type == "Conv" else kernel)
    if found is None:
        raise Unplannable(f"{layer.name}: the weight is no int8 tensor times a scale")
    ints, w_scale = found
    oc = ints.shape[0]
    q, y_step, between, bounds = _then_quantize(p, layer)
    geometry = _geometry(p, layer, ints.shape[2:]) if layer.op_type == "Conv" else None
    x_step = (pending.scale, pending.zero)
    try:
        units, bias_f = qcnn_float.bias(bias, pending.scale, w_scale, oc)
    except Unplannable as why:
        raise Unplannable(f"{layer.name}: {why}") from None
    kept = bool(between)
    if kept and units is not None and qcnn_float.redundant(p, between[0], q, y_step):
        kept, bounds = False, None  # ONNX Runtime drops it: its QLinearConv saturates only
    if (kept or units is None) and geometry is not None and qcnn_float.depthwise_float(
            p, layer, pending.source, x_step, weight, bias_f, q.outputs[0], y_step, geometry,
            bounds or (-math.inf, math.inf)):
        p.done.update(_index(p, lay) for lay in (*between, q))
        return
    _qconv(p, layer, pending.source, x_step, ints, np.zeros(oc), w_scale,
           np.zeros(oc) if units is None else units, q.outputs[0], y_step, geometry, bounds,
           None if units is not None else bias_f)
    p.done.update(_index(p, lay) for lay in (*between, q))


def _quantized_after(p: Planner, layer: Layer) -> bool:
    try:
        _then_quantize(p, layer)
    except Unplannable:
        return False
    return True


def _float_product(p: Planner, layer: Layer) -> None:
    """A Gemm or MatMul of a float input by a constant, with a float output (a classifier's head
    after a ReduceMean): float32 sums, as ONNX Runtime runs it unquantized (not bit for bit: its
    sums are MLAS's, in another order)."""
    a = layer.attrs
    weight = p.const(layer.inputs[1])
    bias = p.const(layer.inputs[2]) if len(layer.inputs) > 2 and layer.inputs[2] else None
    x = p.real(layer.inputs[0])
    if layer.op_type == "Conv" or weight is None or weight.ndim != 2 or len(x.shape) != 2 \
            or a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 \
            or len(layer.inputs) > 2 and layer.inputs[2] and bias is None:
        raise Unplannable(f"{layer.name}: a float {layer.op_type} (its input not dequantized, or "
                          "its output not quantized)")
    transposed = weight.T if layer.op_type == "Gemm" and a.get("transB", 0) else weight
    rows, k = x.shape
    if transposed.shape[0] != k:
        raise Unplannable(f"{layer.name}: ({rows}, {k}) by {weight.shape}")
    oc = transposed.shape[1]
    full = np.zeros(oc, F32) if bias is None else np.broadcast_to(bias.astype(F32), (oc,))
    y = p.new(layer.outputs[0], (rows, oc), "f")
    p.record("linear_f", in_=x.offset, out=y.offset, dims=x.dims, oc=oc,
             woff=p.param(np.ascontiguousarray(transposed, F32)),
             boff=p.param(np.ascontiguousarray(full, F32)))


def qlinear_conv(p: Planner, layer: Layer, index: int) -> None:
    x_scale, x_zero, _ = _step(p, layer, 1)
    weight, w_scale, w_zero = (p.const(n) for n in layer.inputs[3:6])
    y_scale, y_zero, y_kind = _step(p, layer, 6)
    bias = p.const(layer.inputs[8]) if len(layer.inputs) > 8 and layer.inputs[8] else None
    if weight is None or w_scale is None or w_zero is None or weight.dtype not in KINDS \
            or len(layer.inputs) > 8 and layer.inputs[8] and bias is None:
        raise Unplannable(f"{layer.name}: a weight, scale or bias not constant")
    oc = weight.shape[0]
    _qconv(p, layer, layer.inputs[0], (x_scale, x_zero), weight, _per(w_zero, oc),
           _per(w_scale, oc).astype(F32), np.zeros(oc) if bias is None else bias,
           layer.outputs[0], (y_scale, y_zero, y_kind), _geometry(p, layer, weight.shape[2:]))


def qlinear_matmul(p: Planner, layer: Layer, index: int) -> None:
    x_scale, x_zero, _ = _step(p, layer, 1)
    weight, w_scale, w_zero = (p.const(n) for n in layer.inputs[3:6])
    y_scale, y_zero, y_kind = _step(p, layer, 6)
    if weight is None or w_scale is None or w_zero is None or weight.ndim != 2 \
            or weight.dtype not in KINDS:
        raise Unplannable(f"{layer.name}: a product by no 2-d 8-bit constant")
    oc = weight.shape[1]
    _qconv(p, layer, layer.inputs[0], (x_scale, x_zero), weight.T[:, :, None, None],
           _per(w_zero, oc), _per(w_scale, oc).astype(F32), np.zeros(oc), layer.outputs[0],
           (y_scale, y_zero, y_kind), None)


def _per(values: np.ndarray, count: int) -> np.ndarray:
    """A per-tensor or per-channel constant as ``count`` values."""
    flat = values.reshape(-1)
    if flat.size not in (1, count):
        raise Unplannable(f"{flat.size} scales or zero points for {count} channels")
    return np.broadcast_to(flat, (count,))


def _geometry(p: Planner, layer: Layer, kernel: tuple[int, ...]) -> tuple[Any, ...]:
    """A Conv's or QLinearConv's strides, dilations, begins and ends (2-d only)."""
    from backplane.backends.reference.kernels.conv import spatial_pads

    a, x = layer.attrs, p.values.get(layer.inputs[0]) or p.values[
        p.pending[layer.inputs[0]].source]
    group = int(a.get("group", 1))
    if len(x.shape) != 4 or len(kernel) != 2 or x.shape[1] % group:
        raise Unplannable(f"{layer.name}: a {len(x.shape)}-d input, group {group}")
    strides = list(a.get("strides") or [1, 1])
    dilations = list(a.get("dilations") or [1, 1])
    begins, ends = spatial_pads(x.shape[2:], kernel, strides, dilations,
                                a.get("auto_pad", "NOTSET"), a.get("pads"))
    if min(*begins, *ends) < 0:
        raise Unplannable(f"{layer.name}: negative pads")
    return strides, dilations, begins, ends, group


def _qconv(p: Planner, layer: Layer, x_name: str, x_step: tuple[F32, int], ints: np.ndarray,
           w_zero: np.ndarray, w_scale: np.ndarray, bias: np.ndarray, y_name: str,
           y_step: tuple[F32, int, str], geometry: tuple[Any, ...] | None,
           bounds: tuple[float, float] | None = None, float_bias: np.ndarray | None = None,
           part: tuple[int, int, int, int] | None = None) -> None:
    """``part``: one group of a grouped convolution (its first input channel, the input's
    channels, its first output channel, the output's), a record of its own."""
    x = p.quantized(x_name)
    n, c, h, w = x.dims
    oc, icg, kh, kw = ints.shape
    (sh, sw), (dh, dw), (pt, pl), (pb, pr), group = geometry or ([1, 1], [1, 1], [0, 0], [0, 0], 1)
    c = icg if part else c
    depthwise = group > 1 and group == c == oc and icg == 1
    if icg * group != c or oc % group or geometry is None and len(x.shape) != 2:
        raise Unplannable(f"{layer.name}: {c} channels in, a weight of {icg}, group {group}")
    if group > 1 and not depthwise:  # each group a convolution of its channels
        p.new(y_name, (n, oc, *_out_size(h, w, ints.shape[2:], geometry)), y_step[2], y_step[:2])
        per = [np.broadcast_to(np.asarray(v).reshape(-1), (oc,)) for v in (w_zero, w_scale, bias)]
        g_oc = oc // group
        for g in range(group):
            at = slice(g * g_oc, (g + 1) * g_oc)
            _qconv(p, layer, x_name, x_step, ints[at], per[0][at], per[1][at], per[2][at], y_name,
                   y_step, (*geometry[:4], 1), bounds,
                   None if float_bias is None else float_bias[at], (g * icg, c, g * g_oc, oc))
        return
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (w + pl + pr - (kw - 1) * dw - 1) // sw + 1
    icp = c if depthwise or dw == 1 else c + c % 2  # (dw 1: a row's kw * c values in one run)
    blocks = 1 if depthwise else -(-oc // OCB)
    centred = ints.astype(np.int32) - np.asarray(w_zero, np.int32).reshape(-1, 1, 1, 1)
    on_bytes = None if depthwise or not qcnn_bytes.available() else qcnn_bytes.pack(
        centred, bias, x_step[1], x.kind == "s8", dw)
    dw_bytes = None if not depthwise or not qcnn_bytes.available() else \
        qcnn_bytes.pack_depthwise(centred, bias, x_step[1], x.kind == "s8")
    if on_bytes is not None:  # u8 x s8 products, vpdpbusd (qcnn_bytes.py)
        packed, bias, icp = on_bytes
    elif dw_bytes is not None:  # four taps of 64 channels a vpdpbusd (qcnn_dw8.h)
        packed, bias = dw_bytes
        blocks = -(-oc // OCB)
    elif depthwise:  # [ceil(kh * kw / 2)][c][2]: two taps' weights a channel side by side
        pairs = -(-kh * kw // 2)
        taps = np.zeros((oc, 2 * pairs), np.int16)
        taps[:, :kh * kw] = centred.reshape(oc, kh * kw)
        packed = np.ascontiguousarray(taps.reshape(oc, pairs, 2).transpose(1, 0, 2))
        blocks = -(-oc // OCB)
    elif dw == 1:  # [blocks][kh][ceil(kw * c / 2)][OCB][2]: a row's values, zero past its end
        pairs = -(-kw * c // 2)
        packed = np.zeros((blocks * OCB, kh, 2 * pairs), np.int16)
        packed[:oc, :, :kw * c] = centred.transpose(0, 2, 3, 1).reshape(oc, kh, kw * c)
        packed = packed.reshape(blocks, OCB, kh, pairs, 2).transpose(0, 2, 3, 1, 4)
    else:  # [blocks][kh][kw][icp / 2][OCB][2]
        packed = np.zeros((blocks * OCB, icp, kh, kw), np.int16)
        packed[:oc, :c] = centred
        packed = packed.reshape(blocks, OCB, icp // 2, 2, kh, kw).transpose(0, 4, 5, 2, 1, 3)
    multiplier = (F32(x_step[0]) * np.asarray(w_scale, F32)) / F32(y_step[0])
    padded_bias = np.zeros(blocks * OCB, np.int32)
    padded_bias[:oc] = np.asarray(bias, np.int64).reshape(-1)
    padded_multiplier = np.zeros(blocks * OCB, F32)
    padded_multiplier[:oc] = multiplier
    ph = max(h + pt, (oh - 1) * sh + (kh - 1) * dh + 1)
    pw = max(w + pl, (ow - 1) * sw + (kw - 1) * dw + 1)
    bytes_in = on_bytes is not None or dw_bytes is not None
    p.scratch = max(p.scratch, n * ph * pw * icp * (1 if bytes_in else 2) + 256)  # (a row's
    # last pair or quad, a depthwise group's 64 bytes, reads past it)
    shape = (n, oc, oh, ow) if len(x.shape) == 4 else (n, oc)
    y = p.values[y_name] if part else p.new(y_name, shape, y_step[2], y_step[:2])
    at = part or (0, 0, 0, 0)
    lo, hi = RANGES[y_step[2]]
    limits = 0
    if bounds is not None:  # a Relu's or Clip's bounds in steps of y (the requantized value's unit)
        limits = 1 + p.param(np.array([np.float32(b) / F32(y_step[0]) if math.isfinite(b) else
                                       np.float32(b) for b in bounds], F32))
    kind = ("qdw8" if dw_bytes is not None else "qdwconv") if depthwise else \
        "qconv8" if on_bytes is not None else "qconv"
    p.record(kind, in_=x.offset + at[0], out=y.offset + at[2],
             dims=(n, c, h, w), cs=at[1], ocs=at[3], oh=oh,
             ow=ow, oc=oc, kh=kh, kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt, pl=pl,
             woff=p.param(np.ascontiguousarray(packed)), boff=p.param(padded_bias),
             moff=p.param(padded_multiplier), ph=ph, pw=pw, icp=icp, zx=x_step[1],
             zy=y_step[1], lo=lo, hi=hi, signed=int(x.kind == "s8"), x1=limits,
             in2=-1 if float_bias is None else qcnn_float.float_bias(
                 p, float_bias, x_step[0], w_scale, y_step[0], blocks))
    p.macs += n * oh * ow * oc * icg * kh * kw


def _out_size(h: int, w: int, kernel: tuple[int, ...], geometry: tuple[Any, ...]
              ) -> tuple[int, int]:
    (sh, sw), (dh, dw), (pt, pl), (pb, pr) = geometry[:4]
    return ((h + pt + pb - (kernel[0] - 1) * dh - 1) // sh + 1,
            (w + pl + pr - (kernel[1] - 1) * dw - 1) // sw + 1)


def _pool_geometry(layer: Layer, dims: tuple[int, ...]) -> dict[str, int]:
    a = layer.attrs
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or a.get("storage_order", 0):
        raise Unplannable(f"{layer.name}: {layer.op_type} ({a})")
    n, c, h, w = dims
    kh, kw = a["kernel_shape"]
    sh, sw = a.get("strides") or (1, 1)
    dh, dw = a.get("dilations") or (1, 1)
    pads = a.get("pads") if a.get("auto_pad", "NOTSET") == "NOTSET" else None
    pt, pl, pb, pr = pads or (0, 0, 0, 0)
    out = []
    for size, k, s, d, b, e in ((h, kh, sh, dh, pt, pb), (w, kw, sw, dw, pl, pr)):
        count = (size + b + e - (k - 1) * d - 1) / s + 1
        o = math.ceil(count) if a.get("ceil_mode") else math.floor(count)
        if a.get("ceil_mode") and (o - 1) * s >= size + b:
            o -= 1
        out.append(o)
    return {"oh": out[0], "ow": out[1], "kh": kh, "kw": kw, "sh": sh, "sw": sw, "dh": dh,
            "dw": dw, "pt": pt, "pl": pl, "ph": h + pb, "pw": w + pr,
            "x1": int(a.get("count_include_pad", 0))}


def max_pool(p: Planner, layer: Layer, index: int) -> None:
    """A MaxPool between a DequantizeLinear and a QuantizeLinear of one step runs on the bytes
    (a max of integers is the integer of the max); any other on floats."""
    pending, reader = p.pending.get(layer.inputs[0]), p.sole_reader(layer.outputs[0])
    bytes_in = p.values.get(layer.inputs[0])
    if bytes_in is not None and bytes_in.kind != "f" and len(bytes_in.shape) == 4:  # QOperator's
        g = _pool_geometry(layer, bytes_in.dims)
        y = p.new(layer.outputs[0], (*bytes_in.shape[:2], g["oh"], g["ow"]), bytes_in.kind,
                  bytes_in.step)
        p.record("maxpool_q", in_=bytes_in.offset, out=y.offset, dims=bytes_in.dims,
                 signed=int(bytes_in.kind == "s8"), **g)
        return
    if pending is not None and reader is not None and reader.op_type == "QuantizeLinear":
        source = p.quantized(pending.source)
        if _step(p, reader) == (pending.scale, pending.zero, source.kind) \
                and len(source.shape) == 4:
            g = _pool_geometry(layer, source.dims)
            y = p.new(reader.outputs[0], (*source.shape[:2], g["oh"], g["ow"]), source.kind,
                      source.step)
            p.record("maxpool_q", in_=source.offset, out=y.offset, dims=source.dims,
                     signed=int(source.kind == "s8"), **g)
            p.done.add(_index(p, reader))
            return
    _float_pool(p, layer, "maxpool_f")


def _float_pool(p: Planner, layer: Layer, op: str) -> None:
    x = p.real(layer.inputs[0])
    if len(x.shape) != 4:
        raise Unplannable(f"{layer.name}: over {x.shape}")
    if op == "gap_f":
        y = p.new(layer.outputs[0], (*x.shape[:2], 1, 1), "f")
        p.record(op, in_=x.offset, out=y.offset, dims=x.dims)
        return
    if op == "avgpool_f" and tuple(layer.attrs.get("dilations") or (1, 1)) != (1, 1):
        raise Unplannable(f"{layer.name}: a dilated AveragePool")
    g = _pool_geometry(layer, x.dims)
    y = p.new(layer.outputs[0], (*x.shape[:2], g["oh"], g["ow"]), "f")
    p.record(op, in_=x.offset, out=y.offset, dims=x.dims, **g)


def reduce_mean(p: Planner, layer: Layer, index: int) -> None:
    """ReduceMean over the spatial axes of a 4-d tensor: a global average pool."""
    x = p.real(layer.inputs[0])
    axes = layer.attrs.get("axes")
    if axes is None and len(layer.inputs) > 1 and layer.inputs[1]:
        axes = p.const(layer.inputs[1])
    if len(x.shape) != 4 or axes is None or sorted(int(a) % 4 for a in axes) != [2, 3]:
        raise Unplannable(f"{layer.name}: ReduceMean over axes {axes} of {x.shape}")
    n, c = x.shape[:2]
    y = p.new(layer.outputs[0], (n, c, 1, 1) if layer.attrs.get("keepdims", 1) else (n, c), "f")
    p.record("gap_f", in_=x.offset, out=y.offset, dims=x.dims)


def relu(p: Planner, layer: Layer, index: int) -> None:
    """A Relu of a DequantizeLinear it alone reads is that DequantizeLinear's, in one pass."""
    name = layer.inputs[0]
    pending = p.pending.get(name)
    if pending is not None and name not in p.values and p.sole_reader(name) is layer:
        source = p.quantized(pending.source)
        y = p.new(layer.outputs[0], source.shape, "f")
        p.record("dequant", in_=source.offset, out=y.offset, dims=source.dims,
                 moff=p.param(np.array([pending.scale], F32)), zx=pending.zero,
                 signed=int(source.kind == "s8"), x1=1)
        return
    x = p.real(name)
    y = p.new(layer.outputs[0], x.shape, "f")
    p.record("relu_f", in_=x.offset, out=y.offset, dims=x.dims)


def add(p: Planner, layer: Layer, index: int) -> None:
    first, second = layer.inputs[:2]
    constant = p.const(second) if p.const(first) is None else p.const(first)
    if constant is not None:
        x = p.real(second if p.const(first) is not None else first)
        c = x.dims[1]
        shape = constant.shape
        per_channel = constant.size == c and (len(shape) == 1 and len(x.shape) == 2 or
                                              shape[-len(x.shape) + 1:] in ((c,), (c, 1, 1)))
        if constant.dtype != F32 or not (constant.size == 1 or per_channel) \
                or np.broadcast_shapes(shape, x.shape) != x.shape:
            raise Unplannable(f"{layer.name}: Add of a constant {shape} to {x.shape}")
        y = p.new(layer.outputs[0], x.shape, "f")
        p.record("addc_f", in_=x.offset, out=y.offset, dims=x.dims,
                 boff=p.param(np.ascontiguousarray(constant, F32).reshape(-1)), x1=constant.size)
        return
    a, b = p.real(first), p.real(second)
    if a.shape != b.shape:
        raise Unplannable(f"{layer.name}: Add of {a.shape} and {b.shape}")
    y = p.new(layer.outputs[0], a.shape, "f")
    p.record("add_f", in_=a.offset, in2=b.offset, out=y.offset, dims=a.dims)


def view(p: Planner, layer: Layer, index: int) -> None:
    """Flatten, Reshape, Identity: the same place, where channels-last and NCHW order the elements
    alike (1x1 pixels); of a pending DequantizeLinear, a pending one of the viewed bytes; of
    8-bit values (the QOperator format's), those bytes."""
    name, out = layer.inputs[0], layer.outputs[0]
    pending = p.pending.get(name) if name not in p.values else None
    value = p.quantized(pending.source) if pending is not None else p.values[name] \
        if name in p.values else p.real(name)
    shape = _target(p, layer, value.shape)
    if math.prod(shape) != value.size or layer.op_type != "Identity" and \
            value.dims[2] * value.dims[3] != 1:
        raise Unplannable(f"{layer.name}: {layer.op_type} {value.shape} -> {shape}")
    dims_of(shape)
    if pending is not None:
        alias = f"{out} (bytes)"
        p.values[alias] = type(value)(value.offset, dims_of(shape), shape, value.kind, value.step)
        p.pending[out] = Pending(alias, pending.scale, pending.zero)
    else:
        p.values[out] = type(value)(value.offset, dims_of(shape), shape, value.kind, value.step)


def _target(p: Planner, layer: Layer, shape: tuple[int, ...]) -> tuple[int, ...]:
    a = layer.attrs
    if layer.op_type == "Identity":
        return shape
    if layer.op_type == "Flatten":
        axis = a.get("axis", 1) % len(shape)
        return (math.prod(shape[:axis]), math.prod(shape[axis:]))
    target = p.const(layer.inputs[1]) if len(layer.inputs) > 1 else None
    if target is None:
        raise Unplannable(f"{layer.name}: a Reshape to a computed shape")
    return tuple(np.empty(shape, np.uint8).reshape(
        [d if d != 0 or a.get("allowzero") else shape[i] for i, d in enumerate(target)]).shape)


PLANNERS: dict[str, Callable[[Planner, Layer, int], None]] = {
    "QuantizeLinear": quantize, "DequantizeLinear": dequantize, "QLinearConv": qlinear_conv,
    "QLinearMatMul": qlinear_matmul, "Conv": qdq_conv, "Gemm": qdq_conv, "MatMul": qdq_conv,
    "MaxPool": max_pool, "AveragePool": lambda p, lay, i: _float_pool(p, lay, "avgpool_f"),
    "GlobalAveragePool": lambda p, lay, i: _float_pool(p, lay, "gap_f"), "Relu": relu,
    "Add": add, "ReduceMean": reduce_mean, "Flatten": view, "Reshape": view, "Identity": view,
    "HardSigmoid": qcnn_float.hard_sigmoid, "Mul": qcnn_float.mul}
