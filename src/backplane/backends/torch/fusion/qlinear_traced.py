"""A fused QLinearConv / QLinearMatMul's float route as oneDNN Graph's fuser takes it.

Why: a QOperator CNN's subgraph was no ``OneDnnGraph``: its QLinearConvs ran in a plain trace,
each convolution ATen's (at batch 1 and 1 thread, ``_slow_conv2d_forward``: im2col and a
product) and each centring and requantization three to four calls in place, which the fuser
leaves alone (resnet_qlinear_ort15: 180 torch calls a run, where its QDQ twin's OneDnnGraph makes
39). Written out of place (a division, rounding, a clamp, a product by a one-value constant, the
residual's sum and a ReLU), the requantization after a convolution is that convolution's post-ops
and the next layer's centring follows them, as a QDQ round trip's do (``quantized
._fusable_round_trip``). The same float32 operations on the same values as in place: the layers'
own outputs, bit for bit, where the convolution sums alike (oneDNN's order of the float32 products
may move a value within a few roundings of a half step by one step, as between the product
routes: ``quantized.within_steps`` checks the compile).

Only in a trace of a ``OneDnnGraph`` whose QLinear layers are on the float route for certain
(``CpuAcc.int8`` "exact", which "auto" is on a CPU whose int8 kernels saturate): with the int8
route possible the trace holds the int8 convolution (``int8_traced``), which the fuser cannot take.
A NaN in the input (quantized to 0, centred to -z) is replaced first as the round trip does,
unless the input is finite (``finite``: a QLinear layer's or a finite op's result).
"""

from __future__ import annotations

from typing import Any, Callable

from backplane.backends.torch.fusion.quantized import float32_operand as f32
from backplane.backends.torch.fusion.quantized import torch_params

Step = Callable[[Any], Any]


def when_traced(eager: Step, traced: Step | None) -> Step:
    """``traced`` while a trace records (oneDNN Graph's), else ``eager`` (in place)."""
    import torch

    if traced is None:
        return eager
    return lambda t: traced(t) if torch.jit.is_tracing() else eager(t)


def centring(a: dict[str, Any]) -> Step | None:
    """The layer's QuantizeLinear and centring (``qlinear_float._centring``) out of place, or None
    where the eager form is kept (integer input, or a QuantizeLinear on another zero point)."""
    import torch

    if a.get("takes_centred") or a["into"] is None:
        return None
    scale, zero, low, high = torch_params(a["into"])
    if zero.__class__ is not float or zero != a["x_zero"] or scale.__class__ is not float:
        return None
    step, nan = f32(scale), -zero * scale  # (-z * s) / s rounds back to -z: NaN's 0, centred
    finite = bool(a.get("finite"))

    def centre(x):
        if not finite:
            x = torch.nan_to_num(x, nan=nan, posinf=float("inf"), neginf=float("-inf"))
        return torch.clamp(torch.round(torch.div(x, step)), low - zero, high - zero)
    return centre


def finisher(a: dict[str, Any], post: Step | None, add: Any, floor: float, same: bool,
             scale: Any, zero: float) -> Step:
    """``qlinear_float._finisher``'s dequantizing form out of place: rounded, saturated, moved to
    the DequantizeLinear's zero point where it is another, times its scale, plus the constant,
    then the activation."""
    import torch

    high, y_zero = a["y_high"], a["y_zero"]
    shift = None if same else f32(float(y_zero - zero))
    step = f32(scale) if scale.__class__ is float else scale

    def finish(acc):
        y = torch.clamp(torch.round(acc), floor, high - y_zero)
        y = torch.add(y, shift) if shift is not None else y
        out = torch.mul(y, step)
        out = torch.add(out, add) if add is not None else out
        return post(out) if post else out
    return finish


def grid(low: float, high: float) -> Step:
    """rint(acc) saturated to [low, high] out of place (``qlinear_float._centred_grid``)."""
    import torch

    return lambda acc: torch.clamp(torch.round(acc), low, high)
