"""Conv [-> BatchNormalization] [-> Add(residual)] [-> activation]: one FusedConv, its route (oneDNN
with post-ops, or torch's convolution) measured at load."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.reference.kernels.conv import spatial_pads
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import (
    F32,
    Context,
    PostOp,
    compute_type,
    fastest,
    holding,
    onednn_post_ops,
    post_op,
    hardswish_layers,
    swish_layers,
    torch_post_op,
    weight_of,
)
from backplane.ir.graph import Layer


def match_conv(conv: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    x, w_name = conv.inputs[0], conv.inputs[1]
    weight, in_shape = ctx.const(w_name), ctx.shape(x)
    b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    bias = ctx.const(b_name)
    if weight is None or weight.dtype != F32 or in_shape is None or (weight.ndim, len(in_shape)) \
            not in ((4, 4), (3, 3)):
        return None
    if b_name and bias is None:
        return None
    line = weight.ndim == 3  # a 1-d convolution: fused as a 2-d one of height 1 (``_on_line``)
    rank = weight.ndim - 2
    strides = list(conv.attrs.get("strides") or [1] * rank)
    dilations = list(conv.attrs.get("dilations") or [1] * rank)
    begins, ends = spatial_pads(in_shape[2:], weight.shape[2:], strides, dilations,
                                conv.attrs.get("auto_pad", "NOTSET"), conv.attrs.get("pads"))
    if line:
        product = int(conv.attrs.get("group", 1)) == 1 and _a_product(
            in_shape, weight, strides[0], begins[0] + ends[0], dilations[0])
        if product or _quantized_after(conv.outputs[0], ctx):
            return None  # the int8 routes take 2-d convolutions only; the kernel's product
        weight, in_shape = weight[:, :, None, :], [*in_shape[:2], 1, in_shape[2]]
        strides, dilations, begins, ends = [1, *strides], [1, *dilations], [0, *begins], [0, *ends]
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
    swish = None if binary else swish_layers(out, ctx)
    hard = None if binary or swish is not None else (hardswish_layers(out, ctx)
                                                     or hard_sigmoid_gate(out, ctx))
    if swish is not None:
        unary, out = ("swish", [], None), swish[1].outputs[0]
        group += swish
    elif hard is not None:  # x * Clip(x + 3, 0, 6) / 6, or x * HardSigmoid(x)
        unary, out = ("hardswish", [], None), hard[-1].outputs[0]
        group += hard
    elif nxt is not None and (unary := post_op(nxt, ctx)) is not None:
        group.append(nxt)
        out = nxt.outputs[0]
    attrs = {"weight": np.ascontiguousarray(weight, F32), "bias": np.ascontiguousarray(bias, F32),
             "strides": strides, "dilations": dilations, "group": int(conv.attrs.get("group", 1)),
             "begins": begins, "ends": ends, "input_shape": list(in_shape),
             "output_shape": _unit_height(list(ctx.shape(conv.outputs[0]) or []), line),
             "binary": binary, "unary": unary, **({"line": True} if line else {})}
    fused = Layer("+".join(lay.name for lay in group), "FusedConv", inputs, [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _quantized_after(out: str, ctx: Context) -> bool:
    """Whether a QuantizeLinear reads ``out`` or what an elementwise layer makes of it (the
    activation a FusedConv would take): ``quantized.then_quant_dequant`` would hand the fused
    layer to the int8 routes."""
    for _ in range(3):  # the convolution, its batch norm, its activation
        users = ctx.consumers.get(out, [])
        if any(u.op_type == "QuantizeLinear" for u in users):
            return True
        if len(users) != 1 or not users[0].outputs:
            return False
        out = users[0].outputs[0]
    return False


def _a_product(in_shape: list[int], weight: np.ndarray, stride: int, pads: int,
               dilation: int) -> bool:
    """Whether the 1-d convolution has so few outputs that CpuAcc's kernel runs it as one matrix
    product of its windows, faster there than any convolution (``kernels.nn.PRODUCT_ROWS``)."""
    from backplane.backends.torch.kernels.nn import PRODUCT_ROWS, PRODUCT_WEIGHTS

    span = (weight.shape[2] - 1) * dilation + 1
    rows = in_shape[0] * ((in_shape[2] + pads - span) // stride + 1)
    return 0 < rows <= PRODUCT_ROWS and weight.size >= PRODUCT_WEIGHTS


def _unit_height(shape: list[int], line: bool) -> list[int]:
    """A 1-d convolution's (N, C, L) shape as the 2-d one it runs as, (N, C, 1, L)."""
    return [*shape[:2], 1, *shape[2:]] if line and len(shape) == 3 else shape


def hard_sigmoid_gate(out: str, ctx: Context) -> list[Layer] | None:
    """x * HardSigmoid(x) with alpha 1/6 and beta 1/2, read from ``out`` (torch.onnx's hard-swish
    below opset 14): the HardSigmoid and the Mul, or None. torch's hardswish is the same function
    (x * clamp(x + 3, 0, 6) / 6 against x * clamp(x / 6 + 1/2, 0, 1): within a float32 rounding),
    NaN kept."""
    users = ctx.consumers.get(out, [])
    if len(users) != 2 or out in ctx.graph.outputs:
        return None
    gate = next((u for u in users if u.op_type == "HardSigmoid" and not u.domain), None)
    mul = next((u for u in users if u.op_type == "Mul" and not u.domain), None)
    if gate is None or mul is None or post_op(gate, ctx) != ("hardsigmoid", [], None) \
            or ctx.sole(gate.outputs[0]) is not mul or sorted(mul.inputs) != sorted([out, gate.outputs[0]]):
        return None
    if any(id(u) not in ctx.inside or id(u) in ctx.taken for u in users):
        return None
    return [gate, mul]


def _fold_batch_norm(bn: Layer, weight: np.ndarray, bias: np.ndarray, ctx: Context,
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
    """The fastest, on this layer's shape, of oneDNN's fused convolution with a prepacked weight,
    torch's convolution (channels-last) followed by its post-ops, and, for a 1x1 convolution, a
    matrix product on the channels-last pixels; measured once, here, at load."""
    import torch

    a = layer.attrs
    makers = {"onednn": lambda a: _onednn_conv(a, layer.name), "torch": _torch_conv}
    if _is_pointwise(a):
        makers["gemm"] = _gemm_conv
    routes = {name: _route(name, make, a) for name, make in makers.items()}
    forced = backend.options.get("CpuAcc.conv_route", "auto")
    if forced in routes:
        return routes[forced]()

    def sample() -> list[Any]:
        cl = torch.channels_last
        dtype = compute_type(a)
        values = [torch.randn(a["input_shape"], dtype=dtype).contiguous(memory_format=cl)]
        if a["binary"]:
            values.append(torch.randn(a["output_shape"], dtype=dtype).contiguous(memory_format=cl))
        return [v.squeeze(2) for v in values] if a.get("line") else values  # (N, L, C) transposed

    described = {k: a[k] for k in ("input_shape", "strides", "dilations", "group", "begins", "ends",
                                   "binary", "unary")}
    if a.get("compute"):  # a reduced-precision layer's routes are measured and kept apart
        described["compute"] = a["compute"]
    return fastest("conv", {**described, "weight": a["weight"].shape}, routes, sample, backend)


def _route(name: str, make: Callable[[dict[str, Any]], Workload],
           a: dict[str, Any]) -> Callable[[], Workload]:
    """The route's maker: a route is built (its weight copied, packed) only when it is kept or
    measured, not at every load for the routes not taken."""
    def made() -> Workload:
        run = make(a)
        if a.get("line"):
            run = _on_line(run)
        run.route = name  # type: ignore[attr-defined]  # which one was kept, for tests and debugging
        return run
    return made


def _on_line(run: Workload) -> Workload:
    """``run`` (a 2-d route) on a 1-d convolution's (N, C, L) tensors, viewed as (N, C, 1, L).

    Why: torch's conv1d makes its input contiguous (N, C, L) first, and the usual input of a 1-d
    convolution by an exporter, an embedding or a previous layer's (N, L, C) transposed, is not:
    bytes_int32_dyn20's two sibling convolutions each copied theirs. The same view of height 1 is
    channels-last, the layout the 2-d routes read, with no copy; and the 2-d route brings what a
    2-d convolution has, a prepacked weight, fused post-ops, the folded batch norm."""
    def line(x: Any, *other: Any) -> tuple[Any]:
        (y,) = run(x.unsqueeze(2), *[o.unsqueeze(2) for o in other])
        return (y.squeeze(2),)

    line.__dict__.update(run.__dict__)  # its weights and the like, for tests and debugging
    return line


def _is_pointwise(a: dict[str, Any]) -> bool:
    """A 1x1, stride 1, unpadded, ungrouped convolution: a matrix product over the pixels."""
    return (a["weight"].shape[2:] == (1, 1) and a["strides"] == [1, 1] and a["group"] == 1
            and not any(a["begins"]) and not any(a["ends"]))


def _gemm_conv(a: dict[str, Any]) -> Workload:
    """A 1x1 convolution as (pixels, C) x (C, K) through MKL on the channels-last layout: the result
    viewed back as (N, K, H, W) is channels-last too, and no reorder happens on either side."""
    import torch
    import torch.nn.functional as F

    weight = weight_of(a, "weight", a["weight"][:, :, 0, 0])  # (K, C): the constant's memory in fp32
    bias = weight_of(a, "bias")
    n, _, h, w = a["input_shape"]
    k = weight.shape[0]
    cl = torch.channels_last

    def product(x):
        pixels = x.contiguous(memory_format=cl).permute(0, 2, 3, 1).reshape(-1, x.shape[1])
        return F.linear(pixels, weight, bias).view(n, h, w, k).permute(0, 3, 1, 2)

    return holding(_then_post_ops(product, a), weight, bias)


def _onednn_conv(a: dict[str, Any], name: str) -> Workload:
    import torch
    import torch.nn.functional as F

    from backplane.backends.torch import prepacked

    begins, ends, shape = a["begins"], a["ends"], list(a["input_shape"])
    pre_pad = None
    if begins != ends:  # oneDNN pads symmetrically: pad the input here first
        pre_pad = [p for b, e in zip(reversed(begins), reversed(ends)) for p in (b, e)]
        shape = shape[:2] + [s + b + e for s, b, e in zip(shape[2:], begins, ends)]
        begins = [0, 0]
    weight = weight_of(a, "weight")  # read once by the packing
    bias = weight_of(a, "bias")
    strides, dilations, groups = a["strides"], a["dilations"], a["group"]
    packed = prepacked.packed(name, lambda: torch.ops.mkldnn._reorder_convolution_weight(
        weight, begins, strides, dilations, groups, shape))
    (attr, scalars, algorithm), after = onednn_post_ops(a["unary"])
    cl = torch.channels_last
    if a["binary"]:
        binary = torch.ops.mkldnn._convolution_pointwise.binary
        unary = None if attr == "none" else attr

        def run(x, other):
            x = F.pad(x, pre_pad) if pre_pad else x
            y = binary(x.contiguous(memory_format=cl), other.contiguous(memory_format=cl), packed,
                       bias, begins, strides, dilations, groups, "add", None, unary, scalars,
                       algorithm)
            return (after(y) if after else y,)
        return holding(run, packed, bias)
    pointwise = torch.ops.mkldnn._convolution_pointwise

    def run_unary(x):
        x = F.pad(x, pre_pad) if pre_pad else x
        y = pointwise(x.contiguous(memory_format=cl), packed, bias, begins, strides, dilations,
                      groups, attr, scalars, algorithm)
        return (after(y) if after else y,)
    return holding(run_unary, packed, bias)


def _torch_conv(a: dict[str, Any]) -> Workload:
    """torch's own convolution on channels-last tensors, the post-ops as separate torch calls; in a
    ``Traced`` layer's trace, oneDNN's on the weight packed once (``_scripted_conv``).

    Its input is made channels-last only where it is not: traced, ``contiguous`` is an op even
    where it copies nothing, which oneDNN Graph's fuser leaves to TorchScript, and the partition
    before it then wrote its output in torch's strides, not its own layout. Traced for the fuser,
    a convolution whose weight alone makes its output channels-last (one group, a kernel over
    1x1: torch's conv2d takes the weight's layout) takes its input as it comes, and oneDNN reads
    NCHW inside the partition where torch copied it first (a model's image input). A 1x1 or
    grouped kernel's channels-last weight has a plain one's strides, and its output would stay
    NCHW: its input is copied. resnet_basic_ts16's trace, 1 thread, this 2-core AMD EPYC: its
    input's copy 3-4 us of a (3, 32, 32) 5x5 convolution's 21, five of its eight partitions
    writing their own layout."""
    import torch
    import torch.nn.functional as F

    from backplane.backends.torch import prepacked
    from backplane.backends.torch.kernels.common import for_onednn_graph

    cl = torch.channels_last
    # A copy only where channels-last is another layout (not for 1x1 or depthwise kernels)
    weight = weight_of(a, "weight").contiguous(memory_format=cl)
    bias = weight_of(a, "bias")
    begins, ends = a["begins"], a["ends"]
    pre_pad = None if begins == ends else [p for b, e in zip(reversed(begins), reversed(ends))
                                           for p in (b, e)]
    padding = begins if pre_pad is None else [0, 0]
    strides, dilations, groups = a["strides"], a["dilations"], a["group"]
    # the shape oneDNN's convolution sees: padded here only where the pads are not symmetric (a
    # weight packed for another input size is reordered at every call: resnet_basic_dyn21_qop's
    # 3x3 ones packed for 58x58 and run on 56x56, 14-45 ms a call of the run's 91 ms)
    shape = list(a["input_shape"]) if pre_pad is None else list(a["input_shape"][:2]) + [
        n + b + e for n, b, e in zip(a["input_shape"][2:], begins, ends)]
    plain = weight_of(a, "weight")  # what oneDNN's packing reads, in a Traced layer
    packs = groups > 1 or _macs(plain.shape, shape, strides, dilations) >= TRACED_PACKED_MACS
    wide = groups == 1 and any(k > 1 for k in plain.shape[2:])  # channels-last output whatever x's
    pixels = _pixel_product(a, plain) if _is_pointwise(a) else None

    def conv(x):
        x = F.pad(x, pre_pad) if pre_pad else x
        if not (x.is_contiguous(memory_format=cl) or wide and for_onednn_graph()):
            x = x.contiguous(memory_format=cl)
        inputs = prepacked.TRACED.get()
        if inputs is not None and packs and x.dtype == torch.float32:  # a Traced layer's
            if pixels is not None:
                return pixels(x)
            packed = inputs.conv_weight(plain, padding, strides, dilations, groups, shape)
            if torch.jit.is_tracing():
                return _scripted_conv()(x, packed, bias, padding, strides, dilations, groups)
        return F.conv2d(x, weight, bias, strides, padding, dilations, groups)

    return holding(_then_post_ops(conv, a), weight, bias)


def _pixel_product(a: dict[str, Any], plain: Any) -> Callable[[Any], Any]:
    """A 1x1 convolution (``_is_pointwise``) in a ``Traced`` layer's trace: one ``addmm`` of its
    channels-last pixels (N * H * W, C) by the weight's transposed (C, K) view, the result viewed
    back as (N, K, H, W) channels-last (``trace_epilogues.fold_relus`` then does a ReLU after it in
    the product's call).

    Why: oneDNN's ``_convolution_pointwise`` on a packed weight costs 40-100 us a call beyond
    its kernel (its setup made again at every call), a pointwise kernel's whole work at a CRNN's
    sizes: 1 thread, thread CPU us (p10), packed / this product: (32 -> 48, 8x80) 117 / 45,
    (64 -> 96, 8x160) 292 / 220, (256 -> 256, 28x28) 1873 / 1744 (load 8, this 2-core AMD EPYC);
    2 threads, wall p10: 82 / 50 and 261 / 168."""
    import torch

    matrix = plain[:, :, 0, 0].t()  # (C, K): a view of the constant, MKL reads it transposed
    bias = weight_of(a, "bias")
    n, c, h, w = a["input_shape"]
    k = matrix.shape[1]

    def product(x: Any) -> Any:
        rows = x.permute(0, 2, 3, 1).reshape(n * h * w, c)  # channels-last: a view
        return torch.addmm(bias, rows, matrix).view(n, h, w, k).permute(0, 3, 1, 2)
    return product


TRACED_PACKED_MACS = 300_000
"""A Traced layer's convolution of one group reads a packed weight (``_scripted_conv``) from this
many multiply-adds; a grouped one always (torch's conv2d takes oneDNN for it, reordering the
weight at every call). Below, torch's conv2d takes its own im2col kernel at batch 1 (input of at
most 20480 elements, kernel up to 3x3), which costs 7-16 us where oneDNN's call costs about 25
whatever its work (this 2-core AMD EPYC, 1 and 2 threads: (16, 16, 1x3) over 319 steps, 0.12 M,
10 against 27 us; (24, 16, 3x3) at 16x16, 0.22 M, 14 against 30). Packed for every size,
audio_conv1d_dyn19 ran 0.125 -> 0.229 ms a run; packed from 1 M, crnn_paddle_ts12's (16, 3, 3x3)
at 32x160 (0.55 M) and (48, 32, 1x1) (0.98 M) on torch's kernel took it 0.865 -> 1.029. A 1x1
one from this size is one product of its pixels instead (``_pixel_product``)."""


def _macs(weight: Any, padded: list[int], strides: list[int], dilations: list[int]) -> int:
    """A convolution's multiply-adds: ``weight``'s shape (out, in / groups, *kernel) over the
    padded input's shape (batch, channels, *spatial)."""
    out = 1
    for size, kernel, stride, dilation in zip(padded[2:], weight[2:], strides, dilations):
        out *= max(0, (size - dilation * (kernel - 1) - 1) // stride + 1)
    count = padded[0] * out
    for size in weight:
        count *= size
    return count


@functools.cache
def _scripted_conv() -> Any:
    """oneDNN's convolution (``mkldnn::_convolution_pointwise``) on a packed weight, as the
    TorchScript function a ``Traced`` layer's trace holds (``prepacked.TraceInputs``).

    Why: a trace holds torch's route (``onednn_graph.TRACEABLE_ROUTES``), torch's conv2d, which
    reorders the plain weight into oneDNN's layout at every call, and a frozen graph holds no packed
    weight as a constant; packed once, it is an input of the frozen graph, as a traced Linear's is.
    oneDNN Graph's traces (the fuser on) keep conv2d, the call its fuser takes. The tracer takes no
    ``Scalar?[]`` argument: a scripted call holds it, and freezing inlines it."""
    import torch

    return torch.jit.CompilationUnit(_ONEDNN_CONV).conv


_ONEDNN_CONV = """
def conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], padding: List[int], strides: List[int],
         dilations: List[int], groups: int) -> Tensor:
    scalars: List[Optional[Union[int, float, complex]]] = []
    return torch.ops.mkldnn._convolution_pointwise(x, weight, bias, padding, strides, dilations,
                                                   groups, "none", scalars, None)
"""


def _then_post_ops(compute: Callable[[Any], Any], a: dict[str, Any]) -> Workload:
    """``compute``'s result, plus the residual, then the activation: the post-ops as torch calls."""
    post = torch_post_op(a["unary"])
    if a["binary"]:
        def run(x, other):
            y = compute(x).add_(other)
            return (post(y) if post else y,)
        return run

    def run_unary(x):
        y = compute(x)
        return (post(y) if post else y,)
    return run_unary
