"""Gemm / MatMul with constant weights [-> bias] [-> Reshape] [-> activation, GELU or residual Add]:
one Linear, MKL or oneDNN measured at load, or oneDNN without measuring where its weight is large
(``ONEDNN_FROM``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import (
    F16,
    F32,
    Context,
    PostOp,
    because,
    compute_type,
    fastest,
    holding,
    onednn_post_ops,
    post_op,
    scalar_op,
    torch_post_op,
    weight_of,
)
from backplane.ir.graph import Layer


def match_linear(layer: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
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
            and (shape := ctx.float_shape(reshape.outputs[0])) is not None \
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
    # The weight as the model holds it, transposed as a view where it is: each route makes the
    # layout it reads (a contiguous copy, a packed one) and keeps only that.
    attrs = {"weight": weight,
             "bias": None if bias is None else np.ascontiguousarray(bias, F32),
             "input_shape": list(ctx.float_shape(x) or []), "unary": unary, "binary": binary,
             "output_shape": output_shape}
    if weight.dtype == F16:  # computed in float32 (``patterns.half_in_float``), its weight widened
        attrs.update(compute="float32", source="float16")
    fused = Layer("+".join(lay.name for lay in group), "Linear", inputs, [out], attrs, FUSED_DOMAIN, 1)
    return group, fused


def _residual(add: Layer | None, out: str, ctx: Context) -> str | None:
    """The other operand of ``add`` when it adds a tensor of ``out``'s shape to ``out``."""
    if add is None or add.op_type != "Add" or add.domain:
        return None
    other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
    if other == out or ctx.const(other) is not None or ctx.float_shape(other) != ctx.float_shape(out):
        return None
    return other


def _gelu(out: str, ctx: Context) -> tuple[list[Layer], str] | None:
    """GELU written out by an exporter, read from ``out``: its layers (the last one writes the
    result) and torch's name for its form ("none": with Erf, "tanh": the tanh approximation)."""
    users = list({id(u): u for u in ctx.consumers.get(out, [])}.values())  # x * x reads it twice
    if out in ctx.graph.outputs or any(
            id(u) not in ctx.inside or id(u) in ctx.taken or u.domain for u in users):
        return None
    if len(users) == 2:
        layers = _gelu_erf(out, users, ctx)
        return (layers, "none") if layers else None
    if len(users) in (3, 4):  # the cube as Pow 3, or as x * (x * x)
        layers = _gelu_tanh(out, users, ctx)
        return (layers, "tanh") if layers else None
    return None


def _gelu_erf(out: str, users: list[Layer], ctx: Context) -> list[Layer] | None:
    """x * 0.5 * (1 + erf(x / sqrt(2))), in either order of the two Muls."""
    scale = next((u for u in users if scalar_op(u, out, ctx, "Div", math.sqrt(2))
                  or scalar_op(u, out, ctx, "Mul", 1 / math.sqrt(2))), None)
    erf = ctx.sole(scale.outputs[0]) if scale is not None else None
    one = ctx.sole(erf.outputs[0]) if erf is not None and erf.op_type == "Erf" else None
    if one is None or not scalar_op(one, erf.outputs[0], ctx, "Add", 1.0):  # type: ignore[union-attr]
        return None
    first = next(u for u in users if u is not scale)
    return _times_half(out, first, one.outputs[0], ctx, [scale, erf, one])  # type: ignore[list-item]


def _gelu_tanh(out: str, users: list[Layer], ctx: Context) -> list[Layer] | None:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), as GPT-2's exports write it, the
    cube as Pow 3 or as x * (x * x) (torch.onnx's export of ``x * x * x``)."""
    cubed = _cube(out, users, ctx)
    if cubed is None:
        return None
    powers, cube = cubed, cubed[-1]
    cubic = ctx.sole(cube.outputs[0])
    if cubic is None or not scalar_op(cubic, cube.outputs[0], ctx, "Mul", 0.044715):
        return None
    inner = ctx.sole(cubic.outputs[0])
    if inner is None or inner.op_type != "Add" or set(inner.inputs) != {out, cubic.outputs[0]} \
            or inner not in users:
        return None
    scaled = ctx.sole(inner.outputs[0])
    if scaled is None or not scalar_op(scaled, inner.outputs[0], ctx, "Mul", math.sqrt(2 / math.pi)):
        return None
    tanh = ctx.sole(scaled.outputs[0])
    one = ctx.sole(tanh.outputs[0]) if tanh is not None and tanh.op_type == "Tanh" else None
    if one is None or not scalar_op(one, tanh.outputs[0], ctx, "Add", 1.0):  # type: ignore[union-attr]
        return None
    rest = [u for u in users if all(u is not p for p in powers) and u is not inner]
    if len(rest) != 1:
        return None
    body = [*powers, cubic, inner, scaled, tanh, one]
    return _times_half(out, rest[0], one.outputs[0], ctx, body, inner_half=True)  # type: ignore[arg-type]


def _cube(out: str, users: list[Layer], ctx: Context) -> list[Layer] | None:
    """The layers computing ``out`` cubed among its ``users``: Pow(x, 3), or Mul(x, x) then
    Mul(x, x * x) (either operand order); the last one's output is the cube."""
    power = next((u for u in users if scalar_op(u, out, ctx, "Pow", 3.0)), None)
    if power is not None:
        return [power]
    square = next((u for u in users if u.op_type == "Mul" and not u.domain
                   and list(u.inputs) == [out, out]), None)
    cube = ctx.sole(square.outputs[0]) if square is not None else None
    if cube is None or cube.op_type != "Mul" or cube.domain or cube not in users \
            or sorted(cube.inputs) != sorted([out, square.outputs[0]]):  # type: ignore[union-attr]
        return None
    return [square, cube]  # type: ignore[list-item]


def _times_half(out: str, first: Layer, factor: str, ctx: Context, body: list[Layer],
                inner_half: bool = False) -> list[Layer] | None:
    """The two Muls that end a GELU: (x * factor) * 0.5, (x * 0.5) * factor, or where
    ``inner_half`` x * (factor * 0.5) (dynamo's export of nn.GELU), ``first`` reading x. Only the
    tanh form takes dynamo's order: in a trace torch's erf GELU and its +Inf fix-up (3 ops)
    cost more than the 5 ops (encoder_padmask_dyn17's trace 123 -> 141 us at 1 thread)."""
    half = ctx.sole(factor)
    if inner_half and first.op_type == "Mul" and half is not None and half is not first \
            and scalar_op(half, factor, ctx, "Mul", 0.5) \
            and set(first.inputs) == {out, half.outputs[0]} and ctx.sole(half.outputs[0]) is first:
        return [*body, half, first]
    second = ctx.sole(first.outputs[0])
    if first.op_type != "Mul" or second is None or second.op_type != "Mul":
        return None
    if set(first.inputs) == {out, factor} and scalar_op(second, first.outputs[0], ctx, "Mul", 0.5):
        pass
    elif not (scalar_op(first, out, ctx, "Mul", 0.5) and set(second.inputs) == {first.outputs[0], factor}):
        return None
    if ctx.sole(factor) not in (first, second):
        return None
    return [*body, first, second]


def _gemm_weights(gemm: Layer, ctx: Context):
    a = gemm.attrs
    b = ctx.const(gemm.inputs[1])
    c_name = gemm.inputs[2] if len(gemm.inputs) > 2 else ""
    c = ctx.const(c_name)
    if b is None or not ctx.floating(b.dtype) or a.get("transA", 0) \
            or ctx.float_shape(gemm.inputs[0]) is None:
        return None
    if c_name and c is None:
        return None
    weight = b if a.get("transB", 0) else b.T  # (N, K), a view of the constant
    if a.get("alpha", 1.0) != 1.0:
        weight = weight * np.float32(a["alpha"])
    bias = None
    if c is not None and a.get("beta", 1.0) != 0:
        if c.size not in (1, weight.shape[0]) or (c.ndim == 2 and c.shape[0] != 1):
            return None
        bias = c.reshape(-1)  # the constant's memory, where beta is 1 and it has N values
        if a.get("beta", 1.0) != 1.0:
            bias = bias * np.float32(a["beta"])
        if bias.size == 1:
            bias = np.broadcast_to(bias, (weight.shape[0],))  # made contiguous by the matcher
    return weight, bias, [gemm]


def _matmul_weights(matmul: Layer, ctx: Context):
    b = ctx.const(matmul.inputs[1])
    shape = ctx.float_shape(matmul.inputs[0])
    if b is None or not ctx.floating(b.dtype) or b.ndim != 2 or shape is None or len(shape) < 2:
        return None
    weight, bias, group = b.T, None, [matmul]
    add = ctx.sole(matmul.outputs[0])
    if add is not None and add.op_type == "Add" and not add.domain:
        other = add.inputs[1] if add.inputs[0] == matmul.outputs[0] else add.inputs[0]
        c = ctx.const(other)
        if c is not None and c.dtype == b.dtype and c.size == b.shape[1] and c.shape[-1:] == (b.shape[1],) \
                and c.ndim <= len(shape):
            bias = c.reshape(-1)
            group.append(add)
    return weight, bias, group


def linear_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """MKL's product (torch's linear, then the post-ops) or oneDNN's with a prepacked weight and
    its post-op fused, the faster measured once at load; only the route kept is built."""
    import torch

    a = layer.attrs
    route = backend.options.get("CpuAcc.linear_route", "auto")
    if route != "onednn" and _native(a, backend):  # "mkl" too: what a trace forces (onednn_graph)
        return _native_linear(a)
    if route == "mkl" or not a["input_shape"]:
        return _mkl_linear(a)
    if route == "onednn":
        return _onednn_linear(a, layer.name)
    if _onednn_known_faster(a):
        rows, (n, k) = math.prod(a["input_shape"][:-1]), a["weight"].shape
        return because(_onednn_linear(a, layer.name),
                       f"onednn: a {n}x{k} weight over {rows} rows, where oneDNN's product is "
                       f"the faster (ONEDNN_FROM), unmeasured")
    result_shape = a.get("output_shape") or [*a["input_shape"][:-1], a["weight"].shape[0]]

    def sample() -> list[Any]:
        dtype = compute_type(a)
        return [torch.randn(a["input_shape"], dtype=dtype)] + (
            [torch.randn(result_shape, dtype=dtype)] if a.get("binary") else [])

    described = {k: a.get(k) for k in ("input_shape", "unary", "binary", "output_shape")}
    described.update(weight=torch.Size(a["weight"].shape), bias=a["bias"] is not None)
    if a.get("compute"):  # a reduced-precision layer's routes are measured and kept apart
        described["compute"] = a["compute"]
    routes = {"mkl": lambda: _mkl_linear(a), "onednn": lambda: _onednn_linear(a, layer.name)}
    if _onednn_first(a):  # what a busy machine takes unmeasured (``fastest``: the first route)
        routes = {"onednn": routes["onednn"], "mkl": routes["mkl"]}
    return fastest("linear", described, routes, sample, backend)


ONEDNN_FROM = 1 << 20
"""The weights (N x K values) from which oneDNN's product is taken without measuring, over 2
rows or more: MKL's sgemm on this AMD EPYC (MKL's AVX-512 paths are Intel's) was 1.1-3x slower
than oneDNN's packed product at every such shape timed (13 shapes, rows x K x N from 2x1024x1024
to 400x256x4096, 1 and 2 threads, one at 0.94 under load), where measuring at load under others' load picked
MKL for the CRNN's 192 -> 6625 head (8.4-12.5 ms against 4.8). Below it each wins somewhere
(MKL at one row and at small weights), so it is measured."""


def _onednn_known_faster(a: dict[str, Any]) -> bool:
    rows = math.prod(a["input_shape"][:-1])
    return rows >= 2 and a["weight"].size >= ONEDNN_FROM and _plain(a)


ONEDNN_FIRST_FROM, ONEDNN_FIRST_ROWS = 1 << 17, 16
"""From 2^17 weights over 16 rows or more, oneDNN's product is the route a busy machine takes
unmeasured (the first of the routes; a quiet load still measures both) and the one a trace holds
on the plain weight: a transformer's projections, CPU time, 1 thread / 2, MKL against oneDNN
packed (and plain), this AMD EPYC at load 5: 64x256x768 271-300 / 239-243 (266-298) us and
218+ / 135-144 (176-219), 64x1024x256 388-407 / 312-320 (349-351) and 251-292 / 179-218
(211-252), 50x768x768 675-726 / 553-567 (617-634) and 1907-2123 / 309-329 (426-466); below it
MKL wins (128x128x64 26 against 34-38 us)."""


def _onednn_first(a: dict[str, Any]) -> bool:
    rows = math.prod(a["input_shape"][:-1])
    return rows >= ONEDNN_FIRST_ROWS and a["weight"].size >= ONEDNN_FIRST_FROM and _plain(a)


def _plain(a: dict[str, Any]) -> bool:
    """Whether the layer computes in float32 (a float16 one widened does too)."""
    return a.get("compute") in (None, "float32")


def _widened(run: Callable[..., Any], dtype: Any, x: Any, residual: Any = None) -> tuple[Any]:
    """``run`` on ``x`` (and residual) in its weight's ``dtype``, its result in ``x``'s: a
    float16 Linear (``source``) outside a float32 trace, which hands it float32 instead."""
    (y,) = run(x.to(dtype)) if residual is None else run(x.to(dtype), residual.to(dtype))
    return (y.to(x.dtype),)


def _native(a: dict[str, Any], backend: Any) -> bool:
    """Whether the layer takes backplane's C product (``native/linear``): ``CpuAcc.native``
    "auto" on CpuAcc, a session of one thread, float32, at least ``linear.LARGE`` multiply-adds
    on its known input shape, the library here."""
    from backplane.backends.torch.threads import thread_setting

    if getattr(backend, "id", "") != "CpuAcc" or not _plain(a) or not a["input_shape"] \
            or np.asarray(a["weight"]).dtype != np.float32 or a["weight"].ndim != 2:
        return False
    from backplane.native import build, linear

    if math.prod(a["input_shape"][:-1]) * a["weight"].size < linear.LARGE:
        return False
    try:
        if thread_setting(backend.options.get("CpuAcc.threads")) != 1:
            return False
    except Exception:  # noqa: BLE001  # an unknown setting is the load's error to raise
        return False
    return linear.usable(build.mode(backend.options))


def _native_linear(a: dict[str, Any]) -> Workload:
    """The product by backplane's C on the weight packed here, then the post-op, the view and
    the residual as ``_mkl_linear`` does them."""
    from backplane.native import linear

    weight, bias = weight_of(a, "weight"), weight_of(a, "bias")
    post = torch_post_op(a["unary"])
    shape = a.get("output_shape")
    product = linear.product(weight, bias)

    def native(x, residual=None):
        if x.dtype != weight.dtype:
            return _widened(native, weight.dtype, x, residual)
        y = product(x)
        y = post(y) if post else y
        y = y.view(shape) if shape else y
        return (y if residual is None else y.add_(residual),)
    return because(holding(native, product.packed, bias),
                   "native: backplane's C product (CpuAcc.native auto)")


def _mkl_linear(a: dict[str, Any]) -> Workload:
    weight = weight_of(a, "weight")  # the constant's memory where it is (N, K) contiguous fp32
    bias = weight_of(a, "bias")
    post = torch_post_op(a["unary"])
    shape = a.get("output_shape")  # a Reshape folded in: the result viewed in its shape
    # A trace holds MKL's product (TorchScript takes no packed oneDNN weight): where oneDNN is
    # known faster, or first, it holds oneDNN's product on the plain weight instead (4.6 against
    # MKL's 6.2 and packed 4.1 ms for the CRNN's head, 1 thread).
    product = _traceable_onednn(math.prod(a["input_shape"][:-1])) if a["input_shape"] and (
        _onednn_known_faster(a) or _onednn_first(a)) else _flat_linear(weight)

    def mkl(x, residual=None):
        if x.dtype != weight.dtype:
            return _widened(mkl, weight.dtype, x, residual)
        y = product(x, weight, bias)
        y = post(y) if post else y
        y = y.view(shape) if shape else y
        return (y if residual is None else y.add_(residual),)
    return holding(mkl, weight, bias)


def _flat_linear(weight: Any) -> Callable[[Any, Any, Any], Any]:
    """torch's linear as the product it makes of a contiguous input (``_flatten_nd_linear``:
    ``addmm`` of the bias and the input's rows, or ``mm``, by the weight's transposed view, here
    made once), without linear's own dispatch and its ``t``, ``reshape`` and ``view`` around the
    product at every call. In a frozen trace the executor runs the ``addmm`` as ``mm`` then
    the bias added (ONNX's MatMul then Add), and a Relu after it is one ``_addmm_activation``
    (``trace_epilogues.fold_relus``). One product of 8 x 32 rows by 32 x 32 and its bias in a
    frozen trace, 1 thread: 7.3 -> 5.9 us (load 3.4). Any other input takes torch's linear, as
    does a trace for oneDNN Graph's fuser (``aten::linear`` is what it takes into a partition;
    it failed on an ``addmm`` of a frozen transposed weight)."""
    import torch
    import torch.nn.functional as F

    from backplane.backends.torch.kernels.common import for_onednn_graph

    transposed = weight.t()

    def product(x: Any, weight: Any, bias: Any) -> Any:
        if x.dim() < 2 or not x.is_contiguous() or (bias is not None and bias.dim() != 1) \
                or for_onednn_graph():
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        y = torch.mm(rows, transposed) if bias is None else torch.addmm(bias, rows, transposed)
        return y.view(*x.shape[:-1], transposed.shape[1]) if x.dim() != 2 else y
    return product


def _traceable_onednn(rows: int) -> Callable[[Any, Any, Any], Any]:
    """oneDNN's product of ``x`` and the (N, K) ``weight`` inside a trace, torch's linear
    elsewhere: layer by layer (CpuAcc.linear_route "mkl" is MKL's) and in a trace for oneDNN
    Graph's fuser (``aten::linear`` is what it takes into its partitions). A ``Traced`` layer
    hands it the weight packed for ``rows`` rows as one of its inputs (``prepacked.TRACED``);
    elsewhere it reads the plain weight, reordered at each call."""
    import torch
    import torch.nn.functional as F

    from backplane.backends.torch import prepacked

    def product(x: Any, weight: Any, bias: Any) -> Any:
        inputs = prepacked.TRACED.get()
        if inputs is not None:
            packed = inputs.weight(weight, rows)  # made on the untraced run, an input traced
            if not torch.jit.is_tracing():
                return F.linear(x, weight, bias)
            return _scripted_onednn()(x, packed, bias)
        if torch.jit.is_tracing() and not torch.jit.onednn_fusion_enabled():
            return _scripted_onednn()(x, weight, bias)
        return F.linear(x, weight, bias)
    return product


@functools.cache
def _scripted_onednn() -> Any:
    """``mkldnn::_linear_pointwise`` as a TorchScript function (the tracer takes no ``Scalar?[]``
    argument, a scripted call holds one, and freezing inlines it), in a compilation unit of its
    own, from source: TorchScript reads no annotations of this lazily importing module."""
    import torch

    return torch.jit.CompilationUnit(_ONEDNN_PRODUCT).product


_ONEDNN_PRODUCT = """
def product(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    scalars: List[Optional[Union[int, float, complex]]] = []
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", scalars, None)
"""


def _onednn_linear(a: dict[str, Any], name: str) -> Workload:
    import torch

    from backplane.backends.torch import prepacked

    weight = weight_of(a, "weight")  # read once by the packing: no copy of its own needed
    bias = weight_of(a, "bias")
    shape = a.get("output_shape")
    packed = prepacked.packed(name, lambda: torch.ops.mkldnn._reorder_linear_weight(
        weight, math.prod(a["input_shape"][:-1])))
    (attr, scalars, algorithm), after = onednn_post_ops(a["unary"])
    linear = torch.ops.mkldnn._linear_pointwise
    unfolded = [*a["input_shape"][:-1], weight.shape[0]]

    def onednn(x):
        if x.dtype != weight.dtype:
            return _widened(onednn, weight.dtype, x)
        y = linear(x, packed, bias, attr, scalars, algorithm)
        y = after(y) if after else y
        return (y.view(shape) if shape else y,)

    def onednn_add(x, residual):
        if x.dtype != weight.dtype:
            return _widened(onednn_add, weight.dtype, x, residual)
        y = linear.binary(x, residual.reshape(unfolded), packed, bias, "add")
        return (y.view(shape) if shape else y,)

    return holding(onednn_add if a.get("binary") else onednn, packed, bias)
