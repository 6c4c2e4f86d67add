"""CpuAcc's ``optimize_subgraph``: fuse what oneDNN runs fused, with weights prepacked at load.

Patterns (each intermediate tensor read by the next layer only, all layers in the subgraph):

- Conv [-> BatchNormalization] [-> Add(residual)] [-> activation | -> x * Sigmoid(x)]
  becomes one ``FusedConv`` on channels-last activations, the batch norm folded into its weights.
  At load the faster on its shape is measured and kept (``CpuAcc.conv_route`` forces one): oneDNN's
  convolution with the residual as a binary and the activation as a unary post-op and the weights
  reordered once (``torch.ops.mkldnn._convolution_pointwise``), or torch's ``conv2d`` followed by
  the post-ops (cheaper per call on tiny convolutions such as squeeze-excitation's).
- Gemm (constant B, C) or MatMul (constant 2-D B) [-> Add(constant bias)] [-> Reshape]
  [-> activation | -> GELU written out (with Erf, or the tanh form) | -> Add(residual)]
  becomes one ``Linear``: at load the faster of MKL (``F.linear``) and oneDNN
  (``torch.ops.mkldnn._linear_pointwise`` with a prepacked weight, the activation as a unary and the
  residual as a binary post-op) on its static shape is measured and kept (``CpuAcc.linear_route``
  forces one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.reference.kernels.conv import spatial_pads
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.ir.graph import Graph, Layer, SubgraphView

F32 = np.dtype(np.float32)
PostOp = tuple[str, list[float], "str | None"]  # oneDNN's unary attr, its scalars, its algorithm


@dataclass
class _Context:
    """What the matchers need: constants, consumers, and which layers are still free to fuse."""

    view: SubgraphView
    graph: Graph
    consumers: dict[str, list[Layer]]
    inside: set[int]
    taken: set[int] = field(default_factory=set)

    def const(self, name: str) -> np.ndarray | None:
        return self.graph.constants.get(name) if name else None

    def sole(self, name: str) -> Layer | None:
        """The one free layer of the subgraph that reads ``name``, if nothing else reads it."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.graph.outputs:
            return None
        user = users[0]
        return user if id(user) in self.inside and id(user) not in self.taken else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self.graph.info(name)
        return tuple(info.shape) if info.is_static and info.dtype == F32 else None  # type: ignore


def fuse(view: SubgraphView) -> OptimizationViews:
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    ctx = _Context(view, graph, graph.consumers(), set(map(id, view.layers)))
    views = OptimizationViews()
    for layer in view.layers:
        if id(layer) in ctx.taken or layer.domain:
            continue
        matcher = MATCHERS.get(layer.op_type, _match_linear)
        match = matcher(layer, ctx)
        if match is None:
            continue
        group, fused = match
        ctx.taken.update(map(id, group))
        views.substitutions.append(Substitution(SubgraphView.of(graph, group), [fused]))
    rest = [layer for layer in view.layers if id(layer) not in ctx.taken]
    if rest:
        views.untouched.append(SubgraphView.of(graph, rest))
    return views


# -- post-ops ----------------------------------------------------------------------------------------
def post_op(layer: Layer, ctx: _Context) -> PostOp | None:
    """The oneDNN eltwise post-op a layer is, or None."""
    op, attrs = layer.op_type, layer.attrs
    if layer.domain or op not in _SIMPLE and op not in ("LeakyRelu", "HardSigmoid", "Gelu", "Clip"):
        return None
    if op in _SIMPLE:
        return (_SIMPLE[op], [], None)
    if op == "LeakyRelu":
        return ("leaky_relu", [float(attrs.get("alpha", 0.01))], None)
    if op == "HardSigmoid":  # torch's hardsigmoid is ONNX's with alpha 1/6, beta 1/2
        alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
        return ("hardsigmoid", [], None) if math.isclose(alpha, 1 / 6, rel_tol=1e-6) and beta == 0.5 \
            else None
    if op == "Gelu":
        return ("gelu", [], attrs.get("approximate", "none"))
    bounds = _clip_bounds(layer, ctx)
    return ("hardtanh", list(bounds), None) if bounds else None


_SIMPLE = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hardswish"}


def _clip_bounds(layer: Layer, ctx: _Context) -> tuple[float, float] | None:
    if layer.opset < 11:
        return float(layer.attrs.get("min", -np.inf)), float(layer.attrs.get("max", np.inf))
    values = []
    for index, default in ((1, -np.inf), (2, np.inf)):
        name = layer.inputs[index] if len(layer.inputs) > index else ""
        if name and ctx.const(name) is None:
            return None
        values.append(float(ctx.const(name).reshape(-1)[0]) if name else default)  # type: ignore
    return values[0], values[1]


def _swish(out: str, ctx: _Context) -> list[Layer] | None:
    """x * Sigmoid(x), read from ``out``: the two layers, or None."""
    users = ctx.consumers.get(out, [])
    if len(users) != 2 or out in ctx.graph.outputs:
        return None
    sigmoid = next((u for u in users if u.op_type == "Sigmoid" and not u.domain), None)
    mul = next((u for u in users if u.op_type == "Mul" and not u.domain), None)
    if sigmoid is None or mul is None or ctx.sole(sigmoid.outputs[0]) is not mul:
        return None
    if any(id(u) not in ctx.inside or id(u) in ctx.taken for u in users):
        return None
    return [sigmoid, mul]


# -- Conv ----------------------------------------------------------------------------------------------
def _match_conv(conv: Layer, ctx: _Context) -> tuple[list[Layer], Layer] | None:
    x, w_name = conv.inputs[0], conv.inputs[1]
    weight, in_shape = ctx.const(w_name), ctx.shape(x)
    b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    bias = ctx.const(b_name)
    if weight is None or weight.dtype != F32 or weight.ndim != 4 or in_shape is None or len(in_shape) != 4:
        return None
    if b_name and bias is None:
        return None
    strides = list(conv.attrs.get("strides") or [1, 1])
    dilations = list(conv.attrs.get("dilations") or [1, 1])
    begins, ends = spatial_pads(in_shape[2:], weight.shape[2:], strides, dilations,
                                conv.attrs.get("auto_pad", "NOTSET"), conv.attrs.get("pads"))
    group, out = [conv], conv.outputs[0]
    bias = np.zeros(weight.shape[0], F32) if bias is None else bias
    nxt = ctx.sole(out)
    if nxt is not None and nxt.op_type == "BatchNormalization" and not nxt.domain:
        folded = _fold_batch_norm(nxt, weight, bias, ctx)
        if folded is not None:
            (weight, bias), out = folded, nxt.outputs[0]
            group.append(nxt)
            nxt = ctx.sole(out)
    inputs, binary = [x], False
    if nxt is not None and nxt.op_type == "Add" and not nxt.domain:
        other = nxt.inputs[1] if nxt.inputs[0] == out else nxt.inputs[0]
        if ctx.const(other) is None and ctx.shape(other) == ctx.shape(out) and other != out:
            inputs, binary, out = [x, other], True, nxt.outputs[0]
            group.append(nxt)
            nxt = ctx.sole(out)
    unary: PostOp | None = None
    swish = None if binary else _swish(out, ctx)
    if swish is not None:
        unary, out = ("swish", [], None), swish[1].outputs[0]
        group += swish
    elif nxt is not None and (unary := post_op(nxt, ctx)) is not None:
        group.append(nxt)
        out = nxt.outputs[0]
    attrs = {"weight": np.ascontiguousarray(weight, F32), "bias": np.ascontiguousarray(bias, F32),
             "strides": strides, "dilations": dilations, "group": int(conv.attrs.get("group", 1)),
             "begins": begins, "ends": ends, "input_shape": list(in_shape),
             "output_shape": list(ctx.shape(conv.outputs[0]) or []), "binary": binary,
             "unary": unary}
    fused = Layer("+".join(lay.name for lay in group), "FusedConv", inputs, [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _fold_batch_norm(bn: Layer, weight: np.ndarray, bias: np.ndarray, ctx: _Context,
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    params = [ctx.const(name) for name in bn.inputs[1:5]]
    if any(p is None for p in params) or bn.attrs.get("training_mode", 0) or len(bn.outputs) > 1:
        return None
    scale, shift, mean, var = (p.astype(np.float64) for p in params)  # type: ignore[union-attr]
    factor = scale / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
    folded_w = weight.astype(np.float64) * factor.reshape(-1, 1, 1, 1)
    folded_b = (bias.astype(np.float64) - mean) * factor + shift
    return folded_w.astype(F32), folded_b.astype(F32)


def conv_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The faster, on this layer's shape, of oneDNN's fused convolution with a prepacked weight and
    torch's convolution (channels-last) followed by its post-ops; measured once, here, at load."""
    import torch

    a = layer.attrs
    routes = {"onednn": _onednn_conv(a), "torch": _torch_conv(a)}
    forced = backend.options.get("CpuAcc.conv_route", "auto")
    if forced in routes:
        return routes[forced]
    cl = torch.channels_last
    sample = [torch.randn(a["input_shape"]).contiguous(memory_format=cl)]
    if a["binary"]:
        sample.append(torch.randn(a["output_shape"]).contiguous(memory_format=cl))
    return min(routes.values(), key=lambda run: _seconds(run, *sample))


def _onednn_conv(a: dict[str, Any]) -> Workload:
    import torch
    import torch.nn.functional as F

    begins, ends, shape = a["begins"], a["ends"], list(a["input_shape"])
    pre_pad = None
    if begins != ends:  # oneDNN pads symmetrically: pad the input here first
        pre_pad = [p for b, e in zip(reversed(begins), reversed(ends)) for p in (b, e)]
        shape = shape[:2] + [s + b + e for s, b, e in zip(shape[2:], begins, ends)]
        begins = [0, 0]
    weight = torch.from_numpy(np.array(a["weight"]))
    bias = torch.from_numpy(np.array(a["bias"]))
    strides, dilations, groups = a["strides"], a["dilations"], a["group"]
    packed = torch.ops.mkldnn._reorder_convolution_weight(weight, begins, strides, dilations,
                                                          groups, shape)
    attr, scalars, algorithm = a["unary"] or ("none", [], None)
    cl = torch.channels_last
    if a["binary"]:
        binary = torch.ops.mkldnn._convolution_pointwise.binary
        unary = None if attr == "none" else attr

        def run(x, other):
            x = F.pad(x, pre_pad) if pre_pad else x
            return (binary(x.contiguous(memory_format=cl), other.contiguous(memory_format=cl),
                           packed, bias, begins, strides, dilations, groups, "add", None, unary,
                           scalars, algorithm),)
        return run
    pointwise = torch.ops.mkldnn._convolution_pointwise

    def run_unary(x):
        x = F.pad(x, pre_pad) if pre_pad else x
        return (pointwise(x.contiguous(memory_format=cl), packed, bias, begins, strides, dilations,
                          groups, attr, scalars, algorithm),)
    return run_unary


def _torch_conv(a: dict[str, Any]) -> Workload:
    """torch's own convolution on channels-last tensors, the post-ops as separate torch calls."""
    import torch
    import torch.nn.functional as F

    cl = torch.channels_last
    weight = torch.from_numpy(np.array(a["weight"])).contiguous(memory_format=cl)
    bias = torch.from_numpy(np.array(a["bias"]))
    begins, ends = a["begins"], a["ends"]
    pre_pad = None if begins == ends else [p for b, e in zip(reversed(begins), reversed(ends))
                                           for p in (b, e)]
    padding = begins if pre_pad is None else [0, 0]
    strides, dilations, groups = a["strides"], a["dilations"], a["group"]
    post = _torch_post_op(a["unary"])

    def conv(x):
        x = F.pad(x, pre_pad) if pre_pad else x
        return F.conv2d(x.contiguous(memory_format=cl), weight, bias, strides, padding, dilations,
                        groups)

    if a["binary"]:
        def run(x, other):
            y = conv(x).add_(other)
            return (post(y) if post else y,)
        return run

    def run_unary(x):
        y = conv(x)
        return (post(y) if post else y,)
    return run_unary


# -- Linear --------------------------------------------------------------------------------------------
def _match_linear(layer: Layer, ctx: _Context) -> tuple[list[Layer], Layer] | None:
    if layer.op_type == "Gemm" and not layer.domain:
        found = _gemm_weights(layer, ctx)
    elif layer.op_type == "MatMul" and not layer.domain:
        found = _matmul_weights(layer, ctx)
    else:
        return None
    if found is None:
        return None
    weight, bias, group = found
    out = group[-1].outputs[0]
    x, inputs, binary = layer.inputs[0], [layer.inputs[0]], False
    output_shape = None
    reshape = ctx.sole(out)  # Gemm's 2-D result reshaped back to (batch, seq, features)
    if reshape is not None and reshape.op_type == "Reshape" and not reshape.domain \
            and (shape := ctx.shape(reshape.outputs[0])) is not None \
            and shape[-1:] == (weight.shape[0],):
        output_shape = list(shape)
        group.append(reshape)
        out = reshape.outputs[0]
    nxt = ctx.sole(out)
    unary: PostOp | None = None
    gelu = _gelu(out, ctx)
    if gelu is not None:
        unary, out = ("gelu", [], gelu[1]), gelu[0][-1].outputs[0]
        group += gelu[0]
    elif nxt is not None and (unary := post_op(nxt, ctx)) is not None:
        group.append(nxt)
        out = nxt.outputs[0]
    elif (residual := _residual(nxt, out, ctx)) is not None:  # oneDNN's binary post-op
        inputs, binary, out = [x, residual], True, nxt.outputs[0]  # type: ignore[union-attr]
        group.append(nxt)  # type: ignore[arg-type]
    attrs = {"weight": np.ascontiguousarray(weight, F32),
             "bias": None if bias is None else np.ascontiguousarray(bias, F32),
             "input_shape": list(ctx.shape(x) or []), "unary": unary, "binary": binary,
             "output_shape": output_shape}
    fused = Layer("+".join(lay.name for lay in group), "Linear", inputs, [out], attrs, FUSED_DOMAIN, 1)
    return group, fused


def _residual(add: Layer | None, out: str, ctx: _Context) -> str | None:
    """The other operand of ``add`` when it adds a tensor of ``out``'s shape to ``out``."""
    if add is None or add.op_type != "Add" or add.domain:
        return None
    other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
    if other == out or ctx.const(other) is not None or ctx.shape(other) != ctx.shape(out):
        return None
    return other


def _gelu(out: str, ctx: _Context) -> tuple[list[Layer], str] | None:
    """GELU written out by an exporter, read from ``out``: its layers (the last one writes the
    result) and torch's name for its form ("none": with Erf, "tanh": the tanh approximation)."""
    users = ctx.consumers.get(out, [])
    if out in ctx.graph.outputs or any(
            id(u) not in ctx.inside or id(u) in ctx.taken or u.domain for u in users):
        return None
    if len(users) == 2:
        layers = _gelu_erf(out, users, ctx)
        return (layers, "none") if layers else None
    if len(users) == 3:
        layers = _gelu_tanh(out, users, ctx)
        return (layers, "tanh") if layers else None
    return None


def _gelu_erf(out: str, users: list[Layer], ctx: _Context) -> list[Layer] | None:
    """x * 0.5 * (1 + erf(x / sqrt(2))), in either order of the two Muls."""
    scale = next((u for u in users if _scalar_op(u, out, ctx, "Div", math.sqrt(2))
                  or _scalar_op(u, out, ctx, "Mul", 1 / math.sqrt(2))), None)
    erf = ctx.sole(scale.outputs[0]) if scale is not None else None
    one = ctx.sole(erf.outputs[0]) if erf is not None and erf.op_type == "Erf" else None
    if one is None or not _scalar_op(one, erf.outputs[0], ctx, "Add", 1.0):  # type: ignore[union-attr]
        return None
    first = next(u for u in users if u is not scale)
    return _times_half(out, first, one.outputs[0], ctx, [scale, erf, one])  # type: ignore[list-item]


def _gelu_tanh(out: str, users: list[Layer], ctx: _Context) -> list[Layer] | None:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), as GPT-2's exports write it."""
    cube = next((u for u in users if _scalar_op(u, out, ctx, "Pow", 3.0)), None)
    cubic = ctx.sole(cube.outputs[0]) if cube is not None else None
    if cubic is None or not _scalar_op(cubic, cube.outputs[0], ctx, "Mul", 0.044715):  # type: ignore[union-attr]
        return None
    inner = ctx.sole(cubic.outputs[0])
    if inner is None or inner.op_type != "Add" or set(inner.inputs) != {out, cubic.outputs[0]} \
            or inner not in users:
        return None
    scaled = ctx.sole(inner.outputs[0])
    if scaled is None or not _scalar_op(scaled, inner.outputs[0], ctx, "Mul", math.sqrt(2 / math.pi)):
        return None
    tanh = ctx.sole(scaled.outputs[0])
    one = ctx.sole(tanh.outputs[0]) if tanh is not None and tanh.op_type == "Tanh" else None
    if one is None or not _scalar_op(one, tanh.outputs[0], ctx, "Add", 1.0):  # type: ignore[union-attr]
        return None
    first = next(u for u in users if u is not cube and u is not inner)
    return _times_half(out, first, one.outputs[0], ctx, [cube, cubic, inner, scaled, tanh, one])  # type: ignore[list-item]


def _times_half(out: str, first: Layer, factor: str, ctx: _Context, body: list[Layer],
                ) -> list[Layer] | None:
    """The two Muls that end a GELU: (x * factor) * 0.5 or (x * 0.5) * factor, ``first`` reading x."""
    second = ctx.sole(first.outputs[0])
    if first.op_type != "Mul" or second is None or second.op_type != "Mul":
        return None
    if set(first.inputs) == {out, factor} and _scalar_op(second, first.outputs[0], ctx, "Mul", 0.5):
        pass
    elif not (_scalar_op(first, out, ctx, "Mul", 0.5) and set(second.inputs) == {first.outputs[0], factor}):
        return None
    if ctx.sole(factor) not in (first, second):
        return None
    return [*body, first, second]


def _scalar_op(layer: Layer, operand: str, ctx: _Context, op: str, value: float) -> bool:
    """Whether ``layer`` is ``operand <op> value`` (or ``value <op> operand`` for Add and Mul)."""
    if layer.op_type != op or layer.domain or len(layer.inputs) != 2 or operand not in layer.inputs:
        return False
    index = layer.inputs.index(operand)
    if op in ("Div", "Pow") and index != 0:
        return False
    constant = ctx.const(layer.inputs[1 - index])
    return constant is not None and constant.size == 1 and math.isclose(
        float(constant.reshape(-1)[0]), value, rel_tol=1e-6)


def _gemm_weights(gemm: Layer, ctx: _Context):
    a = gemm.attrs
    b = ctx.const(gemm.inputs[1])
    c_name = gemm.inputs[2] if len(gemm.inputs) > 2 else ""
    c = ctx.const(c_name)
    if b is None or b.dtype != F32 or a.get("transA", 0) or ctx.shape(gemm.inputs[0]) is None:
        return None
    if c_name and c is None:
        return None
    weight = (b if a.get("transB", 0) else b.T) * np.float32(a.get("alpha", 1.0))  # (N, K)
    bias = None
    if c is not None and a.get("beta", 1.0) != 0:
        if c.size not in (1, weight.shape[0]) or (c.ndim == 2 and c.shape[0] != 1):
            return None
        bias = np.broadcast_to(c.reshape(-1) * np.float32(a.get("beta", 1.0)), (weight.shape[0],))
    return weight, bias, [gemm]


def _matmul_weights(matmul: Layer, ctx: _Context):
    b = ctx.const(matmul.inputs[1])
    shape = ctx.shape(matmul.inputs[0])
    if b is None or b.dtype != F32 or b.ndim != 2 or shape is None or len(shape) < 2:
        return None
    weight, bias, group = b.T, None, [matmul]
    add = ctx.sole(matmul.outputs[0])
    if add is not None and add.op_type == "Add" and not add.domain:
        other = add.inputs[1] if add.inputs[0] == matmul.outputs[0] else add.inputs[0]
        c = ctx.const(other)
        if c is not None and c.dtype == F32 and c.size == b.shape[1] and c.shape[-1:] == (b.shape[1],) \
                and c.ndim <= len(shape):
            bias = c.reshape(-1)
            group.append(add)
    return weight, bias, group



def _torch_post_op(unary: PostOp | None) -> Callable[[Any], Any] | None:
    import torch
    import torch.nn.functional as F

    if unary is None:
        return None
    attr, scalars, algorithm = unary
    table: dict[str, Callable[[Any], Any]] = {
        "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "swish": F.silu,
        "leaky_relu": lambda t: F.leaky_relu(t, scalars[0] if scalars else 0.01),
        "hardtanh": lambda t: torch.clamp(t, scalars[0], scalars[1]),
        "gelu": lambda t: F.gelu(t, approximate=algorithm or "none"),
    }
    return table[attr]


def linear_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch
    import torch.nn.functional as F

    a = layer.attrs
    weight = torch.from_numpy(np.array(a["weight"]))
    bias = None if a["bias"] is None else torch.from_numpy(np.array(a["bias"]))
    post = _torch_post_op(a["unary"])

    shape = a.get("output_shape")  # a Reshape folded in: the result viewed in its shape
    result_shape = shape or [*a["input_shape"][:-1], weight.shape[0]]

    def mkl(x, residual=None):
        y = F.linear(x, weight, bias)
        y = post(y) if post else y
        y = y.view(shape) if shape else y
        return (y if residual is None else y.add_(residual),)

    route = backend.options.get("CpuAcc.linear_route", "auto")
    if route == "mkl" or not a["input_shape"]:
        return mkl
    rows = math.prod(a["input_shape"][:-1])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    attr, scalars, algorithm = a["unary"] or ("none", [], None)
    linear = torch.ops.mkldnn._linear_pointwise
    unfolded = [*a["input_shape"][:-1], weight.shape[0]]

    def onednn(x):
        y = linear(x, packed, bias, attr, scalars, algorithm)
        return (y.view(shape) if shape else y,)

    def onednn_add(x, residual):
        y = linear.binary(x, residual.reshape(unfolded), packed, bias, "add")
        return (y.view(shape) if shape else y,)

    fused = onednn_add if a.get("binary") else onednn
    if route == "onednn":
        return fused
    sample = [torch.randn(a["input_shape"])]
    if a.get("binary"):
        sample.append(torch.randn(result_shape))
    return min((mkl, fused), key=lambda run: _seconds(run, *sample))


def _seconds(run: Callable[..., Any], *sample: Any, repeat: int = 5) -> float:
    """The fastest of a few timed calls, after one untimed; a route that fails never wins."""
    try:
        run(*sample)
        best = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            run(*sample)
            best = min(best, time.perf_counter() - start)
        return best
    except RuntimeError:
        return math.inf


# -- squeeze-and-excitation -------------------------------------------------------------------------
def _match_squeeze_excite(gap: Layer, ctx: _Context) -> tuple[list[Layer], Layer] | None:
    """GlobalAveragePool -> 1x1 Conv -> activation -> 1x1 Conv -> gate -> Mul with the pooled input:
    the whole block on a vector of channels, as two small matrix products (oneDNN's convolution costs
    tens of microseconds a call on a 1x1 image, a matrix-vector product a few)."""
    x = gap.inputs[0]
    shape = ctx.shape(x)
    if gap.domain or shape is None or len(shape) != 4:
        return None
    group = [gap]
    reduce = _pointwise_conv(ctx.sole(gap.outputs[0]), shape[1], ctx)
    if reduce is None:
        return None
    group.append(reduce[0])
    act = _activation(reduce[0].outputs[0], ctx)
    if act is None:
        return None
    group += act[0]
    expand = _pointwise_conv(ctx.sole(act[0][-1].outputs[0]), reduce[1].shape[0], ctx)
    gate = _activation(expand[0].outputs[0], ctx) if expand is not None else None
    if expand is None or gate is None or gate[1][0] not in ("sigmoid", "hardsigmoid") \
            or expand[1].shape[0] != shape[1]:
        return None
    group += [expand[0], *gate[0]]
    mul = ctx.sole(gate[0][-1].outputs[0])
    if mul is None or mul.op_type != "Mul" or mul.domain or set(mul.inputs) != {x, gate[0][-1].outputs[0]}:
        return None
    group.append(mul)
    attrs = {"w1": reduce[1], "b1": reduce[2], "act": act[1], "w2": expand[1], "b2": expand[2],
             "gate": gate[1]}
    fused = Layer("+".join(lay.name for lay in group), "SqueezeExcite", [x], [mul.outputs[0]], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _pointwise_conv(conv: Layer | None, channels: int, ctx: _Context,
                    ) -> tuple[Layer, np.ndarray, np.ndarray] | None:
    """A 1x1, unpadded, ungrouped Conv with constant weights on ``channels`` inputs: the layer, its
    weight as a (out, in) matrix and its bias."""
    if conv is None or conv.op_type != "Conv" or conv.domain:
        return None
    weight = ctx.const(conv.inputs[1])
    b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    bias = ctx.const(b_name)
    a = conv.attrs
    if weight is None or weight.dtype != F32 or weight.shape[1:] != (channels, 1, 1) \
            or (b_name and bias is None) or a.get("group", 1) != 1 or any(a.get("pads") or []) \
            or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") \
            or any(v != 1 for v in (a.get("strides") or []) + (a.get("dilations") or [])):
        return None
    bias = np.zeros(weight.shape[0], F32) if bias is None else bias
    return conv, np.ascontiguousarray(weight.reshape(weight.shape[0], channels)), bias.astype(F32)


def _activation(out: str, ctx: _Context) -> tuple[list[Layer], PostOp] | None:
    """The activation applied to ``out``: its layers and its post-op."""
    swish = _swish(out, ctx)
    if swish is not None:
        return swish, ("swish", [], None)
    nxt = ctx.sole(out)
    unary = post_op(nxt, ctx) if nxt is not None else None
    return ([nxt], unary) if unary is not None else None  # type: ignore[list-item]


def squeeze_excite_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    import torch
    import torch.nn.functional as F

    a = layer.attrs
    w1, b1, w2, b2 = (torch.from_numpy(np.array(a[k])) for k in ("w1", "b1", "w2", "b2"))
    act, gate = _torch_post_op(a["act"]), _torch_post_op(a["gate"])
    assert act is not None and gate is not None, "the matcher takes activations only"

    def run(x):
        s = gate(F.linear(act(F.linear(x.mean((2, 3)), w1, b1)), w2, b2))  # (N, C)
        return (x * s[:, :, None, None],)
    return run


MATCHERS: dict[str, Callable[[Layer, _Context], tuple[list[Layer], Layer] | None]] = {
    "Conv": _match_conv, "GlobalAveragePool": _match_squeeze_excite}
"""The first layer of a pattern -> its matcher (any other layer may start a Linear)."""

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "FusedConv": conv_workload, "Linear": linear_workload, "SqueezeExcite": squeeze_excite_workload}
