"""The plan's layers of sequence models (``cnn_detect.PLANNERS`` registers them for
``cnn_layers.PLANNERS``): an embedding's Gather of a constant table by integer inputs, CpuAcc's
``WindowedConv`` (sibling 1-d convolutions of one transposed input), Erf; and ``fold``, which
rewrites the plain ops a GELU and an embedding are written in into one layer each before the
plan is made.

Why: on a CPU where torch's GELU does not keep +Inf (AVX-512's: ``fusion/gelu``), CpuAcc leaves
dynamo's Div, Erf, Add, Mul, Mul apart, and audio_conv1d_dyn19's plan stopped at its first Erf
(the first 4 of 23 layers native, the rest traced: 40 us a run against ONNX Runtime's 18). The
fold gives the plan its ``GeluChain`` (one pass, or the convolution's own post-op). A byte
classifier (bytes_int32_dyn20) reads int32 bytes and a bool mask: its lookup, the mask's Mul
and the Transpose to (N, C, L) become one ``embed`` record writing the rows where the
convolution reads them, and the whole partition is one C call (``cnn_seq.h``). audio's tail
(Transpose, LayerNormalization, Linear) is one ``rownorm`` record over the channels-last rows as
they lie, its product's rows kept in ONNX's order (``Value.rows``), where three gathers had
moved them there and back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane.ir.graph import Layer
from backplane.native.cnn import Unplannable, _Planner

FUSED = "backplane.torch"  # the fused layers' domain (cnn_layers.FUSED, torch.backend's)
FUSED_OPS = ("WindowedConv", "Embedding", "RowNorm")
"""The fused layers planned here (CpuAcc's WindowedConv, ``fold``'s Embedding and RowNorm);
GeluChain is ``cnn_layers``'."""


def fold(layers: Sequence[Layer], constants: Mapping[str, np.ndarray],
         outputs: Sequence[str]) -> list[Layer]:
    """``layers`` with each GELU written out in Erf (x * 0.5 * (1 + erf(x / sqrt 2)), in the
    exporters' orders) as one GeluChain, and each Gather of a constant 2-d table by computed
    indices as one Embedding (with the Mul by a mask and the Transpose to (N, C, L) after it,
    where they follow), and each Transpose of (N, C, L) to (N, L, C) with the
    LayerNormalization over C after it (and its Linear) as one RowNorm; an intermediate read
    elsewhere, or an output, is left as it is."""
    layers = list(layers)
    for match in (_gelu, _embedding, _row_norm):
        at, readers = 0, _Readers(layers, outputs)
        while at < len(layers):
            found = match(layers, at, constants, readers)
            if found is None:
                at += 1
                continue
            group, fused = found
            last = max(layers.index(lay) for lay in group)
            gone = {id(lay) for lay in group}
            layers = [fused if i == last else lay for i, lay in enumerate(layers)
                      if i == last or id(lay) not in gone]
            readers = _Readers(layers, outputs)  # again only after a match: a plan's fold
            # runs once per prefix traced_prefix tries, over partitions of hundreds of layers
            at = 0 if match is _gelu else at + 1  # a GELU's match may start before
    return layers


class _Readers:
    """Each value's readers and maker among the layers; an output of the partition counts as
    one more reader."""

    def __init__(self, layers: Sequence[Layer], outputs: Sequence[str]) -> None:
        self.of: dict[str, list[Layer]] = {}
        self.made: dict[str, Layer] = {}
        for lay in layers:
            for name in dict.fromkeys(lay.inputs):
                self.of.setdefault(name, []).append(lay)
            self.made.update(dict.fromkeys(lay.outputs, lay))
        self.outputs = set(outputs)

    def sole(self, name: str) -> Layer | None:
        """The one layer reading ``name``, where it has one and is no output."""
        readers = self.of.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.outputs else None


def _scalar(constants: Mapping[str, np.ndarray], name: str, value: float) -> bool:
    c = constants.get(name)
    return c is not None and np.size(c) == 1 and np.asarray(c).dtype.kind == "f" \
        and math.isclose(float(np.asarray(c).reshape(-1)[0]), value, rel_tol=1e-6)


def _other(layer: Layer, name: str) -> str | None:
    """The other operand of a two-operand ``layer`` reading ``name``."""
    if layer.domain or len(layer.inputs) != 2 or name not in layer.inputs:
        return None
    first, second = layer.inputs
    return second if first == name else first


def _gelu(layers: list[Layer], at: int, constants: Mapping[str, np.ndarray],
          readers: _Readers) -> tuple[list[Layer], Layer] | None:
    erf = layers[at]
    if erf.op_type != "Erf" or erf.domain:
        return None
    made = readers.made
    scale = made.get(erf.inputs[0])
    if scale is None or readers.sole(erf.inputs[0]) is not erf or scale.domain \
            or len(scale.inputs) != 2 or scale.inputs[1] not in constants:
        return None
    x = scale.inputs[0]
    if not (scale.op_type == "Div" and _scalar(constants, scale.inputs[1], math.sqrt(2))
            or scale.op_type == "Mul" and _scalar(constants, scale.inputs[1], 1 / math.sqrt(2))):
        return None
    one = readers.sole(erf.outputs[0])
    if one is None or one.op_type != "Add" or not _scalar(
            constants, _other(one, erf.outputs[0]) or "", 1.0):
        return None
    first = readers.sole(one.outputs[0])
    operand = _other(first, one.outputs[0]) if first and first.op_type == "Mul" else None
    if operand is None:
        return None
    second = readers.sole(first.outputs[0])
    then = _other(second, first.outputs[0]) if second and second.op_type == "Mul" else None
    half = made.get(operand)
    if _scalar(constants, operand, 0.5) and then == x \
            or operand == x and _scalar(constants, then or "", 0.5):
        group, last = [scale, erf, one, first, second], second  # x * (0.5 * (1 + erf)), ...
    elif half is not None and half.op_type == "Mul" and readers.sole(operand) is first \
            and _scalar(constants, _other(half, x) or "", 0.5):
        group, last = [half, scale, erf, one, first], first  # (x * 0.5) * (1 + erf)
    else:
        return None
    fused = Layer("+".join(lay.name for lay in group), "GeluChain", [x], [last.outputs[0]], {},
                  FUSED, 1)
    return group, fused


def _embedding(layers: list[Layer], at: int, constants: Mapping[str, np.ndarray],
               readers: _Readers) -> tuple[list[Layer], Layer] | None:
    gather = layers[at]
    table = constants.get(gather.inputs[0]) if gather.inputs else None
    if gather.op_type != "Gather" or gather.domain or table is None or np.ndim(table) != 2 \
            or int(gather.attrs.get("axis", 0)) != 0 or gather.inputs[1] in constants \
            or np.asarray(table).dtype.kind != "f":
        return None
    group, inputs, out = [gather], [gather.inputs[1]], gather.outputs[0]
    mul = readers.sole(out)
    mask = _other(mul, out) if mul is not None and mul.op_type == "Mul" else None
    if mask is not None and mask not in constants and mask != out:
        group, inputs, out = [*group, mul], [*inputs, mask], mul.outputs[0]
    turn = readers.sole(out)
    transposed = turn is not None and turn.op_type == "Transpose" and not turn.domain \
        and list(turn.attrs.get("perm") or []) == [0, 2, 1]
    if transposed:
        group, out = [*group, turn], turn.outputs[0]
    fused = Layer("+".join(lay.name for lay in group), "Embedding", inputs, [out],
                  {"table": np.asarray(table, np.float32), "transposed": transposed}, FUSED, 1)
    return group, fused


def _row_norm(layers: list[Layer], at: int, constants: Mapping[str, np.ndarray],
              readers: _Readers) -> tuple[list[Layer], Layer] | None:
    """A Transpose of (N, C, L) to (N, L, C), the LayerNormalization over its C after it and
    the Linear after that, where they follow: one RowNorm, the channels-last rows as they are."""
    turn = layers[at]
    if turn.op_type != "Transpose" or turn.domain \
            or list(turn.attrs.get("perm") or []) != [0, 2, 1]:
        return None
    norm = readers.sole(turn.outputs[0])
    names = list(norm.inputs) + ["", ""] if norm is not None else []
    if norm is None or norm.op_type != "LayerNormalization" or norm.domain \
            or norm.inputs[0] != turn.outputs[0] or int(norm.attrs.get("axis", -1)) not in (-1, 2) \
            or norm.attrs.get("stash_type", 1) != 1 or any(norm.outputs[1:]) \
            or names[1] not in constants or names[2] and names[2] not in constants:
        return None
    group, out = [turn, norm], norm.outputs[0]
    attrs: dict[str, Any] = {"epsilon": float(norm.attrs.get("epsilon", 1e-5)),
                             "scale": np.asarray(constants[names[1]], np.float32),
                             "bias": np.asarray(constants[names[2]], np.float32) if names[2]
                             else np.zeros(1, np.float32), "linear": None}
    linear = readers.sole(out)
    if linear is not None and linear.op_type == "Linear" and linear.domain == FUSED \
            and not linear.attrs.get("binary") and linear.attrs.get("compute", "float32") \
            == "float32" and not linear.attrs.get("source"):
        group, out, attrs["linear"] = [*group, linear], linear.outputs[0], linear.attrs
    return group, Layer("+".join(lay.name for lay in group), "RowNorm", [turn.inputs[0]], [out],
                        attrs, FUSED, 1)


ROW = 1024
"""The widest row ``rownorm`` takes (its four normalized rows on the stack: 16 KB); a wider one
is lnorm's and linear's records."""


def row_norm(p: _Planner, layer: Layer) -> None:
    """``_row_norm``'s: the norm over each of the N * L rows of C floats where channels-last
    keeps (N, C, L) (contiguous: no transpose), the product over those rows, its (N, L, O)
    kept in ONNX's order (``Value.rows``: an output of the partition exported as it is)."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    if len(x.shape) != 3 or x.integer:
        raise Unplannable(f"{layer.name}: a RowNorm of {x.shape}")
    n, c, length = x.shape
    count = n * length
    scale, shift = (np.broadcast_to(a[k], (c,)) for k in ("scale", "bias"))
    linear = a["linear"]
    width = c if linear is None else int(np.shape(linear["weight"])[0])
    if linear is not None and np.shape(linear["weight"]) != (width, c):
        raise Unplannable(f"{layer.name}: a product of {np.shape(linear['weight'])} over {c}")
    y = p.new(layer.outputs[0], (n, length, width))
    y.rows = True
    act, aoff = p.activation(linear.get("unary") if linear is not None else None)
    weight = np.zeros((c, 1), np.float32) if linear is None else np.asarray(
        linear["weight"], np.float32).T
    bias = np.zeros(width, np.float32) if linear is None or linear.get("bias") is None \
        else np.asarray(linear["bias"], np.float32)
    if c <= ROW:  # one record: each row normalized into registers' reach, then its product
        p.record("rownorm", in_=x.offset, out=y.offset, dims=(count, c, 1, 1),
                 oc=0 if linear is None else width, woff=p.param(scale), boff=p.param(shift),
                 aoff=p.param(np.array([a["epsilon"]], np.float32)), x2=p.param(weight),
                 ph=p.param(bias), act=act, pw=aoff,
                 macs=0 if linear is None else count * c * width)
        return
    normed = y.offset if linear is None else p.arena.take(count * c)
    p.record("lnorm", in_=x.offset, out=normed, dims=(count, c, 1, 1),
             x2=p.table(np.arange(count * c)), woff=p.param(scale), boff=p.param(shift),
             aoff=p.param(np.array([a["epsilon"]], np.float32)))
    if linear is None:
        return
    p.record("linear", in_=normed, out=y.offset, dims=(count, c, 1, 1), oc=width,
             woff=p.param(weight), boff=p.param(bias), act=act, aoff=aoff,
             macs=count * c * width)
    p.arena.give(normed, count * c)


def embedding(p: _Planner, layer: Layer) -> None:
    """A lookup of (N, L) indices in the (V, E) table: (N, L, E), times an (N, L, 1) mask
    where the fold took a Mul, transposed to (N, E, L) where it took the Transpose; one
    ``embed`` record writing each row at its places in the output's channels-last order."""
    a, index = layer.attrs, p.value(layer.inputs[0])
    table = a["table"]
    rows, width = table.shape
    if not index.integer or len(index.shape) != 2 \
            or not np.array_equal(p.places(index).reshape(-1), np.arange(index.size)):
        raise Unplannable(f"{layer.name}: an embedding by {index.shape}"
                          f"{'' if index.integer else ' floats'}")
    n, length = index.shape
    scale = -1
    if len(layer.inputs) > 1:
        mask = p.value(layer.inputs[1])
        if mask.integer or mask.shape != (n, length, 1) or not np.array_equal(
                p.places(mask).reshape(-1), np.arange(mask.size)):
            raise Unplannable(f"{layer.name}: an embedding's Mul by {mask.shape}")
        scale = mask.offset
    shape = (n, width, length) if a["transposed"] else (n, length, width)
    y = p.new(layer.outputs[0], shape)
    places = p.places(y)
    if a["transposed"]:
        places = places.transpose(0, 2, 1)
    first = int(places[0, 0, 0])
    step = [int(places[tuple(int(i == axis) for i in range(3))]) - first
            if places.shape[axis] > 1 else 0 for axis in range(3)]
    p.record("embed", in_=index.offset, out=y.offset, in2=scale, dims=(n, width, length, 1),
             oc=rows, woff=p.param(table), sh=step[1], sw=step[2], x1=step[0])


def windowed_conv(p: _Planner, layer: Layer) -> None:
    """CpuAcc's WindowedConv (its stacked (O, K * C) weight, in a window's (K, C) order): one
    convolution record a sibling, each of its rows of the weight, through the Conv planner."""
    from backplane.native.cnn_layers import PLANNERS

    a, x = layer.attrs, p.value(layer.inputs[0])
    kernel, stride, channels = int(a["kernel"]), int(a["stride"]), int(a["channels"])
    if len(x.shape) != 3 or x.shape[1] != channels or len(layer.outputs) != len(a["splits"]):
        raise Unplannable(f"{layer.name}: WindowedConv over {x.shape}")
    weight, bias = np.asarray(a["weight"], np.float32), np.asarray(a["bias"], np.float32)
    constants, start = dict(p.constants), 0
    for index, (size, name) in enumerate(zip(a["splits"], layer.outputs)):
        w = weight[start:start + size].reshape(size, kernel, channels).transpose(0, 2, 1)
        names = (f"{layer.name}#w{index}", f"{layer.name}#b{index}")
        constants[names[0]], constants[names[1]] = w, bias[start:start + size]
        p.constants = constants
        conv = Layer(f"{layer.name}#{index}", "Conv", [layer.inputs[0], *names], [name],
                     {"strides": [stride], "pads": [0, 0], "dilations": [1], "group": 1,
                      "kernel_shape": [kernel]}, "", layer.opset)
        PLANNERS["Conv"](p, conv)
        start += size


def integer_kind(dtype: Any) -> int:
    """An input's import kind for ``cnn_seq.h`` (0: float32; 2, 3, 4: int32, int64, bool),
    or -1 for another type."""
    name = np.dtype(dtype).name
    return {"float32": 0, "int32": 2, "int64": 3, "bool": 4}.get(name, -1)


PLANNERS: dict[str, Any] = {"Embedding": embedding, "WindowedConv": windowed_conv,
                            "RowNorm": row_norm}
