"""Each layer kind's records for ``cnn.plan``: one function a kind, in ``PLANNERS``. A function
checks what the kernels take (raising ``Unplannable`` with the reason), packs the weights, places
its output and writes its records."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.ir.graph import Layer
from backplane.native import cnn_detect, cnn_moves
from backplane.native.cnn import ACTS, ELEMENTWISE, FIELDS, VIEWS, Unplannable, _Planner

FUSED = "backplane.torch"  # CpuAcc's fused layers' domain (torch.backend.FUSED_DOMAIN)
FUSED_OPS = ("FusedConv", "Linear", "AffineChain", "GeluChain", "GroupNorm")


TILE_PIXELS = 14
"""The most output pixels a convolution's register tile takes (cnn_conv.h's PB_ALL)."""
_width: list[int] = []


def vector_width() -> int:
    """The floats a vector of the built cnn library holds, its ``backplane_cnn_vector_width()``:
    16 where it was built with AVX-512, else 8 (8 too where none can be built: no plan then
    runs). Asked of the library, never of /proc/cpuinfo: the library is what runs the plan."""
    if not _width:
        from backplane.native import NativeUnavailable, library

        try:
            _width.append(int(library("cnn").backplane_cnn_vector_width()))
        except NativeUnavailable:
            return 8
    return _width[0]


def block_width(ocg: int, width: int) -> int:
    """The output channels of a group a convolution's weights are packed in blocks of, for a
    library of vectors ``width`` floats wide: 8 or 16 for 8 (a 8 x 8 or 6 x 16 register tile);
    for 16, 8 where a group has no more, else the one of 16, 32, 48 (tiles of 14, 12, 8 pixels)
    that pads the group's channels least, the wider on a tie (fewer broadcasts of the input). A
    library of either width runs a plan packed for the other (cnn_conv.h's ``block``)."""
    if ocg <= 8:
        return 8
    if width < 16:
        return 16
    return min((48, 32, 16), key=lambda vb: -(-ocg // vb) * vb)


def _input_and_weight(p: _Planner, layer: Layer) -> tuple[Any, np.ndarray]:
    """A fused layer's first input and its weight in float32: a float16 one too where the layer
    computes in float32 (a float16 partition's, as ONNX Runtime's CPU computes it); one computing
    in another precision (bfloat16) is not planned."""
    a = layer.attrs
    if a.get("compute", "float32") != "float32" or a.get("source", "float16") != "float16":
        raise Unplannable(f"{layer.name}: computed in {a.get('compute')}")
    return p.value(layer.inputs[0]), np.asarray(a["weight"], np.float32)


def conv(p: _Planner, layer: Layer) -> None:
    """An ONNX Conv the fuser left alone (a float16 partition's: computed in float32), 1-d or
    2-d, its weight and bias constants: FusedConv's record, its post-op and residual taken by
    ``fold`` from the layers after it."""
    from backplane.backends.reference.kernels.conv import spatial_pads

    a, x = layer.attrs, p.value(layer.inputs[0])
    weight = p.constants.get(layer.inputs[1]) if len(layer.inputs) > 1 else None
    bias = layer.inputs[2] if len(layer.inputs) > 2 else ""
    if weight is None or weight.ndim not in (3, 4) or len(x.shape) != weight.ndim \
            or bias and bias not in p.constants:
        raise Unplannable(f"{layer.name}: Conv over {x.shape}")
    rank = weight.ndim - 2
    strides, dilations = a.get("strides") or [1] * rank, a.get("dilations") or [1] * rank
    begins, ends = spatial_pads(x.shape[2:], weight.shape[2:], strides, dilations,
                                a.get("auto_pad", "NOTSET"), a.get("pads"))
    weight = np.asarray(weight, np.float32)
    if rank == 1:  # a line: a 2-d convolution of height 1
        weight, strides, dilations = weight[:, :, None, :], [1, *strides], [1, *dilations]
        begins, ends = [0, *begins], [0, *ends]
    n, _, h, w = x.dims
    oc, _, kh, kw = weight.shape
    oh = (h + begins[0] + ends[0] - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (w + begins[1] + ends[1] - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    fused = {"input_shape": x.dims, "group": a.get("group", 1), "strides": strides,
             "dilations": dilations, "begins": begins, "ends": ends,
             "output_shape": [n, oc, oh, ow], "line": rank == 1,
             "bias": p.constants[bias] if bias else np.zeros(oc, np.float32)}
    _conv(p, layer, fused, x, weight)


def fused_conv(p: _Planner, layer: Layer) -> None:
    x, weight = _input_and_weight(p, layer)
    _conv(p, layer, layer.attrs, x, weight)


def _conv(p: _Planner, layer: Layer, a: dict, x: Any, weight: np.ndarray) -> None:
    if weight.ndim != 4 or tuple(x.dims) != tuple(a["input_shape"]):
        raise Unplannable(f"{layer.name}: input {x.dims} against {a['input_shape']}")
    n, c, h, w = x.dims
    oc, icg, kh, kw = weight.shape
    groups = int(a["group"])
    (sh, sw), (dh, dw) = a["strides"], a["dilations"]
    (pt, pl), (pb, pr) = a["begins"], a["ends"]
    if min(pt, pl, pb, pr) < 0 or c != icg * groups or oc % groups:
        raise Unplannable(f"{layer.name}: pads {a['begins']} {a['ends']}, groups {groups}")
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (w + pl + pr - (kw - 1) * dw - 1) // sw + 1
    if [n, oc, oh, ow] != list(a["output_shape"]):
        raise Unplannable(f"{layer.name}: output {a['output_shape']} against {[n, oc, oh, ow]}")
    act, aoff = p.activation(a.get("unary"))
    bias = np.asarray(a["bias"], np.float32)
    ocg = oc // groups
    taps = 0
    if icg == 1 and ocg == 1:  # depthwise: [kh][kw][c]
        op, vb = "dwconv", 0
        woff = p.param(weight.reshape(oc, kh, kw).transpose(1, 2, 0))
        boff = p.param(bias)
    elif ocg <= 8 and vector_width() >= 16:  # taps in lane groups (cnn_conv512.h)
        op, vb, taps = "conv", 8, 4 if ocg <= 4 else 2
        woff, boff = _taps(p, weight, bias, groups, taps, merged=groups == 1 and dw == 1)
    else:  # [g][block][kh][kw][icg][vb], zero past the group's channels
        op, vb = "conv", block_width(ocg, vector_width())
        blocks = -(-ocg // vb)
        packed = np.zeros((groups, blocks * vb, icg, kh, kw), np.float32)
        packed[:, :ocg] = weight.reshape(groups, ocg, icg, kh, kw)
        packed = packed.reshape(groups, blocks, vb, icg, kh, kw).transpose(0, 1, 4, 5, 3, 2)
        woff = p.param(packed)
        padded_bias = np.zeros((groups, blocks * vb), np.float32)
        padded_bias[:, :ocg] = bias.reshape(groups, ocg)
        boff = p.param(padded_bias)
    ph, pw, scratch = h, w, -1
    if (pt or pl or pb or pr) and op == "conv":  # dwconv reads the input itself, sides checked
        ph = max(h + pt, (oh - 1) * sh + (kh - 1) * dh + 1)
        pw = max(w + pl, (ow - 1) * sw + (kw - 1) * dw + 1)
        scratch = p.arena.take(n * ph * pw * c)  # given back once the output has its place
    residual = p.value(layer.inputs[1]).offset if a.get("binary") else -1
    if a.get("binary") and p.value(layer.inputs[1]).dims != (n, oc, oh, ow):
        raise Unplannable(f"{layer.name}: a residual of another shape")
    shape = (n, oc, ow) if a.get("line") else (n, oc, oh, ow)
    y = p.new(layer.outputs[0], shape)
    if scratch >= 0:
        p.arena.give(scratch, n * ph * pw * c)
    p.slack = max(p.slack, (TILE_PIXELS * sw + kw * dw) * c + 64)  # a tile past a row's end
    dims = x.dims
    if (kh, kw, sh, sw, scratch) == (1, 1, 1, 1, -1):  # a 1x1 over all pixels as one row
        dims, oh, ow, ph, pw = (n, c, 1, h * w), 1, h * w, 1, h * w
    p.record(op, in_=x.offset, out=y.offset, dims=dims, in2=residual, oh=oh, ow=ow, oc=oc,
             kh=kh, kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt, pl=pl, g=groups, woff=woff,
             boff=boff, act=act, aoff=aoff, scr=scratch, ph=ph, pw=pw, vb=vb, x1=taps,
             macs=n * oh * ow * oc * icg * kh * kw)


def _taps(p: _Planner, weight: np.ndarray, bias: np.ndarray, groups: int, taps: int,
          merged: bool) -> tuple[int, int]:
    """A group's at most 16 / ``taps`` output channels' weights as [g][kh][kw][q][16 / taps]
    [taps] (``taps`` adjacent taps a lane group: ``inner`` of them a kw, the group's input
    channels, or kw x ic as one where ``merged``, its window row contiguous; zero past the taps
    and the channels), and the bias [g][16 / taps][taps] in each group's first lane:
    cnn_conv512.h's tile_pairs (2) and tile_quads (4). Returns (weights, bias) offsets."""
    oc, icg, kh, kw = weight.shape
    ocg = oc // groups
    rows = weight.reshape(groups, ocg, icg, kh, kw).transpose(0, 3, 4, 2, 1)  # g kh kw ic o
    if merged:
        rows = rows.reshape(groups, kh, 1, kw * icg, ocg)
    inner, width = rows.shape[3], 16 // taps
    packed = np.zeros((*rows.shape[:3], -(-inner // taps) * taps, width), np.float32)
    packed[..., :inner, :ocg] = rows
    packed = packed.reshape(*rows.shape[:3], -1, taps, width).swapaxes(-1, -2)
    lanes = np.zeros((groups, width, taps), np.float32)
    lanes[:, :ocg, 0] = bias.reshape(groups, ocg)
    return p.param(packed), p.param(lanes)


def linear(p: _Planner, layer: Layer) -> None:
    a = layer.attrs
    x, weight = _input_and_weight(p, layer)
    if len(x.shape) > 2 and not a.get("binary"):
        return _linear_rows(p, layer, x, weight)
    if len(x.shape) != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise Unplannable(f"{layer.name}: a product over {x.shape}")
    rows, k = x.shape
    oc = weight.shape[0]
    bias = np.zeros(oc, np.float32) if a.get("bias") is None else np.asarray(a["bias"], np.float32)
    act, aoff = p.activation(a.get("unary"))
    residual = -1
    if a.get("binary"):
        other = p.value(layer.inputs[1])
        if other.shape != (rows, oc):
            raise Unplannable(f"{layer.name}: a residual of shape {other.shape}")
        residual = other.offset
    y = p.new(layer.outputs[0], (rows, oc))
    p.record("linear", in_=x.offset, out=y.offset, dims=(rows, k, 1, 1), in2=residual, oc=oc,
             woff=p.param(weight.T), boff=p.param(bias), act=act, aoff=aoff, macs=rows * k * oc)


def _linear_rows(p: _Planner, layer: Layer, x: Any, weight: np.ndarray) -> None:
    """A product over the last axis of a 3-d or wider tensor: its rows gathered in ONNX's order
    where the arena keeps them otherwise, the product's rows gathered back likewise."""
    a, shape = layer.attrs, x.shape
    k, oc = shape[-1], weight.shape[0]
    if weight.ndim != 2 or weight.shape[1] != k:
        raise Unplannable(f"{layer.name}: a product over {shape}")
    rows = math.prod(shape[:-1])
    order = p.places(x).reshape(-1)
    source = x.offset
    if not np.array_equal(order, np.arange(x.size)):
        source = p.arena.take(x.size)
        p.record("gather", in_=x.offset, out=source, dims=(x.size, 1, 1, 1), woff=p.table(order))
    out_shape = (*shape[:-1], oc)
    product = p.arena.take(rows * oc)
    bias = np.zeros(oc, np.float32) if a.get("bias") is None else np.asarray(a["bias"], np.float32)
    act, aoff = p.activation(a.get("unary"))
    p.record("linear", in_=source, out=product, dims=(rows, k, 1, 1), oc=oc,
             woff=p.param(weight.T), boff=p.param(bias), act=act, aoff=aoff, macs=rows * k * oc)
    if source != x.offset:
        p.arena.give(source, x.size)
    y = p.new(layer.outputs[0], out_shape)
    back = p.laid(out_shape, np.arange(rows * oc).reshape(out_shape))
    p.record("gather", in_=product, out=y.offset, dims=(y.size, 1, 1, 1), woff=p.table(back))
    p.arena.give(product, rows * oc)


def group_norm(p: _Planner, layer: Layer) -> None:
    """GroupNorm (torch.onnx's InstanceNormalization form, its affine folded: ``GroupNorm``)."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    n, c, h, w = x.dims
    if len(x.shape) not in (3, 4) or c % int(a["groups"]):
        raise Unplannable(f"{layer.name}: GroupNorm over {x.shape}")
    y = p.new(layer.outputs[0], x.shape)
    p.record("gnorm", in_=x.offset, out=y.offset, dims=x.dims, g=int(a["groups"]),
             woff=p.param(np.asarray(a["scale"], np.float32)),
             boff=p.param(np.asarray(a["bias"], np.float32)),
             aoff=p.param(np.array([a["epsilon"]], np.float32)))


def layer_norm(p: _Planner, layer: Layer) -> None:
    """LayerNormalization over the last axes, its scale and bias constants: each row's elements
    wherever the arena keeps them (a table of their places; a transposed (N, T, C)'s row is one
    channel apart)."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    names = list(layer.inputs) + ["", ""]
    if len(layer.outputs) > 1 and any(layer.outputs[1:]) or names[1] not in p.constants \
            or names[2] and names[2] not in p.constants or a.get("stash_type", 1) != 1:
        raise Unplannable(f"{layer.name}: LayerNormalization ({a})")
    axis = int(a.get("axis", -1)) % len(x.shape)
    k = math.prod(x.shape[axis:])
    places = p.places(x).reshape(-1, k)
    scale = np.broadcast_to(np.asarray(p.constants[names[1]], np.float32), x.shape[axis:])
    bias = np.broadcast_to(np.asarray(p.constants[names[2]], np.float32) if names[2] else
                           np.zeros(1, np.float32), x.shape[axis:])
    y = p.new(layer.outputs[0], x.shape)
    p.record("lnorm", in_=x.offset, out=y.offset, dims=(places.shape[0], k, 1, 1),
             x2=p.table(places), woff=p.param(scale), boff=p.param(bias),
             aoff=p.param(np.array([a.get("epsilon", 1e-5)], np.float32)))


def pool(p: _Planner, layer: Layer) -> None:
    a = layer.attrs
    x = p.value(layer.inputs[0])
    if len(x.shape) != 4 or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") \
            or a.get("storage_order", 0):
        raise Unplannable(f"{layer.name}: {layer.op_type} over {x.shape} ({a})")
    n, c, h, w = x.dims
    kh, kw = a["kernel_shape"]
    sh, sw = a.get("strides") or (1, 1)
    dh, dw = a.get("dilations") or (1, 1)
    pads = a.get("pads") if a.get("auto_pad", "NOTSET") == "NOTSET" else None
    pt, pl, pb, pr = pads or (0, 0, 0, 0)
    if layer.op_type == "AveragePool" and (dh, dw) != (1, 1):
        raise Unplannable(f"{layer.name}: a dilated AveragePool")
    out = []
    for size, k, s, d, b, e in ((h, kh, sh, dh, pt, pb), (w, kw, sw, dw, pl, pr)):
        count = (size + b + e - (k - 1) * d - 1) / s + 1
        o = math.ceil(count) if a.get("ceil_mode") else math.floor(count)
        if a.get("ceil_mode") and (o - 1) * s >= size + b:
            o -= 1
        out.append(o)
    y = p.new(layer.outputs[0], (n, c, *out))
    p.record("maxpool" if layer.op_type == "MaxPool" else "avgpool", in_=x.offset, out=y.offset,
             dims=x.dims, oh=out[0], ow=out[1], kh=kh, kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt,
             pl=pl, ph=h + pb, pw=w + pr, x1=int(a.get("count_include_pad", 0)))


def global_pool(p: _Planner, layer: Layer) -> None:
    x = p.value(layer.inputs[0])
    if len(x.shape) != 4:
        raise Unplannable(f"{layer.name}: over {x.shape}")
    y = p.new(layer.outputs[0], (x.dims[0], x.dims[1], 1, 1))
    p.record("gap" if layer.op_type == "GlobalAveragePool" else "gmp", in_=x.offset,
             out=y.offset, dims=x.dims)


def elementwise(p: _Planner, layer: Layer) -> None:
    x = p.value(layer.inputs[0])
    kind, a = ELEMENTWISE[layer.op_type], layer.attrs
    numbers = [0.0]
    if kind == "clip":
        numbers = _clip_bounds(p, layer)
    elif kind == "hsigmoid":
        numbers = [a.get("alpha", 0.2), a.get("beta", 0.5)]
    elif kind == "leaky":
        numbers = [a.get("alpha", 0.01)]
    row = p.folding(layer.inputs[0])
    if row is not None:  # the convolution's own post-op, its output's place this one's
        row[FIELDS.index("act")], row[FIELDS.index("aoff")] = ACTS[kind], p.param(
            np.array(numbers, np.float32))
        p.values[layer.outputs[0]] = type(x)(x.offset, x.dims, x.shape)
        return
    y = p.new(layer.outputs[0], x.shape)
    p.record("act", in_=x.offset, out=y.offset, dims=(x.size, 1, 1, 1), act=ACTS[kind],
             aoff=p.param(np.array(numbers, np.float32)))


def _clip_bounds(p: _Planner, layer: Layer) -> list[float]:
    if layer.opset < 11:
        return [layer.attrs.get("min", -np.inf), layer.attrs.get("max", np.inf)]
    bounds = []
    for index, default in ((1, -np.inf), (2, np.inf)):
        name = layer.inputs[index] if len(layer.inputs) > index else ""
        if name and name not in p.constants:
            raise Unplannable(f"{layer.name}: a Clip to computed bounds")
        bounds.append(float(np.asarray(p.constants[name]).reshape(-1)[0]) if name else default)
    return bounds


def binary(p: _Planner, layer: Layer) -> None:
    if any(name in p.constants for name in layer.inputs[:2]) or layer.op_type not in (
            "Add", "Mul") or p.value(layer.inputs[0]).shape != p.value(layer.inputs[1]).shape:
        return cnn_moves.arith(p, layer)
    x, other = (p.value(name) for name in layer.inputs[:2])
    first, second = layer.inputs[:2]
    for made, then in ((first, other), (second, x)) if layer.op_type == "Add" \
            and first != second else ():
        row = p.folding(made)
        if row is not None and row[FIELDS.index("in2")] < 0:  # the convolution's residual
            row[FIELDS.index("in2")] = then.offset
            mine = p.values[made]
            p.values[layer.outputs[0]] = type(mine)(mine.offset, mine.dims, mine.shape)
            return
    y = p.new(layer.outputs[0], x.shape)
    p.record("add" if layer.op_type == "Add" else "mul", in_=x.offset, out=y.offset,
             dims=(x.size, 1, 1, 1), in2=other.offset)


def concat(p: _Planner, layer: Layer) -> None:
    parts = [p.value(name) for name in layer.inputs]
    rank, (n, _, h, w) = len(parts[0].shape), parts[0].dims
    axis = layer.attrs.get("axis", 1) % rank
    if axis != 1 or rank > 4 or any(
            len(v.shape) != rank or (v.dims[0], *v.dims[2:]) != (n, h, w) for v in parts):
        return cnn_moves._concat_any(p, layer, parts, axis)
    total = sum(v.dims[1] for v in parts)
    shape = (parts[0].shape[0], total, *parts[0].shape[2:])
    y = p.new(layer.outputs[0], shape)
    at = 0
    for v in parts:
        n, c, h, w = v.dims
        p.record("slice", in_=v.offset, out=y.offset, dims=(n * h * w, c, 1, 1), oc=total, x1=at)
        at += c


def conv_transpose(p: _Planner, layer: Layer) -> None:
    a = layer.attrs
    x = p.value(layer.inputs[0])
    weight = p.constants.get(layer.inputs[1])
    bias_name = layer.inputs[2] if len(layer.inputs) > 2 else ""
    if weight is None or weight.ndim != 4 or len(x.shape) != 4 or a.get("group", 1) != 1 \
            or a.get("auto_pad", "NOTSET") != "NOTSET" or a.get("output_shape") \
            or bias_name and bias_name not in p.constants:
        raise Unplannable(f"{layer.name}: ConvTranspose over {x.shape} ({a})")
    n, c, h, w = x.dims
    _, oc, kh, kw = weight.shape
    sh, sw = a.get("strides") or (1, 1)
    dh, dw = a.get("dilations") or (1, 1)
    pt, pl, pb, pr = a.get("pads") or (0, 0, 0, 0)
    extra_h, extra_w = a.get("output_padding") or (0, 0)
    oh = (h - 1) * sh - pt - pb + (kh - 1) * dh + 1 + extra_h
    ow = (w - 1) * sw - pl - pr + (kw - 1) * dw + 1 + extra_w
    bias = p.constants[bias_name] if bias_name else np.zeros(oc, np.float32)
    y = p.new(layer.outputs[0], (n, oc, oh, ow))
    p.record("deconv", in_=x.offset, out=y.offset, dims=x.dims, oh=oh, ow=ow, oc=oc, kh=kh,
             kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt, pl=pl,
             woff=p.param(np.asarray(weight, np.float32).transpose(2, 3, 0, 1)),
             boff=p.param(bias), act=ACTS["none"], aoff=p.param(np.zeros(1, np.float32)),
             macs=n * h * w * c * oc * kh * kw)


def resize(p: _Planner, layer: Layer) -> None:
    """Resize of H and W, linear or nearest, its scales or sizes constants: each output row's and
    column's two taps tabled here by CpuRef's own coordinates and weights."""
    from backplane.backends.reference.kernels import resize as ref

    a = layer.attrs
    x = p.value(layer.inputs[0])
    names = list(layer.inputs) + [""] * 4
    scales, sizes = (p.constants.get(names[i]) if names[i] else None for i in (2, 3))
    mode, where = a.get("mode", "nearest"), a.get("coordinate_transformation_mode", "half_pixel")
    if len(x.shape) != 4 or a.get("axes") is not None or a.get("antialias", 0) \
            or mode not in ("linear", "nearest") or where == "tf_crop_and_resize" \
            or a.get("keep_aspect_ratio_policy", "stretch") != "stretch" \
            or (names[2] and scales is None) or (names[3] and sizes is None) \
            or (names[1] and names[1] not in p.constants):
        raise Unplannable(f"{layer.name}: Resize ({a})")
    n, c, h, w = x.dims
    if sizes is not None and len(sizes):
        out = [int(v) for v in sizes]
        factors = [o / i for o, i in zip(out, x.shape)]
    elif scales is not None and len(scales):
        factors = [float(v) for v in scales]
        out = [math.floor(i * f) for i, f in zip(x.shape, factors)]
    else:
        raise Unplannable(f"{layer.name}: Resize without scales or sizes")
    if out[:2] != [n, c]:
        raise Unplannable(f"{layer.name}: Resize of the batch or the channels")
    tables = []
    for n_in, n_out, factor in ((h, out[2], factors[2]), (w, out[3], factors[3])):
        coords = ref._source_coordinates(where, n_in, n_out, factor, None)
        weights = (ref._nearest_weights(coords, n_in, a.get("nearest_mode", "round_prefer_floor"))
                   if mode == "nearest" else
                   ref._filter_weights(coords, n_in, ref._linear_taps, 1, 1.0,
                                       a.get("exclude_outside", 0)))
        index, taps = ref.taps_of(weights)
        if index.shape[1] > 2:
            raise Unplannable(f"{layer.name}: more than two taps an axis")
        if index.shape[1] == 1:
            index, taps = np.repeat(index, 2, axis=1), np.pad(taps, ((0, 0), (0, 1)))
        tables.append(np.concatenate([index, taps], axis=1).astype(np.float32))
    y = p.new(layer.outputs[0], (n, c, out[2], out[3]))
    p.record("resize", in_=x.offset, out=y.offset, dims=x.dims, oh=out[2], ow=out[3],
             woff=p.param(tables[0]), boff=p.param(tables[1]))


PLANNERS: dict[str, Callable[[_Planner, Layer], Any]] = {
    "FusedConv": fused_conv, "Conv": conv, "Linear": linear, "MaxPool": pool, "AveragePool": pool,
    "GlobalAveragePool": global_pool, "GlobalMaxPool": global_pool, "Add": binary, "Mul": binary,
    "Sub": cnn_moves.arith, "Div": cnn_moves.arith, "Pow": cnn_moves.arith,
    "AffineChain": cnn_moves.affine, "Concat": concat, "ConvTranspose": conv_transpose,
    "Resize": resize, "Transpose": cnn_moves.transpose, "Slice": cnn_moves.slice_,
    "Split": cnn_moves.split, **{op: cnn_moves.view for op in VIEWS},
    **{op: cnn_moves.reduce for op in ("ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean")},
    "GroupNorm": group_norm, "LayerNormalization": layer_norm,
    **{op: elementwise for op in ELEMENTWISE}, **cnn_detect.PLANNERS}
