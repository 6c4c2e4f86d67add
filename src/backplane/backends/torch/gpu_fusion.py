"""GpuAcc's fusions inside a captured subgraph: the calls (steps) its CUDA graph is made of.

- Conv [-> Add] -> Relu as one cuDNN call (``FUSE_CONV_RELU``, ``GpuAcc.fuse_conv_relu``): bias,
  residual and ReLU in the convolution's epilogue, in float32, float16 or bfloat16.
- An attention block as one ``scaled_dot_product_attention`` call (``GpuAcc.fuse_attention``), where
  fp16, bf16 or TF32 is allowed.
- Small layers in few kernels (``gpu_small.py``): a Conv1d of few output positions as one
  matrix product over its windows, the Relu after it folded in; a one-step LSTM as two products
  and torch's fused cell; a Gemm of one row by few columns as a sum of products.
- int8 layers in fewer kernels (``gpu_int8.py``): a QuantizeLinear -> DequantizeLinear round
  trip in one (five where jiterator cannot compile it); DynamicQuantizeLinear before a
  MatMulInteger in one (Triton, ``gpu_triton.py``) or two; MatMulInteger and QLinearConv with their constant operands made once.
- Trees of float32 elementwise layers (Add, Sub, Mul, Div, Erf, Tanh, Sqrt, Neg, Reciprocal, Pow
  by 2 or 3) as one kernel each (``gpu_chains.py``): an exported GELU, a LayerNorm's tail.
- A MatMul by a constant matrix and the Add of a constant bias that no tree took, as one addmm
  (``gpu_linear.py``): cuBLASLt adds the bias in the product's epilogue.

Each fused call keeps its layers' own kernels to fall back on, for good, where the fused kernel
refuses the shapes or types it is given (that shows in the warm-up runs, before any capture).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.kernels import bind_kernel
from backplane.backends.torch.gpu_chains import chain_steps
from backplane.backends.torch.gpu_int8 import int8_steps
from backplane.backends.torch.gpu_linear import linear_steps
from backplane.backends.torch.gpu_small import Step, small_steps
from backplane.ir.graph import Layer


FUSE_CONV_RELU = True
"""Conv [-> Add] -> Relu inside a subgraph as one cuDNN call (``torch.cudnn_convolution_relu``,
``torch.cudnn_convolution_add_relu``): bias, residual and ReLU in the convolution's epilogue, where
the layers' own kernels launch the convolution, a broadcast add of the bias, the Add and the ReLU. The
backend option ``GpuAcc.fuse_conv_relu`` overrides this default. On an H100 (fp32, batch 1) every such
chain of resnet50 and mobilenet_v3_large ran faster fused, 0.47x to 0.97x of its unfused time, with
the same cuDNN kernel (``sm80_xmma_fprop_implicit_gemm``) and bit-identical outputs."""


def inner_steps(layers: Sequence[Layer], backend: Any, outputs: Sequence[str] = (),
                 constants: dict[str, np.ndarray] | None = None) -> list[Step]:
    bound = [(bind_kernel(backend.kernel_for(layer), layer.attrs, len(layer.outputs)), layer)
             for layer in layers]
    steps: list[Step | None] = [(w, layer.inputs, layer.outputs) for w, layer in bound]
    uses: dict[str, int] = {}
    consumer: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for name in layer.inputs:
            if name:
                uses[name] = uses.get(name, 0) + 1
                consumer[name] = index
    for name in outputs:
        uses[name] = uses.get(name, 0) + 1

    def sole(name: str) -> int | None:
        return consumer.get(name) if uses.get(name) == 1 else None  # None: read outside only

    if _fuses_attention(backend):
        _fuse_attention(layers, steps, sole, constants or {})
    small_steps(layers, steps, sole, uses, constants or {})  # 1-d first: the next takes 2-d
    int8_steps(layers, steps, sole, constants or {}, uses)
    if not backend.options.get("GpuAcc.fuse_conv_relu", FUSE_CONV_RELU):
        chain_steps(layers, steps, [w for w, _ in bound], sole, outputs, constants or {})
        linear_steps(layers, steps, [w for w, _ in bound], sole, constants or {})
        return [s for s in steps if s is not None]
    for index, layer in enumerate(layers):
        if layer.op_type != "Conv" or layer.domain or not _fusable_conv(layer):
            continue
        chain, out = [index], layer.outputs[0]
        nxt = sole(out)
        if nxt is not None and layers[nxt].op_type == "Add" and not layers[nxt].domain:
            add = layers[nxt]
            if len(add.inputs) == 2 and add.inputs[0] != add.inputs[1]:
                chain.append(nxt)
                out = add.outputs[0]
                nxt = sole(out)
        if nxt is None or layers[nxt].op_type != "Relu" or layers[nxt].domain:
            continue
        chain.append(nxt)
        if any(steps[i] is None for i in chain):
            continue
        residual = ""
        if len(chain) == 3:
            add = layers[chain[1]]
            residual = add.inputs[1] if add.inputs[0] == layer.outputs[0] else add.inputs[0]
        parts = [bound[i][0] for i in chain]
        fused = _conv_relu(layer, parts, bool(residual))
        names = [*layer.inputs[:3], *([""] * (3 - len(layer.inputs)))] + ([residual] if residual else [])
        for i in chain:
            steps[i] = None
        steps[chain[-1]] = (fused, names, layers[chain[-1]].outputs)
    chain_steps(layers, steps, [w for w, _ in bound], sole, outputs, constants or {})
    linear_steps(layers, steps, [w for w, _ in bound], sole, constants or {})
    return [s for s in steps if s is not None]


def _fuses_attention(backend: Any) -> bool:
    """``GpuAcc.fuse_attention`` (default True), where the subgraph may round as tensor cores do:
    in fp16 or bf16, or with ``GpuAcc.tf32``. In strict float32 the layers' own kernels run, since
    the fused kernels may compute their products in TF32."""
    options = backend.options
    if not options.get("GpuAcc.fuse_attention", True):
        return False
    return bool(options.get("GpuAcc.tf32", False)) or \
        options.get("GpuAcc.precision", "fp32") != "fp32"


def _fuse_attention(layers: Sequence[Layer], steps: list[Step | None],
                    sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> None:
    """MatMul(Q, Kt) -> Mul or Div by a constant scalar -> [Add(mask) ->] Softmax(last axis) ->
    [Cast to float ->] MatMul(., V), each result read by the next alone, as one call of torch's
    ``scaled_dot_product_attention`` (Q, Kt transposed back to K, V, the mask, the scale): its flash
    or memory-efficient kernels on CUDA, where the layers launch five or six kernels and write the
    scores out twice. That is the attention block the TorchScript exporter writes for BERT and GPT-2
    (transformers' eager attention). Rewrites ``steps`` in place."""
    def one(index: int | None, *ops: str) -> Layer | None:
        if index is None or layers[index].op_type not in ops or layers[index].domain:
            return None
        return layers[index]

    def producer_index(name: str) -> int | None:
        for i, layer in enumerate(layers):
            if name in layer.outputs:
                return i
        return None

    def scalar(name: str) -> float | None:
        value = constants.get(name)
        if value is None or np.asarray(value).size != 1 or \
                not np.issubdtype(np.asarray(value).dtype, np.floating):
            return None
        return float(np.asarray(value).reshape(()))

    for index, softmax in enumerate(layers):
        if softmax.op_type != "Softmax" or softmax.domain or softmax.opset < 13 \
                or int(softmax.attrs.get("axis", -1)) != -1:
            continue
        chain = [index]
        start = producer_index(softmax.inputs[0])
        mask = ""
        add = one(start, "Add")
        if add is not None and start is not None and sole(add.outputs[0]) == index:
            scaled_at = next((i for i in (producer_index(n) for n in add.inputs)
                              if i is not None and layers[i].op_type in ("Mul", "Div")
                              and sole(layers[i].outputs[0]) == start), None)
            if scaled_at is None:
                continue
            mask = next(n for n in add.inputs if n != layers[scaled_at].outputs[0])
            chain.insert(0, start)
        else:
            scaled_at = start
        scaled = one(scaled_at, "Mul", "Div")
        if scaled is None or scaled_at is None or sole(scaled.outputs[0]) != chain[0]:
            continue
        product_at = next((producer_index(n) for n in scaled.inputs
                           if producer_index(n) is not None), None)
        product = one(product_at, "MatMul")
        if product is None or product_at is None or sole(product.outputs[0]) != scaled_at:
            continue
        factor = next((scalar(n) for n in scaled.inputs if n != product.outputs[0]), None)
        if factor is None or (scaled.op_type == "Div" and (scaled.inputs[0] != product.outputs[0]
                                                            or factor == 0)):
            continue
        scale = factor if scaled.op_type == "Mul" else 1.0 / factor
        tail: list[int] = []
        last = softmax
        cast_at = sole(softmax.outputs[0])
        cast = one(cast_at, "Cast")
        if cast is not None and cast_at is not None:
            if int(cast.attrs.get("to", 0)) != 1:  # a Cast to float32 only: the identity here
                continue
            tail.append(cast_at)
            last = cast
        out_at = sole(last.outputs[0])
        out = one(out_at, "MatMul")
        if out is None or out_at is None or out.inputs[0] != last.outputs[0]:
            continue
        tail.append(out_at)
        chain = [product_at, scaled_at, *chain, *tail]
        if any(steps[i] is None for i in chain):
            continue
        parts = [steps[i] for i in chain]
        made = {n for i in chain for n in layers[i].outputs}
        reads = list(dict.fromkeys(n for i in chain for n in layers[i].inputs
                                   if n and n not in made))
        fused = _attention(parts, reads, product.inputs[0], product.inputs[1], out.inputs[1], mask,
                           scale)  # type: ignore[arg-type]
        for i in chain:
            steps[i] = None
        steps[chain[-1]] = (fused, reads, out.outputs)


def _attention(parts: list[Step], reads: list[str], q: str, kt: str, v: str, mask: str,
               scale: float) -> Workload:
    """softmax(Q @ Kt * scale [+ mask]) @ V as ``scaled_dot_product_attention`` over the values
    named ``reads`` (the chain's inputs from outside it), else (an error of the fused call: no kernel
    for these shapes or types) the chain's own steps, for good."""
    import torch.nn.functional as F

    state = {"fused": True}
    final = parts[-1][2][0]

    def workload(*values: Any) -> tuple[Any]:
        env = dict(zip(reads, values))
        Q, Kt, V, M = env[q], env[kt], env[v], env.get(mask) if mask else None
        if state["fused"] and _sdpa_shapes(Q, Kt, V, M):
            try:
                return (F.scaled_dot_product_attention(Q, Kt.transpose(-2, -1), V, attn_mask=M,
                                                       scale=scale),)
            except (RuntimeError, ValueError):
                state["fused"] = False
        for step, names_in, names_out in parts:
            env.update(zip(names_out, step(*[env[n] if n else None for n in names_in])))
        return (env[final],)

    return workload


def _sdpa_shapes(Q: Any, Kt: Any, V: Any, M: Any) -> bool:
    """Whether ``scaled_dot_product_attention`` computes what the layers do on these values: one
    floating type, the same leading (batch, head) dimensions for Q, K and V (the layers' MatMuls
    would broadcast them; the fused kernels do not), and a mask that broadcasts to the scores
    without enlarging them."""
    import torch

    if not (Q.is_floating_point() and Q.dtype == Kt.dtype == V.dtype and Q.dim() >= 3
            and Q.dim() == Kt.dim() == V.dim() and Q.shape[:-2] == Kt.shape[:-2] == V.shape[:-2]
            and Q.shape[-1] == Kt.shape[-2] and Kt.shape[-1] == V.shape[-2]):
        return False
    if M is None:
        return True
    scores = (*Q.shape[:-1], Kt.shape[-1])
    try:
        return M.dtype == Q.dtype and tuple(torch.broadcast_shapes(M.shape, scores)) == scores
    except RuntimeError:
        return False


def _fusable_conv(layer: Layer) -> bool:
    kernel = layer.attrs.get("kernel_shape")
    pads = layer.attrs.get("pads") or [0, 0, 0, 0]
    return (layer.attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
            and int(layer.attrs.get("group", 1)) == 1 and len(layer.inputs) >= 2
            and (kernel is None or len(kernel) == 2) and len(pads) == 4
            and pads[:2] == pads[2:])


def _conv_relu(conv: Layer, parts: list[Workload], residual: bool) -> Workload:
    """relu(conv(X, W) + B [+ Z]) in one cuDNN call where cuDNN runs it (float32, float16 or
    bfloat16 on CUDA, NCHW or channels-last), else the layers' own kernels one after the other; an
    error of the fused call (no cuDNN engine for it) switches to the latter for good (it shows in the
    warm-up, before any capture)."""
    import torch

    fused_types = (torch.float32, torch.float16, torch.bfloat16)
    attrs = conv.attrs
    pads = list(attrs.get("pads") or [0, 0, 0, 0])[:2]
    if attrs.get("auto_pad", "NOTSET") == "VALID":
        pads = [0, 0]
    strides = list(attrs.get("strides") or [1, 1])
    dilations = list(attrs.get("dilations") or [1, 1])
    state: dict[str, Any] = {"fused": True}

    def _out_shape(X: Any, W: Any) -> tuple[int, ...]:
        spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, d, p in
                   zip(X.shape[2:], W.shape[2:], strides, dilations, pads)]
        return (X.shape[0], W.shape[0], *spatial)

    def unfused(X: Any, W: Any, B: Any, Z: Any = None) -> tuple[Any]:
        y = parts[0](X, W, B)[0]
        if residual:
            add = parts[1]
            y = add(y, Z)[0]  # Add is commutative: the order of its inputs does not matter
        return parts[-1](y)

    def workload(X: Any, W: Any, B: Any, Z: Any = None) -> tuple[Any]:
        if state["fused"] and X.is_cuda and X.dtype in fused_types and X.dim() == 4 \
                and W.dtype == X.dtype and (B is None or B.dtype == X.dtype) \
                and (Z is None or (Z.dtype == X.dtype and tuple(Z.shape) == _out_shape(X, W))):
            bias = B
            if bias is None:
                bias = state.get("zeros")
                if bias is None:
                    bias = state["zeros"] = torch.zeros(W.shape[0], dtype=W.dtype, device=W.device)
            try:
                if residual:
                    out = torch.cudnn_convolution_add_relu(X, W, Z, 1.0, bias, strides, pads,
                                                           dilations, 1)
                else:
                    out = torch.cudnn_convolution_relu(X, W, bias, strides, pads, dilations, 1)
                return (out,)
            except RuntimeError:
                state["fused"] = False
        return unfused(X, W, B, Z)

    return workload
