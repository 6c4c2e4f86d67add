"""Hard-swish written out (x * Clip(x + 3, 0, 6) / 6, as exporters at opsets below 14 write it)
where no convolution takes it as its post-op: one ``HardSwishChain`` layer, torch's hardswish,
which computes those four steps in float32 bit for bit (``patterns.hardswish_layers``), in one
pass over the tensor instead of four, and without the three intermediate tensors' allocations
(the hard-swish layout detector of the corpus has 31 such chains on 200x152 to 25x19 maps)."""

from __future__ import annotations

from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import Context, hardswish_layers
from backplane.ir.graph import Layer


def match_hardswish(add: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The chain that starts with ``add`` (x + 3), or None."""
    for x in add.inputs:
        group = hardswish_layers(x, ctx)
        if group is not None and group[0] is add:
            fused = Layer("+".join(lay.name for lay in group), "HardSwishChain", [x],
                          [group[-1].outputs[0]], {}, FUSED_DOMAIN, 1)
            return group, fused
    return None


def hardswish_workload(layer: Layer, backend: Any, inputs: Any) -> Workload:
    import torch.nn.functional as F

    def run(x: Any) -> tuple[Any]:
        return (F.hardswish(x),)

    return run
