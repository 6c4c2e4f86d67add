"""CpuAcc's ``optimize_subgraph``: fuse what oneDNN runs fused, with weights prepacked at load.

Patterns (each intermediate tensor read by the next layer only, all layers in the subgraph):

- A small 1-d Conv of a transposed (N, L, C) tensor, with its siblings of the same windows:
  one ``WindowedConv``, the product of the windows (``windowed``).
- Conv [-> BatchNormalization] [-> Add(residual)] [-> activation | -> x * Sigmoid(x)]
  becomes one ``FusedConv`` on channels-last activations, the batch norm folded into its weights.
  At load the fastest on its shape is measured and kept (``CpuAcc.conv_route`` forces one): oneDNN's
  convolution with the residual as a binary and the activation as a unary post-op and the weights
  reordered once (``torch.ops.mkldnn._convolution_pointwise``), torch's ``conv2d`` followed by
  the post-ops (cheaper per call on tiny convolutions), or, for a 1x1 convolution, MKL's matrix
  product on the channels-last pixels ("gemm").
- Gemm (constant B, C) or MatMul (constant 2-D B) [-> Add(constant bias)] [-> Reshape]
  [-> activation | -> GELU written out (with Erf, or the tanh form) | -> Add(residual)]
  becomes one ``Linear`` (plain ones of one input: one ``LinearSiblings``, ``siblings``): at load
  the faster of MKL (``F.linear``) and oneDNN
  (``torch.ops.mkldnn._linear_pointwise`` with a prepacked weight, the activation as a unary and the
  residual as a binary post-op) on its static shape is measured and kept (``CpuAcc.linear_route``
  forces one).
- GlobalAveragePool -> 1x1 Conv -> activation -> 1x1 Conv -> Sigmoid / HardSigmoid -> Mul
  (squeeze-and-excitation) becomes one ``SqueezeExcite``: two matrix-vector products on the pooled
  channels instead of two convolutions on a 1x1 image.

- Quantized patterns (``quantized``, ``qlinear``, ``int8``): QuantizeLinear -> DequantizeLinear
  as one ``QuantDequant`` (also after a FusedConv or Linear, holding it); [Q ->] QLinearConv /
  QLinearMatMul [-> DQ ...] as one layer computing exact integer products in float32;
  DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul [-> Add] as one ``DynamicQuantMatMul``
  (several such branches of one DynamicQuantizeLinear as one, ``dynamic_quant``);
  ONNX Runtime's QGemm and DynamicQuantizeMatMul by constant weights (``contrib_quant``);
  elementwise layers of one 8-bit tensor (a QOperator hard-swish, QLinearSigmoid) as one
  ``Lookup``, a table of its 256 values (``lookup``); large QDQ convolutions as QLinearConvs
  passing 8-bit integers from one to the next (``qdq_chain``).
- GELU written out with Erf where no Linear takes it (dynamo's erf form, after a convolution or
  a norm): one ``GeluChain``, torch's GELU, where this CPU's keeps +Inf unmended (``gelu``).
- A group norm as exporters write it, Reshape -> InstanceNormalization -> Reshape [-> Mul]
  [-> Add]: one ``GroupNorm``, torch's group_norm and one addcmul (``group_norm``).
- Mul, Add, Sub and Div of one tensor by constants, three or more in a row where no other
  pattern starts: one ``AffineChain``, x * a + b in one addcmul (``affine_chain``).
- Stacked forward GRU layers, GRU -> Squeeze -> GRU ...: one ``GruStack``, every layer's step at
  once by wavefronts, or one native op (``recurrent_stack``).
- Stacked LSTM layers, LSTM -> Transpose -> Reshape -> LSTM ... [-> Transpose -> Reshape]: one
  ``LstmStack``, one native op of a C call a layer, or CpuAcc's LSTM a layer (``recurrent_stack``).
- Hard-swish written out, x * Clip(x + 3, 0, 6) / 6: a convolution's post-op where one makes x,
  else one ``HardSwishChain`` (``hardswish``); torch's hardswish gives the four layers' values bit
  for bit.
- ONNX Runtime's transformer fusions as the plain ops they replace (``ort_fused``): a Linear
  takes a FastGelu / BiasGelu / Gelu after it as a post-op; a FusedMatMul by a constant is a
  Linear; a SkipLayerNormalization computes no statistics no layer reads.
- Attention written out, MatMul(Q, Kt) [-> Mul / Div by a scalar] [-> Add(mask) | Where(condition,
  fill)] -> Softmax -> MatMul(V), becomes one ``ScaledDotAttention`` on torch's
  scaled_dot_product_attention (``attention``).

Then a subgraph with convolutions becomes one ``OneDnnGraph`` layer (``onednn_graph``): at load it
is compiled by oneDNN Graph, or runs layer by layer, whichever measures faster. With
``CpuAcc.precision`` "bf16" it computes float32 in bfloat16, and every other subgraph becomes one
``Reduced`` layer (``reduced``): its layers, fused as above, computing float32 in bfloat16.

One module per pattern (``conv``, ``linear``, ``squeeze_excite``, ``quantized``, ``qlinear``,
``dynamic_quant``, ``contrib_quant``, ``int8``); ``patterns`` holds what they share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.torch.fusion import onednn_graph, qdq_chain, qlinear_handoff
from backplane.backends.torch.fusion import reduced as reduced_precision
from backplane.backends.torch.fusion.affine_chain import affine_workload, with_affine
from backplane.backends.torch.fusion.attention import attention_workload, match_attention
from backplane.backends.torch.fusion.contrib_quant import (
    match_dynamic_quantize_matmul,
    match_mat_mul_n_bits,
    match_qgemm,
    qgemm_workload,
)
from backplane.backends.torch.fusion.conv import conv_workload, match_conv
from backplane.backends.torch.fusion.host_chain import host_chain_workload
from backplane.backends.torch.fusion.gelu import gelu_workload, or_else
from backplane.backends.torch.fusion.group_norm import group_norm_workload, match_group_norm
from backplane.backends.torch.fusion.hardswish import hardswish_workload, match_hardswish
from backplane.backends.torch.fusion.int8_native import native_int8_workload
from backplane.backends.torch.fusion.layernorm import match_layer_norm
from backplane.backends.torch.fusion.linear import linear_workload, match_linear
from backplane.backends.torch.fusion.lookup import lookup_workload, match_lookup
from backplane.backends.torch.fusion.ort_fused import (
    match_fused_matmul,
    match_skip_layer_norm,
    with_ort_gelu,
)
from backplane.backends.torch.fusion.patterns import Context
from backplane.backends.torch.fusion.dynamic_quant import (
    dynamic_matmul_workload,
    match_dynamic_matmul,
)
from backplane.backends.torch.fusion.qdq_chain import match_qdq_conv
from backplane.backends.torch.fusion.recurrent_stack import (
    gru_stack_workload,
    lstm_stack_workload,
    match_gru_stack,
    match_lstm_stack,
)
from backplane.backends.torch.fusion.siblings import linear_siblings_workload, match_sibling_linears
from backplane.backends.torch.fusion.qlinear import (
    match_qlinear_conv,
    match_qlinear_matmul,
    qlinear_workload,
)
from backplane.backends.torch.fusion.qlinear_float import quantize_centred_workload
from backplane.backends.torch.fusion.quantized import (
    finite_hard_sigmoid_workload,
    match_quant_dequant,
    quant_dequant_workload,
    then_quant_dequant,
)
from backplane.backends.torch.fusion.squeeze_excite import (
    match_squeeze_excite,
    squeeze_excite_workload,
)
from backplane.backends.torch.fusion.windowed import match_windowed_conv, windowed_conv_workload
from backplane.ir.graph import Layer, SubgraphView


def fuse(view: SubgraphView, reduced: str | None = None,
         int8: str = "auto", native: str = "off") -> OptimizationViews:
    """The view's patterns fused; then the whole view as one OneDnnGraph where it can be, else,
    computing in ``reduced`` (``CpuAcc.precision``), as one Reduced layer. Large QDQ convolutions
    are chained in integers (``qdq_chain``) unless ``int8`` (``CpuAcc.int8``) is "exact";
    ``native`` is ``CpuAcc.native`` (``traced._alone``)."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    ctx = Context(view, graph, graph.consumers(), set(map(id, view.layers)), native=native)
    views = OptimizationViews()
    matchers = MATCHERS if int8 == "exact" or reduced is not None else INT8_MATCHERS

    def matcher_for(layer: Layer) -> Any:
        key = f"{layer.domain}::{layer.op_type}" if layer.domain else layer.op_type
        return matchers.get(key, None if layer.domain else match_linear)

    for group, fused in ctx.matches(view.layers, matcher_for):
        views.substitutions.append(Substitution(SubgraphView.of(graph, group), [fused]))
    views.substitutions = qdq_chain.without_unread(views.substitutions, ctx)
    qlinear_handoff.centred_handoffs(views.substitutions, ctx, int8)
    rest = [layer for layer in view.layers if id(layer) not in ctx.taken]
    ordered = _in_order(view.layers, views.substitutions)
    whole = onednn_graph.wrap(view, graph, ordered, reduced, int8)
    if whole is None and reduced is not None:
        whole = reduced_precision.wrap(view, graph, ordered, reduced)
    if whole is not None:
        return OptimizationViews(substitutions=[Substitution(view, [whole])])
    if rest:
        views.untouched.append(SubgraphView.of(graph, rest))
    return views


def _in_order(layers: list[Layer], substitutions: list[Substitution]) -> list[Layer]:
    """The subgraph after fusion, in order: each fused layer where its group's output was made (that
    layer reads, through the group, everything the group reads; only later layers read its output)."""
    fused_at: dict[int, list[Layer]] = {}
    for sub in substitutions:
        made = {out: lay for lay in sub.substitutable.layers for out in lay.outputs if out}
        last = made[sub.replacement[-1].outputs[0]]
        for new in sub.replacement:  # several (qdq_chain's merged groups): each at its own
            fused_at.setdefault(id(made.get(new.outputs[0], last)), []).append(new)
    taken = {id(layer) for sub in substitutions for layer in sub.substitutable.layers}
    ordered: list[Layer] = []
    for layer in layers:
        if id(layer) in fused_at:
            ordered += fused_at[id(layer)]
        elif id(layer) not in taken:
            ordered.append(layer)
    return ordered


MATCHERS: dict[str, Callable[[Layer, Context], tuple[list[Layer], Layer] | None]] = {
    "Conv": qdq_chain.first_of(match_windowed_conv, then_quant_dequant(match_conv)),
    "GlobalAveragePool": match_squeeze_excite,
    "Gemm": then_quant_dequant(with_ort_gelu(match_linear)),
    "MatMul": qdq_chain.first_of(match_sibling_linears,
                                 then_quant_dequant(with_ort_gelu(match_linear))),
    "QuantizeLinear": match_quant_dequant, "QLinearConv": match_qlinear_conv,
    "QLinearMatMul": match_qlinear_matmul, "DynamicQuantizeLinear": match_dynamic_matmul,
    "com.microsoft::QGemm": match_qgemm,
    "com.microsoft::DynamicQuantizeMatMul": match_dynamic_quantize_matmul,
    "com.microsoft::MatMulNBits": match_mat_mul_n_bits,
    "Div": or_else(match_linear), "Mul": or_else(match_linear),
    "Add": match_hardswish, "ReduceMean": match_layer_norm,
    "Reshape": qdq_chain.first_of(match_group_norm, match_linear), "DequantizeLinear": match_lookup,
    "com.microsoft::QLinearSigmoid": match_lookup, "com.microsoft::QLinearLeakyRelu": match_lookup,
    "Softmax": match_attention, "com.microsoft::SkipLayerNormalization": match_skip_layer_norm,
    "com.microsoft::FusedMatMul": then_quant_dequant(with_ort_gelu(match_fused_matmul)),
    "GRU": match_gru_stack, "LSTM": match_lstm_stack}
"""The first layer of a pattern ("domain::op" outside the default domain) -> its matcher (any
other layer of the default domain may start a Linear)."""
MATCHERS = with_affine(MATCHERS, match_linear)
INT8_MATCHERS = {**MATCHERS, "Conv": qdq_chain.first_of(match_qdq_conv, MATCHERS["Conv"]),
                 "QuantizeLinear": qdq_chain.unless_chained(match_quant_dequant)}
"""``MATCHERS`` with large QDQ convolutions chained in integers (not with ``CpuAcc.int8`` exact)."""


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "FusedConv": conv_workload, "Linear": linear_workload, "SqueezeExcite": squeeze_excite_workload,
    "LinearSiblings": linear_siblings_workload,
    "OneDnnGraph": onednn_graph.onednn_graph_workload,
    "Reduced": reduced_precision.reduced_workload,
    "QuantDequant": quant_dequant_workload, "QLinearConv": qlinear_workload,
    "QLinearMatMul": qlinear_workload, "DynamicQuantMatMul": dynamic_matmul_workload,
    "QuantizeCentred": quantize_centred_workload,
    "QGemm": qgemm_workload, "HardSwishChain": hardswish_workload, "GeluChain": gelu_workload,
    "Lookup": lookup_workload,
    "FiniteHardSigmoid": finite_hard_sigmoid_workload,
    "ScaledDotAttention": attention_workload, "HostChain": host_chain_workload,
    "WindowedConv": windowed_conv_workload, "GroupNorm": group_norm_workload,
    "AffineChain": affine_workload, "GruStack": gru_stack_workload,
    "LstmStack": lstm_stack_workload,
    "NativeInt8": native_int8_workload}
