"""GpuAcc's LayerNorms written out (exporters below opset 17) as one LayerNormalization layer each
inside a captured subgraph (``cuda._cuda_graph_layer``).

Why: torch.onnx writes ``nn.LayerNorm`` at opsets below 17 as nine layers (ReduceMean, Sub, Pow,
ReduceMean, Add, Sqrt, Div, Mul, Add). In a CUDA graph that is two reductions and the elementwise
kernels between them (``gpu_chains`` joins the tail, but the centred value is read twice, so it is
written out), about four kernels a norm of 1-3 us each on a few hundred values; torch's
``layer_norm`` is one. The corpus GPTs at opset 15 have five such norms, the tagger fourteen.
CpuAcc's matcher (``fusion/layernorm.py``: float32, last axis, a constant epsilon inside the root,
constant Scale and B) finds them; the values are torch's layer_norm's, within a float32 ulp or two
of the chain's, as on CpuAcc.
"""

from __future__ import annotations

from typing import Any

from backplane.ir.graph import Layer, SubgraphView


def fused_layer_norms(view: SubgraphView) -> list[Layer]:
    """The view's layers in order, each written-out LayerNorm whose inner values nothing else
    reads as one LayerNormalization layer (opset 17, default domain) where its last layer was."""
    from backplane.backends.torch.fusion.layernorm import match_layer_norm
    from backplane.backends.torch.fusion.patterns import Context

    graph = view.graph
    layers = list(view.layers)
    if graph is None or not any(lay.op_type == "ReduceMean" for lay in layers):
        return layers
    ctx = Context(view, graph, graph.consumers(), {id(lay) for lay in layers})
    fused_at: dict[int, Layer] = {}  # the group's last layer -> the fused layer
    def matcher_for(layer: Layer) -> Any:
        return match_layer_norm if layer.op_type == "ReduceMean" and not layer.domain else None

    for group, fused in ctx.matches(layers, matcher_for):
        fused_at[id(group[-1])] = fused
    if not fused_at:
        return layers
    return [fused_at.get(id(lay), lay) for lay in layers
            if id(lay) not in ctx.taken or id(lay) in fused_at]
