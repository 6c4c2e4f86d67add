"""ONNX Runtime's transformer fusions written back as the plain ops they fused (issue 29: "the
optimized BERT no slower than the plain one"), for every backend.

Its transformer optimizer (``optimize_model``) packs a BERT layer's attention into one Attention
op and each residual Add + LayerNormalization into one SkipLayerNormalization; its saved models
have the second. backplane's fusions are written for the plain forms the exporters write (Q, K and
V products stacked into one ``LinearSiblings``, the heads taken as views, one ``ScaledDotAttention``
of the scores' product, scale, mask and softmax; a product's bias and residual Add as its
``Linear``'s epilogue), so on CpuAcc the fused ops ran slower than the ops they replace: the
optimized tiny BERT's trace 230 torch ops a run against the plain one's 173, 66.5 against 53.7
us a run (1 thread, thread CPU, median of 7 rounds of 300 runs, load 3-5), with
``scaled_dot_product_attention`` for the attention (which also gives no NaN for a NaN query on
torch 2.13's CPU) and the SkipLayerNormalization's bias and residual two adds of their own.

Written back (CpuRef runs the same plain ops, the values of ONNX Runtime's documentation):

- ``SkipLayerNormalization(input, skip, gamma, beta, bias)`` whose mean and inverse deviation no
  layer reads: ``Add(input, bias)``, ``Add(., skip)`` (its sum, where an output), then
  ``LayerNormalization`` over the last axis (the bias on ``skip`` where it, not ``input``, is a
  product: ONNX Runtime's saved encoders have the residual first);
- ``Attention`` (BERT's: no past, no rotary, no shared buffer; masks of no kind, each sequence's
  length (B,) or a raw 0/1 (B, T); a causal ``unidirectional`` over a static length; an
  ``attention_bias``), its present unread: the Q, K and V products (each ``MatMul`` by its slice
  of the packed weight, ``Add`` of its bias), each ``Reshape``d to its heads and ``Transpose``d
  (K to (B, n, h, T)), ``MatMul(Q, Kt)``, ``Mul`` by the scale, ``Add`` of one additive bias (the
  mask's ``mask_filter_value`` where a key is masked, made once for every Attention of that
  mask), ``Softmax``, ``MatMul`` by V, ``Transpose`` and ``Reshape`` back to (B, S, n * hv);
- ``FusedGemm`` and ``FusedConv`` (ONNX Runtime's saved product or convolution and its activation,
  a convolution's residual ``Z``): ``Gemm`` or ``Conv``, ``Add(Z)``, then the activation, which
  CpuAcc's Linear and convolution fusions take as the plain model's (the saved tiny BERT's pooler
  ran as a product of its own, then its Tanh).

Anything else (past keys, rotary, 3-D and (2B,) masks, float16, an opset below 13) is left as it
is, for the backends' own kernels.
"""

from __future__ import annotations

import math

import numpy as np

from backplane.ir.graph import Graph, Layer, TensorInfo

MS = "com.microsoft"
F32 = np.dtype(np.float32)
MIN_OPSET = 13  # the plain ops written here in their forms from opset 13 (Softmax's last axis)
LOWERED = frozenset({"SkipLayerNormalization", "Attention", "FusedGemm", "FusedConv"})
"""The com.microsoft ops ``lower`` writes as plain ops where it can."""


class _Writer:
    """New layers, tensors and constants of ``graph``, each name one nothing else has."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.opset = graph.opsets.get("", 0) or 17
        self.taken = {layer.name for layer in graph.layers}
        self.layers: list[Layer] = []  # the current layer's replacement
        self.replacing = ""

    def fresh(self, name: str) -> str:
        unique, k = name, 1
        graph = self.graph
        while unique in graph.tensors or unique in graph.constants or unique in self.taken:
            unique, k = f"{name}_{k}", k + 1
        self.taken.add(unique)
        return unique

    def constant(self, name: str, value: np.ndarray) -> str:
        name = self.fresh(name)
        self.graph.constants[name] = value
        self.graph.tensors[name] = TensorInfo(value.shape, value.dtype)
        return name

    def op(self, name: str, op_type: str, inputs: list[str], info: TensorInfo,
           out: str | None = None, **attrs: object) -> str:
        """A default-domain layer of one output (``out``, else a fresh name) of ``info``, named
        ``name`` (a fresh name from it; the layer it replaces keeps its own: ``replacing``)."""
        out = out or self.fresh(f"{name}_output")
        self.graph.tensors[out] = info
        name = name if name == self.replacing else self.fresh(name)
        self.layers.append(Layer(name, op_type, inputs, [out], dict(attrs), "", self.opset))
        return out


def lower(graph: Graph) -> Graph:
    """Every SkipLayerNormalization, Attention, FusedGemm and FusedConv of ``graph`` that can be,
    as the plain ops above (in place); returns ``graph``."""
    if (graph.opsets.get("", 0) or 17) < MIN_OPSET:
        return graph
    consumers = graph.consumers()
    read = set(consumers) | set(graph.outputs)
    masks: dict[tuple, str] = {}  # one score bias per mask (and causal flag, attention bias)
    layers: list[Layer] = []
    replaced: set[str] = set()  # what the replaced layers read
    writer = _Writer(graph)
    for layer in graph.layers:
        writer.layers, writer.replacing, done = [], layer.name, False
        if layer.domain == MS and layer.op_type == "SkipLayerNormalization":
            done = _skip_layer_norm(layer, writer, read)
        elif layer.domain == MS and layer.op_type == "Attention":
            done = _attention(layer, writer, read, masks)
        elif layer.domain == MS and layer.op_type in ("FusedGemm", "FusedConv"):
            done = _unfused(layer, writer)
        layers += writer.layers if done else [layer]
        replaced |= set(layer.inputs) if done else set()
    if replaced:
        graph.layers = layers
        still = {name for layer in layers for name in layer.inputs} | set(graph.outputs)
        for name in replaced - still:  # an Attention's packed weights: its slices now
            graph.constants.pop(name, None)
    return graph


# -- SkipLayerNormalization ---------------------------------------------------------------------
def _skip_layer_norm(layer: Layer, w: _Writer, read: set[str]) -> bool:
    graph, outs = w.graph, layer.outputs
    if any(name and name in read for name in outs[1:3]):
        return False  # its mean or inverse deviation read: the op computes them
    x, skip, gamma = layer.inputs[:3]
    beta = layer.inputs[3] if len(layer.inputs) > 3 else ""
    bias = layer.inputs[4] if len(layer.inputs) > 4 else ""
    info = graph.info(outs[0])
    if info.dtype != F32 or info.shape is None or graph.info(x).shape != info.shape:
        return False
    if _product(skip, graph) and not _product(x, graph) and graph.info(skip).shape == info.shape:
        x, skip = skip, x  # the bias on the product (a Linear's), the other the residual
    total = x
    if bias:
        total = w.op(f"{layer.name}/bias", "Add", [x, bias], info)
    wanted = outs[3] if len(outs) > 3 and outs[3] else None
    total = w.op(f"{layer.name}/skip", "Add", [total, skip], info, out=wanted)
    norm_inputs = [total, gamma] + ([beta] if beta else [])
    w.op(layer.name, "LayerNormalization", norm_inputs, info, out=outs[0], axis=-1,
         epsilon=float(layer.attrs.get("epsilon", 1e-12)))
    return True


def _product(name: str, graph: Graph) -> bool:
    """Whether a product (that a Linear may take the bias of) makes ``name``."""
    made = next((layer for layer in graph.layers if name in layer.outputs), None)
    return made is not None and made.op_type in ("MatMul", "Gemm", "FusedMatMul", "FusedGemm")


# -- Attention ----------------------------------------------------------------------------------
def _attention(layer: Layer, w: _Writer, read: set[str], masks: dict[tuple, str]) -> bool:
    graph, a = w.graph, layer.attrs
    ins = list(layer.inputs) + [""] * (7 - len(layer.inputs))
    x, weights, bias, mask, past, attention_bias, past_length = ins[:7]
    if past or past_length or a.get("do_rotary", 0) or a.get("past_present_share_buffer", 0) \
            or (len(layer.outputs) > 1 and layer.outputs[1] in read):
        return False
    info, packed = graph.info(x), graph.constants.get(weights)
    b = graph.constants.get(bias) if bias else None
    if info.dtype != F32 or info.shape is None or len(info.shape) != 3 or packed is None \
            or packed.dtype != F32 or packed.ndim != 2 or (bias and b is None):
        return False
    heads = int(a["num_heads"])
    sizes = [int(s) for s in a.get("qkv_hidden_sizes") or [packed.shape[1] // 3] * 3]
    if sum(sizes) != packed.shape[1] or sizes[0] != sizes[1] or any(s % heads for s in sizes):
        return False
    score_bias = _score_bias(layer, w, mask, attention_bias, masks)
    if score_bias is None:
        return False
    batch, seq = (d if isinstance(d, int) else 0 for d in info.shape[:2])  # 0: Reshape copies it
    parts, start = [], 0
    for role, size in zip("qkv", sizes):
        parts.append(_projection(layer, w, x, packed[:, start:start + size],
                                 None if b is None else b[start:start + size], role, heads,
                                 (batch, seq)))
        start += size
    q, kt, v = parts
    scale = a.get("scale")
    scale = 1 / math.sqrt(sizes[0] // heads) if scale is None else float(scale)
    shape = info.shape
    scores_info = TensorInfo((shape[0], heads, shape[1], shape[1]), F32)
    scores = w.op(f"{layer.name}/scores", "MatMul", [q, kt], scores_info)
    scores = w.op(f"{layer.name}/scale", "Mul",
                  [scores, w.constant(f"{layer.name}/scale", np.array(scale, F32))], scores_info)
    if score_bias:
        scores = w.op(f"{layer.name}/mask", "Add", [scores, score_bias], scores_info)
    probs = w.op(f"{layer.name}/softmax", "Softmax", [scores], scores_info, axis=-1)
    head_v = sizes[2] // heads
    out = w.op(f"{layer.name}/context", "MatMul", [probs, v],
               TensorInfo((shape[0], heads, shape[1], head_v), F32))
    out = w.op(f"{layer.name}/merge", "Transpose", [out],
               TensorInfo((shape[0], shape[1], heads, head_v), F32), perm=[0, 2, 1, 3])
    w.op(layer.name, "Reshape",
         [out, w.constant(f"{layer.name}/out_shape", np.array([batch, seq, sizes[2]], np.int64))],
         graph.info(layer.outputs[0]), out=layer.outputs[0])
    return True


def _projection(layer: Layer, w: _Writer, x: str, weight: np.ndarray, bias: np.ndarray | None,
                role: str, heads: int, leading: tuple[int, int]) -> str:
    """x times its slice of the packed weight, its bias added, as heads: (B, n, S, h) for Q and
    V, (B, n, h, S) for K."""
    shape = w.graph.info(x).shape
    size = weight.shape[1]
    flat = TensorInfo((*shape[:2], size), F32)
    name = f"{layer.name}/{role}"
    y = w.op(name, "MatMul", [x, w.constant(f"{name}/weight", np.ascontiguousarray(weight))],
             flat)
    if bias is not None:
        y = w.op(f"{name}/bias", "Add",
                 [y, w.constant(f"{name}/bias", np.ascontiguousarray(bias, F32))], flat)
    split = np.array([*leading, heads, size // heads], np.int64)
    y = w.op(f"{name}/heads", "Reshape", [y, w.constant(f"{name}/heads", split)],
             TensorInfo((*shape[:2], heads, size // heads), F32))
    perm = [0, 2, 3, 1] if role == "k" else [0, 2, 1, 3]
    return w.op(f"{name}/transpose", "Transpose", [y],
                TensorInfo(tuple(((*shape[:2], heads, size // heads))[p] for p in perm), F32),
                perm=perm)


def _score_bias(layer: Layer, w: _Writer, mask: str, attention_bias: str,
                masks: dict[tuple, str]) -> str | None:
    """The name of the one additive bias of the scores ("" where nothing is masked), made once
    per mask; None where a mask is of a kind not written here."""
    graph, a = w.graph, layer.attrs
    shape = graph.info(layer.inputs[0]).shape
    fill = float(a.get("mask_filter_value", -10000.0))
    causal = bool(a.get("unidirectional", 0))
    key = (mask, fill, causal, attention_bias)
    if key in masks:
        return masks[key]
    seq = shape[1]
    if causal and not isinstance(seq, int):
        return None
    bias = ""
    if mask:
        bias = _mask_bias(layer, w, mask, fill)
        if bias is None:
            return None
    if causal:  # query i sees keys up to its own (no past: the same length)
        later = np.triu(np.ones((seq, seq), bool), 1)
        constant = w.constant(f"{layer.name}/causal", np.where(later, F32.type(fill), F32.type(0)))
        bias = constant if not bias else w.op(f"{layer.name}/causal", "Add", [bias, constant],
                                              TensorInfo((shape[0], 1, seq, seq), F32))
    if attention_bias:
        bias = attention_bias if not bias else w.op(
            f"{layer.name}/attention_bias", "Add", [bias, attention_bias],
            TensorInfo(None, F32))
    masks[key] = bias
    return bias


def _mask_bias(layer: Layer, w: _Writer, mask: str, fill: float) -> str | None:
    """(B, 1, 1, T): 0 where a key is kept, ``fill`` where masked, from each sequence's length
    (B,) (keys from it on masked) or a raw (B, T) mask (0 masked); None for the other kinds."""
    graph = w.graph
    shape, info = graph.info(layer.inputs[0]).shape, graph.info(mask)
    if info.shape is None or info.dtype is None or info.dtype.kind not in "iu":
        return None
    batch, seq = shape[0], shape[1]
    if len(info.shape) not in (1, 2) or len(info.shape) == 1 and (  # lengths (B,), not (2B,)
            not isinstance(seq, int) or info.shape[0] != batch):
        return None
    name = f"{layer.name}/mask"
    values = [w.constant(f"{name}/kept", np.array(0, F32)),
              w.constant(f"{name}/fill", np.array(fill, F32))]
    bias_info = TensorInfo((batch, 1, 1, seq), F32)
    if len(info.shape) == 1:
        lengths = w.op(f"{name}/lengths", "Reshape",
                       [mask, w.constant(f"{name}/lengths", np.array([-1, 1, 1, 1], np.int64))],
                       TensorInfo((batch, 1, 1, 1), info.dtype))
        positions = w.constant(f"{name}/positions",
                               np.arange(seq, dtype=info.dtype).reshape(1, 1, 1, seq))
        keep = w.op(f"{name}/keep", "Less", [positions, lengths],
                    TensorInfo((batch, 1, 1, seq), np.dtype(bool)))
        return w.op(f"{name}/bias", "Where", [keep, *values], bias_info)
    keep = w.op(f"{name}/keep", "Greater",
                [mask, w.constant(f"{name}/zero", np.array(0, info.dtype))],
                TensorInfo(info.shape, np.dtype(bool)))
    bias = w.op(f"{name}/bias", "Where", [keep, *values], TensorInfo(info.shape, F32))
    return w.op(f"{name}/heads", "Reshape",
                [bias, w.constant(f"{name}/heads", np.array([0, 1, 1, -1], np.int64))],
                bias_info)


# -- FusedGemm, FusedConv ---------------------------------------------------------------------
ACTIVATIONS = {"Relu": (), "Tanh": (), "Sigmoid": (), "LeakyRelu": ("alpha",),
               "HardSigmoid": ("alpha", "beta"), "Clip": ()}
"""ONNX Runtime's activations of its fused products and convolutions -> the attributes their
parameters are, in order (Clip's two are its min and max inputs)."""


def _unfused(layer: Layer, w: _Writer) -> bool:
    """FusedGemm as Gemm then its activation; FusedConv as Conv, Add(Z), then its activation:
    CpuAcc's Linear and convolution fusions take the activation (and the residual) as the plain
    model's (the fused op was a product or convolution of its own, then the activation)."""
    a, graph = layer.attrs, w.graph
    activation = a.get("activation", "")
    info = graph.info(layer.outputs[0])
    if activation and activation not in ACTIVATIONS or info.dtype != F32:
        return False
    if layer.op_type == "FusedGemm":
        params = [a[k] for k in ("activation_alpha", "activation_beta", "activation_gamma")
                  if a.get(k) is not None]
        attrs = {k: a[k] for k in ("alpha", "beta", "transA", "transB") if k in a}
        ins = list(layer.inputs[:3])
        op, name = "Gemm", f"{layer.name}/gemm"
    else:
        params = list(a.get("activation_params") or ())
        attrs = {k: a[k] for k in ("auto_pad", "dilations", "group", "kernel_shape", "pads",
                                   "strides") if a.get(k) is not None}
        ins, op, name = list(layer.inputs[:3]), "Conv", f"{layer.name}/conv"
    while ins and not ins[-1]:
        ins.pop()
    residual = layer.inputs[3] if layer.op_type == "FusedConv" and len(layer.inputs) > 3 else ""
    last = not activation and not residual
    y = w.op(layer.name if last else name, op, ins, info,
             out=layer.outputs[0] if last else None, **attrs)
    if residual:
        y = w.op(layer.name if not activation else f"{layer.name}/residual", "Add", [y, residual],
                 info, out=None if activation else layer.outputs[0])
    if activation:
        _activation(layer, w, activation, params, y, info)
    return True


def _activation(layer: Layer, w: _Writer, activation: str, params: list, x: str,
                info: TensorInfo) -> None:
    if activation == "Clip":
        bounds = [w.constant(f"{layer.name}/{bound}", np.array(value, F32))
                  for bound, value in zip(("min", "max"), params)]
        w.op(layer.name, "Clip", [x, *bounds], info, out=layer.outputs[0])
        return
    attrs = {key: float(value) for key, value in zip(ACTIVATIONS[activation], params)}
    w.op(layer.name, activation, [x], info, out=layer.outputs[0], **attrs)
