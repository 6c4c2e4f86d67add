"""GpuAcc's fusions inside a captured subgraph: the calls (steps) its CUDA graph is made of.

- Conv [-> Add] -> Relu as one cuDNN call (``FUSE_CONV_RELU``, ``GpuAcc.fuse_conv_relu``): bias,
  residual and ReLU in the convolution's epilogue, in float32, float16 or bfloat16.
- An attention block as one ``scaled_dot_product_attention`` call (``GpuAcc.fuse_attention``), where
  fp16, bf16 or TF32 is allowed.
- A small Conv1d (few output positions) as one matrix product over its unfolded input
  (``SMALL_CONV_COLUMNS``), where cuDNN's kernels are slow, the Relu after it in its last copy;
  a one-step LSTM as two products and torch's fused cell (``_one_step_lstm``).

Each fused call keeps its layers' own kernels to fall back on, for good, where the fused kernel
refuses the shapes or types it is given (that shows in the warm-up runs, before any capture).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.kernels import bind_kernel
from backplane.ir.graph import Layer

Step = tuple[Workload, Sequence[str], Sequence[str]]
"""One call inside a captured subgraph: the workload, the names it reads, the names it writes."""

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
    _small_steps(layers, steps, sole, uses, constants or {})  # 1-d first: the next takes 2-d
    if not backend.options.get("GpuAcc.fuse_conv_relu", FUSE_CONV_RELU):
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


def _small_steps(layers: Sequence[Layer], steps: list[Step | None],
                 sole: Callable[[str], int | None], uses: dict[str, int],
                 constants: dict[str, np.ndarray]) -> None:
    """Small 1-d Convs (with the Relu that alone reads one) and one-step LSTMs as their GPU
    forms (``_small_conv1d``, ``_one_step_lstm``; ``uses``: the readers of each value, the
    subgraph's outputs counted). Rewrites ``steps`` in place."""
    for index, layer in enumerate(layers):
        step = steps[index]
        if step is None or layer.domain:
            continue
        if layer.op_type == "LSTM" and _plain_lstm(layer):
            weights = [n for n in layer.inputs[1:4] if n]
            y_read = bool(layer.outputs and uses.get(layer.outputs[0]))
            steps[index] = (_one_step_lstm(step[0], all(n in constants for n in weights),
                                           y_read), step[1], step[2])
        if layer.op_type != "Conv" or _conv1d_attrs(layer) is None:
            continue
        after = sole(layer.outputs[0])
        relu = None if after is None else steps[after]
        if relu is None or layers[after].op_type != "Relu" or layers[after].domain:  # type: ignore[index]
            steps[index] = (_small_conv1d(layer, step[0]), step[1], step[2])
            continue
        steps[index] = None
        steps[after] = (_small_conv1d(layer, step[0], relu[0]), step[1],  # type: ignore[index]
                        relu[2])


SMALL_CONV_COLUMNS = 64
SMALL_CONV_WEIGHTS = 4096
"""A Conv1d whose output has at most ``SMALL_CONV_COLUMNS`` positions (batch x length) and whose
weight at least ``SMALL_CONV_WEIGHTS`` elements runs as one matrix product over its unfolded input
(``_small_conv1d``). cuDNN's implicit-GEMM kernels are made for many positions: inside a captured
graph on an H100, the full-tier VAD's two Conv1d (1 -> 258 channels, kernel 256 stride 128 on 576
samples; 258 -> 128 channels, kernel 3, 4 positions) took 12.8-25.9 and 18.9-20.9 us of a run's
82-126 us of kernels, the first 7.4 us as unfold and addmm (the run's kernels: 68 us with both and
the LSTM step by its cell). audio_conv1d_dyn19's 16-channel ones (768 weights and fewer) stay on
cuDNN: not measured faster so."""


def _conv1d_attrs(layer: Layer) -> tuple[int, int, int, int, int] | None:
    """(kernel, stride, dilation, pad begin, pad end) of a 1-d Conv of one group with explicit or
    VALID padding, else None."""
    kernel = layer.attrs.get("kernel_shape")
    pads = list(layer.attrs.get("pads") or [0, 0])
    if kernel is None or len(kernel) != 1 or int(layer.attrs.get("group", 1)) != 1 \
            or layer.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or len(pads) != 2:
        return None
    if layer.attrs.get("auto_pad", "NOTSET") == "VALID":
        pads = [0, 0]
    strides, dilations = layer.attrs.get("strides") or [1], layer.attrs.get("dilations") or [1]
    return int(kernel[0]), int(strides[0]), int(dilations[0]), int(pads[0]), int(pads[1])


def _small_conv1d(conv: Layer, kernel: Workload, relu: Workload | None = None) -> Workload:
    """``conv`` (a 1-d Conv, ``_conv1d_attrs``), and the Relu after it where ``relu`` is given,
    as ``conv1d_product`` where it is small (``SMALL_CONV_WEIGHTS``) on CUDA, in one floating
    type; else its own kernel (and the Relu's)."""
    attrs = _conv1d_attrs(conv)
    assert attrs is not None, "only 1-d Convs come here"
    k, stride, dilation, begin, end = attrs

    def workload(X: Any, W: Any, B: Any = None) -> tuple[Any, ...]:
        length = (X.shape[-1] + begin + end - dilation * (k - 1) - 1) // stride + 1 \
            if X.dim() == 3 else 0
        if not (X.is_cuda and X.dim() == 3 and W.dim() == 3 and W.shape[2] == k
                and W.shape[1] == X.shape[1] and X.is_floating_point() and W.dtype == X.dtype
                and (B is None or B.dtype == X.dtype) and W.numel() >= SMALL_CONV_WEIGHTS
                and 0 < X.shape[0] * length <= SMALL_CONV_COLUMNS):
            out = kernel(X, W, B)
            return out if relu is None else relu(out[0])
        return (conv1d_product(X, W, B, attrs, relu is not None),)

    return workload


def conv1d_product(X: Any, W: Any, B: Any, attrs: tuple[int, int, int, int, int],  # noqa: N803
                   relu: bool = False) -> Any:
    """conv1d (``attrs``: ``_conv1d_attrs``'s) [then relu] as W (C_out, C_in*k) times the
    input's windows (``windows``), the product adding the bias (for batch 1, (L, C*k) @ (C*k,
    C_out), both operands transposed views), then one copy into the (N, C_out, L) output, the
    Relu's clamp in it (clamp_min keeps NaN, as torch's relu). Inside a CUDA graph cuDNN's path
    took seven or eight kernels (pad's fill and copy, unfold's copy, a split-K product, the bias,
    the transpose, the Relu). The same sums in another order: within float rounding of cuDNN's."""
    import torch

    weight = W.reshape(W.shape[0], -1)  # (C_out, C*k)
    cols = windows(X, attrs)  # (N, C*k, L)
    if X.shape[0] > 1:
        y = torch.matmul(weight, cols)  # (N, C_out, L)
        if B is not None:
            y = y.add_(B[:, None])
        return y.clamp_min_(0) if relu else y
    product = torch.mm(cols[0].t(), weight.t()) if B is None else \
        torch.addmm(B, cols[0].t(), weight.t())  # (L, C_out)
    out = torch.empty((1, W.shape[0], cols.shape[-1]), dtype=X.dtype, device=X.device)
    if relu:
        torch.clamp_min(product.t(), 0, out=out[0])
    else:
        out[0].copy_(product.t())
    return out


IM2COL_THREADS = 256
"""im2col's CUDA kernel gives a thread to each (channel, output position) and walks the kernel's
taps in it: the VAD's front end (1 channel, 4 positions, 256 taps) took 15 us so on the H100 (4
threads). Below this many (channels x positions) the windows are a strided view copied whole."""


def windows(X: Any, attrs: tuple[int, int, int, int, int]) -> Any:  # noqa: N803
    """The (N, C*k, L) windows of ``X`` (N, C, length) for a 1-d convolution of ``attrs``,
    padding included: im2col (``F.unfold``, the padding in it) where it has threads enough
    (``IM2COL_THREADS``), else the padded input's strided view copied."""
    import torch.nn.functional as F

    k, stride, dilation, begin, end = attrs
    n, c, length = X.shape
    out = (length + begin + end - dilation * (k - 1) - 1) // stride + 1
    if c * out >= IM2COL_THREADS:
        pad = begin
        if begin != end:  # im2col pads both ends alike
            X, pad = F.pad(X, (begin, end)), 0
        return F.unfold(X.unsqueeze(2), (1, k), dilation=(1, dilation), padding=(0, pad),
                        stride=(1, stride))
    if begin or end:
        X = F.pad(X, (begin, end))
    s_n, s_c, s_l = X.stride()
    view = X.as_strided((n, c, k, out), (s_n, s_c, dilation * s_l, stride * s_l))
    return view.reshape(n, c * k, out)


def _plain_lstm(layer: Layer) -> bool:
    """Whether an LSTM's attributes are torch's cell's: forward, the default activations, no
    clip, no coupled input and forget gates, time first, no sequence_lens or peepholes."""
    attrs = layer.attrs
    acts = attrs.get("activations")
    return (attrs.get("direction", "forward") == "forward" and attrs.get("clip") is None
            and (not acts or [str(a) for a in acts] == ["Sigmoid", "Tanh", "Tanh"])
            and not int(attrs.get("input_forget", 0)) and not int(attrs.get("layout", 0))
            and not any(layer.inputs[4:5]) and not any(layer.inputs[7:8]))


ONNX_TO_TORCH_GATES = [0, 2, 3, 1]
"""torch's LSTM gates (i, f, g, o) as indices into ONNX's (i, o, f, c)."""


def _one_step_lstm(kernel: Workload, constant: bool, y_read: bool = True) -> Workload:
    """A forward LSTM (``_plain_lstm``) over one time step, on CUDA, in three kernels: the input's
    and the state's products (``mv`` for one row, where cuBLAS's gemm took split-K kernels) and
    torch's fused cell (``_thnn_fused_lstm_cell``: gates, biases, both states); Y a copy of Y_h
    where something reads it (``y_read``; each output is its own), else a view. torch.lstm_cell
    took two products and the cell, and the kernel a copy of Y. Other shapes: ``kernel``. The
    gates' weights in torch's order are made once where they are constants (``constant``)."""
    import torch

    kept: dict[str, Any] = {}

    def weights(W: Any, R: Any, B: Any) -> list[Any]:  # noqa: N803
        if kept.get("for") is not None and all(a is b for a, b in zip(kept["for"], (W, R, B))):
            return kept["made"]  # type: ignore[no-any-return]
        hidden = R.shape[-1]

        def gates(m: Any) -> Any:
            return m.reshape(4, hidden, *m.shape[1:])[ONNX_TO_TORCH_GATES].reshape(m.shape)

        made = [gates(W[0]), gates(R[0]), *((None, None) if B is None else
                                            (gates(B[0, :4 * hidden]), gates(B[0, 4 * hidden:])))]
        if constant:
            kept.update({"for": (W, R, B), "made": made})
        return made

    def workload(*values: Any) -> tuple[Any, ...]:
        X, W, R, B, _, h0, c0 = (*values, *[None] * 7)[:7]  # noqa: N806  # ONNX's order
        if not (X.is_cuda and X.dim() == 3 and X.shape[0] == 1 and W.shape[0] == 1
                and X.is_floating_point() and h0 is not None and c0 is not None
                and W.dtype == R.dtype == X.dtype == h0.dtype == c0.dtype
                and (B is None or B.dtype == X.dtype)):
            return kernel(*values)  # type: ignore[no-any-return]
        w_ih, w_hh, b_ih, b_hh = weights(W, R, B)
        x, h = X[0], h0[0]  # (batch, input), (batch, hidden)
        if x.shape[0] == 1:
            gates_x, gates_h = torch.mv(w_ih, x[0])[None], torch.mv(w_hh, h[0])[None]
        else:
            gates_x, gates_h = torch.mm(x, w_ih.t()), torch.mm(h, w_hh.t())
        hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(gates_x, gates_h, c0[0].contiguous(),
                                                         b_ih, b_hh)
        y = hy[None, None].clone() if y_read else hy[None, None]  # (1, 1, N, H)
        return y, hy[None], cy[None]  # Y_h, Y_c (1, N, H)

    return workload


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
