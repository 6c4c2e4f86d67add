"""What ``onnxruntime.quantization.quantize_dynamic`` writes for each MatMul, as one CpuAcc layer:
DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(x's scale * the weight's) [-> Add(bias)]
becomes one ``DynamicQuantMatMul``: x quantized over its range as CpuRef does it, centred, times
the centred weight in float32 (exact: every sum below 2^24, checked from the weight), times the
scales, plus the bias.

Where one DynamicQuantizeLinear feeds several such branches (a layer's Q, K and V projections of
one input), they are one layer too: x quantized once, one product by the weights stacked, its
columns split into the branches' outputs. Each column is computed as its branch computes it, so
the outputs are CpuRef's, bit for bit, either way.

A GELU written out after a lone branch (GPT-2's tanh form, nine layers: ``linear._gelu``) is the
layer's post-op, torch's GELU on its result, as a float Linear takes it: the small tier's quantized
GPT's two were 18 of its trace's 232 ops. Its values are torch's GELU's, a rounding or two from
the nine steps' (as the float GPT's are), so a later quantization may put a value on the next
step where the nine steps' would not: within one step of the graph's grid (the contract for
ONNX Runtime's quantized models: its output within one quantization step).

An Add of a tensor of its shape after a lone branch (a transformer block's residual sum: the
quantized GPT's four) is the layer's last step, the sum made by the product's op (one rounding,
the Add's own: the outputs stay CpuRef's bit for bit), as a float Linear takes it: one trace op
fewer each.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import F32, Context, compute_type, torch_post_op
from backplane.backends.torch.fusion.linear import _gelu, _residual
from backplane.backends.torch.fusion.qlinear import EXACT, _centred_weight
from backplane.backends.torch.fusion.qlinear_float import _in_float32
from backplane.ir.graph import Layer

Branch = tuple[list[Layer], str, np.ndarray, np.ndarray, np.ndarray | None]
"""A branch's layers, its output, its centred (K, N) weight, its weight scale (N,) and bias."""


def match_dynamic_matmul(quantize: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """DynamicQuantizeLinear of a static float32 x whose three outputs are read by MatMulInteger
    branches alone (their Mul of the scales each read by its branch alone): one layer."""
    x, q, x_scale, x_zero = quantize.inputs[0], *quantize.outputs
    info = ctx.graph.info(x)
    matmuls = ctx.consumers.get(q, [])
    if info.dtype != F32 or not info.is_static or len(info.shape) < 2 or not matmuls \
            or any(name in ctx.graph.outputs for name in (q, x_scale, x_zero)) \
            or {id(m) for m in ctx.consumers.get(x_zero, [])} != {id(m) for m in matmuls} \
            or len(ctx.consumers.get(x_scale, [])) != len(matmuls):
        return None
    branches = [_branch(matmul, quantize, ctx) for matmul in matmuls]
    if any(b is None for b in branches) or len({b[4] is None for b in branches}) != 1:  # type: ignore
        return None  # every branch with its bias, or none: a zero added would change -0.0
    order = {id(layer): k for k, layer in enumerate(ctx.view.layers)}
    # the earliest branch's output first: the layer runs where that one was made
    found: list[Branch] = sorted(branches, key=lambda b: order[id(b[0][-1])])  # type: ignore
    scales = [np.broadcast_to(b[3].reshape(-1), (b[2].shape[1],)) for b in found]
    attrs = {"weight": np.ascontiguousarray(np.concatenate([b[2] for b in found], 1).T),
             "bias": None, "input_shape": list(info.shape), "unary": None, "binary": False,
             "output_shape": None,
             "w_scale": np.concatenate(scales).astype(F32) if len(found) > 1 else found[0][3],
             "add": None if found[0][4] is None else np.concatenate([b[4] for b in found]),
             "splits": [b[2].shape[1] for b in found] if len(found) > 1 else None}
    group = [quantize, *(layer for b in found for layer in b[0])]
    inputs, outputs = [x], [b[1] for b in found]
    gelu = _gelu(outputs[0], ctx) if len(found) == 1 else None
    add = ctx.sole(outputs[0]) if len(found) == 1 else None
    if gelu is not None:  # the layer's post-op (torch's GELU), where a float Linear takes it too
        attrs["post"] = ("gelu", [], gelu[1])
        group, outputs = group + gelu[0], [gelu[0][-1].outputs[0]]
    elif (residual := _residual(add, outputs[0], ctx)) is not None:  # a block's sum, added last
        attrs["residual"] = True
        group, inputs, outputs = group + [add], [x, residual], [add.outputs[0]]  # type: ignore
    fused = Layer("+".join(lay.name for lay in group), "DynamicQuantMatMul", inputs, outputs,
                  attrs, FUSED_DOMAIN, 1)
    return group, fused


def _branch(matmul: Layer, quantize: Layer, ctx: Context) -> Branch | None:
    """MatMulInteger(q, constant 2-D weight, x's zero point, constant zero point) -> Cast to
    float -> Mul by Mul(x's scale, the weight's constant scale) [-> Add(constant bias)], each
    intermediate read by the next layer alone."""
    _, q, x_scale, x_zero = quantize.inputs[0], *quantize.outputs
    if matmul.op_type != "MatMulInteger" or matmul.domain or id(matmul) not in ctx.inside \
            or id(matmul) in ctx.taken or matmul.inputs[:1] + matmul.inputs[2:3] != [q, x_zero]:
        return None
    w_zero_name = matmul.inputs[3] if len(matmul.inputs) > 3 else ""
    w_zero = ctx.const(w_zero_name)
    weight = _centred_weight(ctx.const(matmul.inputs[1]), w_zero, per_row=False)
    if weight is None or weight.ndim != 2 or (w_zero_name and w_zero is None) \
            or 255 * float(np.abs(weight).sum(axis=0).max()) >= EXACT:
        return None
    cast = ctx.sole(matmul.outputs[0])
    if cast is None or cast.op_type != "Cast" or cast.domain or cast.attrs.get("to") != 1:
        return None
    scaled = ctx.sole(cast.outputs[0])
    if scaled is None or scaled.op_type != "Mul" or scaled.domain or len(scaled.inputs) != 2:
        return None
    scales = ctx.graph.producers().get(scaled.inputs[1 - scaled.inputs.index(cast.outputs[0])])
    w_scale = _other_constant(scales, x_scale, "Mul", ctx) if scales is not None else None
    if w_scale is None or w_scale.dtype != F32 or w_scale.size not in (1, weight.shape[1]) \
            or ctx.sole(scales.outputs[0]) is not scaled \
            or id(scales) not in ctx.inside or id(scales) in ctx.taken:  # type: ignore
        return None
    layers, out, bias = [scales, matmul, cast, scaled], scaled.outputs[0], None  # type: ignore
    add = ctx.sole(out)
    constant = _other_constant(add, out, "Add", ctx) if add is not None else None
    if constant is not None and constant.dtype == F32 and constant.shape == (weight.shape[1],):
        layers.append(add)  # type: ignore[arg-type]
        bias, out = np.ascontiguousarray(constant), add.outputs[0]  # type: ignore[union-attr]
    w_scale = w_scale.reshape(-1) if w_scale.size > 1 else w_scale.reshape(())
    return layers, out, weight, np.array(w_scale, F32), bias


def _other_constant(layer: Layer, operand: str, op: str, ctx: Context) -> np.ndarray | None:
    """The constant ``layer`` (an ``op`` of two inputs) combines ``operand`` with, or None."""
    if layer.op_type != op or layer.domain or len(layer.inputs) != 2 or operand not in layer.inputs:
        return None
    return ctx.const(layer.inputs[1 - layer.inputs.index(operand)])


def dynamic_matmul_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """x quantized over its range as DynamicQuantizeLinear does, centred, the product with the
    centred weight by the measured route (exact), then times x's scale times the weight's, plus
    the bias: the float32 steps of the layers it replaces, in their order; split into the
    branches' outputs where it holds several."""
    import torch

    from backplane.backends.torch.backend import _numpy_to_torch
    from backplane.backends.torch.fusion.linear import linear_workload

    a = layer.attrs
    post = torch_post_op(a.get("post"))
    bias = _numpy_to_torch(a["add"]) if a["add"] is not None else None
    w_scale = torch.from_numpy(np.array(a["w_scale"], F32))
    dtype, splits = compute_type(a), a.get("splits")
    native = _native(a, bias, w_scale, backend)
    # the float product's route measured at load only where it runs (a measured decision
    # flips between processes on a busy machine)
    product = linear_workload(_in_float32(layer), backend) if native is None else None

    def run_native(x, residual=None):
        if residual is not None and residual.dtype != torch.float32:
            residual = residual.float()
        y = native(x if x.dtype == torch.float32 else x.float(), residual)
        y = post(y) if post is not None else y
        y = y if dtype == torch.float32 else y.to(dtype)
        if splits is None:
            return (y,)
        return tuple(part.contiguous() for part in y.split(splits, dim=-1))

    def run(x, residual=None):
        # no call where x and y are float32 already: a trace keeps each call, about 1 us
        centred, scale = grid_on_host(x if x.dtype == torch.float32 else x.float())
        (acc,) = product(centred)
        y = acc.mul_(w_scale * scale)  # the two scales, the constant first (``product_grid``)
        y = y.add_(bias) if bias is not None else y
        y = y.add_(residual) if residual is not None else y
        y = post(y) if post is not None else y
        y = y if dtype == torch.float32 else y.to(dtype)
        if splits is None:
            return (y,)
        return tuple(part.contiguous() for part in y.split(splits, dim=-1))
    return run if native is None else run_native


def _native(attrs: dict[str, Any], bias: Any, w_scale: Any, backend: Any) -> Any:
    """The layer's product, scales and bias as one C call (``native/dynquant``: one op in a
    trace where the torch route makes about 20), or None where ``CpuAcc.native`` is off, the
    library is not here, or the backend is a GPU's."""
    if getattr(backend, "id", "CpuAcc") != "CpuAcc":
        return None
    from backplane.native import build, dynquant

    if not dynquant.usable(build.mode(backend.options)):
        return None
    weight = dynquant.weight_by_columns(attrs["weight"])
    scale = w_scale.reshape(-1).contiguous()
    added = bias.contiguous() if bias is not None else None
    return lambda x, residual: dynquant.matmul(x, weight, scale, added, residual)


def _grids() -> tuple[Any, Any]:
    """(``product_grid``, ``dynamic_grid``): torch's kernels, imported where a run needs them and
    not at this module's import (CpuAcc's fusions plan a native model without torch:
    ``backplane.torch_free``); the common path of ``grid_on_host`` reads neither."""
    from backplane.backends.torch.kernels.contrib_quant import dynamic_grid, product_grid

    return product_grid, dynamic_grid


def grid_on_host(x: Any) -> tuple[Any, Any]:
    """``dynamic_grid`` with the range read on the host and the scale and zero point computed in
    Python floats, as CpuRef computes them (float64, the scale rounded once to float32; 0 - low
    and its division by the scale in float32): four tensor calls where ``dynamic_grid`` (which a
    trace or a CUDA graph can hold) makes seventeen; on the small tier's quantized GPT, 8 x 64
    inputs, its nine products were 0.75 of 1.18 ms a run (1 thread, this AMD EPYC at load 6).
    In a trace, under a torch function mode (``fusion/traced.py``'s ``HostReads``, which runs the
    layers before a trace and would take the read for a value of the inputs read on the host: the
    quantized GPT then ran layer by layer, 0.50 -> 0.73 ms), on a GPU, or with a NaN in x (its
    range NaN), ``product_grid``."""
    import torch

    if x.is_cuda or torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled():
        product_grid, dynamic_grid = _grids()
        return product_grid(x) if x.shape.numel() else dynamic_grid(x)
    if not x.numel():
        return _grids()[1](x)
    lowest, highest = (float(v) for v in torch.aminmax(x))
    if lowest != lowest or highest != highest:  # NaN
        return _grids()[1](x)
    low, high = min(lowest, 0.0), max(highest, 0.0)
    scale = np.float32((high - low) / 255) if high > low else np.float32(1.0)
    zero = min(max(float(np.rint(np.float32(0.0 - low) / scale)), 0.0), 255.0)
    centred = torch.div(x, float(scale)).round_().clamp_(-zero, 255 - zero)
    return centred, float(scale)

