"""A OneDnnGraph traced twice: with oneDNN's own ReLU, clamp and max pool for inputs that cannot
make NaN in it, and with the NaN-keeping spellings (``kernels.common``) for the others.

Why: oneDNN fuses ReLU, clamp and max pool as max / min against a bound, which turns NaN into the
bound, so a OneDnnGraph's trace spells ReLU as an ELU with alpha 0 (an exp per value) and leaves a
clamp's upper bound and a padded max pool to torch between its partitions. Each of those costs: a
MobileNet's ReLU6 splits every pointwise-depthwise pair that oneDNN Graph fuses into two partitions
and a clamp call, about 15 us each beyond the kernels on this 2-core AMD EPYC, and the ELU's exp is
about 0.38 ms per million values. But a subgraph of convolutions, products, pools and elementwise
layers makes NaN only from NaN, or from an infinity (Inf - Inf, 0 * Inf), and with finite inputs no
larger than a bound none of its values can overflow: each layer's largest output is bounded by its
inputs' (a convolution's by the largest sum of one output channel's absolute weights times its
input's bound, plus its bias). ``input_limit`` finds such a bound at load from the constants; at
each call ``guarded`` takes the inputs' smallest and largest values (``torch.aminmax``, one pass,
3.6 us on 1x3x32x32 at 1 thread) and runs the NaN-free compile where they are within it, the
NaN-keeping one, compiled at the first such call, where not (NaN, an infinity, a huge value).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.torch.fusion.compiled import AtFirstRun
from backplane.ir.graph import Layer

LIMITS = (1e15, 1e12, 1e9, 1e6, 1e4, 1e3)
"""The input bounds tried, largest first: ``input_limit`` takes the first under which no value of
the subgraph can exceed ``CEILING``."""
CEILING = 1e36
"""The largest magnitude a value may reach by the bound: float32's largest is 3.4e38, and the
bound is on exact arithmetic, which float32's roundings exceed by far less than 340 times."""
FUSED_VOLUME = 65536
"""The ReLU outputs (values a run) from which the NaN-free compile is taken where no clamp splits
the subgraph: the ELU it saves costs about 25 us there, the check of a small input about 4; below
it, and with no clamp's upper bound or padded max pool, the two compiles differ by less than the
check costs (resnet_basic_ts16: the same 9 partitions, one max pool outside or in)."""


def input_limit(layer: Layer, sample: Sequence[Any]) -> float | None:
    """The largest of ``LIMITS`` such that, with every input finite and within it, no value of the
    OneDnnGraph ``layer`` can overflow; None where some layer has no bound here, the subgraph is
    not float32, or the NaN-free compile would gain nothing (``_gains``)."""
    a = layer.attrs
    if a.get("compute") or a.get("source") or not all(
            str(getattr(v, "dtype", "")) == "torch.float32" for v in sample):
        return None
    layers: list[Layer] = a["layers"]
    if not _gains(layers, a.get("shapes") or []):
        return None
    constants = a["constants"]
    steps = [_transfer(lay, constants) for lay in layers]
    if any(step is None for step in steps):
        return None
    for limit in LIMITS:
        bounds = dict.fromkeys(a["inputs"], limit)
        peak = limit
        for lay, step in zip(layers, steps):
            reads = [bounds[n] if n in bounds else _const_bound(constants, n) for n in lay.inputs
                     if n]
            out, inner = step(reads)  # type: ignore[misc]
            peak = max(peak, out, inner)
            for name in lay.outputs:
                bounds[name] = out
        if peak <= CEILING:
            return limit
    return None


def guarded(fast: Callable[..., Any], limit: float, safe: Callable[[], Any]) -> Callable[..., Any]:
    """``fast`` (the NaN-free compile) where every input's values lie within +-``limit``, else the
    workload ``safe()`` makes at its first such call (the NaN-keeping compile): NaN fails the
    comparison, so it is never run on the NaN-free one. ``fast``'s attributes are the call's."""
    import torch

    aminmax = torch.aminmax
    keeping = AtFirstRun(safe, route="onednn_graph",
                         why="the NaN-keeping compile, made at its first call")

    def run(*values: Any) -> tuple[Any, ...]:
        for value in values:
            if not value.numel():
                continue  # no values, no NaN (aminmax refuses an empty tensor)
            low, high = aminmax(value)
            if not -limit <= low.item() <= high.item() <= limit:
                return keeping(*values)
        return fast(*values)

    for name in ("relayouts", "modules", "route", "profiled"):
        if hasattr(fast, name):
            setattr(run, name, getattr(fast, name))
    run.nan_free_limit, run.nan_keeping = limit, keeping  # type: ignore[attr-defined]
    return run


def _gains(layers: Sequence[Layer], shapes: Sequence[Any]) -> bool:
    """Whether the NaN-free trace differs enough to pay for the check: a clamp's upper bound (which
    splits the partitions), or ``FUSED_VOLUME`` ReLU outputs."""
    volume = 0
    for lay, entry in zip(layers, shapes):
        unary = lay.attrs.get("unary") if lay.op_type in ("FusedConv", "Linear") else None
        kind = unary[0] if unary else lay.op_type
        if kind in ("hardtanh", "Clip"):
            high = unary[1][1] if unary else _clip_high(lay)
            if high is None or math.isfinite(high):
                return True
        if kind in ("relu", "Relu"):
            shape = lay.attrs.get("output_shape") if unary else entry[1] if len(entry) > 1 else None
            volume += int(np.prod(shape)) if shape else 0
    return volume >= FUSED_VOLUME


def _clip_high(layer: Layer) -> float | None:
    """A Clip's upper bound where an attribute holds it (opset < 11), inf where none is given, None
    where an input holds it (a constant, seen by the bound's pass)."""
    if layer.opset < 11:
        return float(layer.attrs.get("max", math.inf))
    return None if len(layer.inputs) > 2 and layer.inputs[2] else math.inf


def _const_bound(constants: dict[str, Any], name: str) -> float:
    value = constants.get(name)
    if value is None:
        return math.inf  # a value the subgraph did not say: no bound
    array = np.asarray(value)
    if array.dtype.kind not in "fiub" or array.size == 0:
        return 0.0 if array.size == 0 else math.inf
    largest = float(np.abs(array.astype(np.float64)).max())
    return largest if math.isfinite(largest) else math.inf


Step = Callable[[list[float]], tuple[float, float]]
"""A layer's bound: its inputs' bounds (constants' largest magnitudes) to its outputs' bound and the
largest bound of a value it computes inside (a convolution's sum before its activation)."""


def _transfer(layer: Layer, constants: dict[str, Any]) -> Step | None:
    """``layer``'s ``Step``, or None where it has none here."""
    op, a = layer.op_type, layer.attrs
    if op in _SAME:
        return lambda b: (b[0], b[0])
    if op == "Concat":
        return lambda b: (max(b), max(b))
    if op in ("Add", "Sub"):
        return lambda b: (b[0] + b[1], b[0] + b[1])
    if op == "Mul":
        return lambda b: (b[0] * b[1], b[0] * b[1])
    if op == "Div":
        divisor = constants.get(layer.inputs[1])
        if divisor is None or not np.all(np.isfinite(divisor)) or not np.all(divisor != 0):
            return None
        smallest = float(np.abs(np.asarray(divisor, np.float64)).min())
        return lambda b: (b[0] / smallest, b[0] / smallest)
    if op in ("Sigmoid", "Tanh", "HardSigmoid", "Softmax"):
        return lambda b: (1.0, b[0])
    if op in ("Relu", "HardSwish", "HardSwishChain"):
        return lambda b: (b[0], b[0])
    if op == "LeakyRelu":
        slope = max(1.0, abs(float(a.get("alpha", 0.01))))
        return lambda b: (b[0] * slope, b[0] * slope)
    if op == "Elu":
        alpha = abs(float(a.get("alpha", 1.0)))
        return lambda b: (max(b[0], alpha), b[0])
    if op == "Clip":
        low, high = _clip_bounds(layer, constants)
        return lambda b: (_clipped(b[0], low, high), b[0])
    if op == "BatchNormalization":
        return _batch_norm(layer, constants)
    if op == "Resize":
        growth = 16.0 if a.get("mode", "nearest") == "cubic" else 1.0  # cubic taps overshoot
        extra = abs(float(a.get("extrapolation_value", 0.0)))
        return lambda b: (max(b[0] * growth, extra), b[0] * growth)
    if op == "FusedConv":
        weight = np.abs(np.asarray(a["weight"], np.float64))
        return _product(weight.reshape(weight.shape[0], -1).sum(1).max(), a["bias"], a)
    if op == "Linear":
        weight = np.abs(np.asarray(a["weight"], np.float64))
        norm = max(weight.sum(0).max(), weight.sum(1).max())  # either orientation: an upper bound
        return _product(norm, a.get("bias"), a)
    if op == "ConvTranspose" and layer.inputs[1] in constants:
        weight = np.abs(np.asarray(constants[layer.inputs[1]], np.float64))  # (in, out / g, *k)
        norm = weight.sum(axis=(0, *range(2, weight.ndim))).max()
        bias = constants.get(layer.inputs[2]) if len(layer.inputs) > 2 and layer.inputs[2] else None
        return _product(norm, bias, {})
    if op == "SqueezeExcite":
        return _squeeze_excite(a)
    return None


_SAME = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean",
                   "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Split", "Slice",
                   "Identity"})
"""Layers whose outputs are no larger than their first input (a selection, a mean or a move)."""


def _product(norm: float, bias: Any, a: dict[str, Any]) -> Step:
    """A convolution's or a product's bound: ``norm`` (the largest sum of one output's absolute
    weights) times the input's, plus the bias's largest, plus the residual's (``binary``), then
    its activation's (``unary``)."""
    extra = 0.0 if bias is None else float(np.abs(np.asarray(bias, np.float64)).max(initial=0.0))
    unary, binary = a.get("unary"), a.get("binary")

    def step(b: list[float]) -> tuple[float, float]:
        total = b[0] * norm + extra + (b[1] if binary else 0.0)
        return _unary(total, unary), total
    return step


def _unary(bound: float, unary: Any) -> float:
    """The bound after a fused activation (``patterns.post_op``): none of them grows a value but
    leaky ReLU's slope and hardtanh's bounds."""
    if not unary:
        return bound
    kind, scalars = unary[0], unary[1]
    if kind in ("sigmoid", "tanh", "hardsigmoid"):
        return 1.0
    if kind == "leaky_relu":
        return bound * max(1.0, abs(scalars[0]) if scalars else 1.0)
    if kind == "hardtanh":
        return _clipped(bound, scalars[0], scalars[1])
    return bound  # relu, hardswish, swish, gelu: |f(x)| <= |x|


def _clipped(bound: float, low: float, high: float) -> float:
    """The largest magnitude of clip(x, low, high) for |x| <= bound (clip is monotone)."""
    ends = [min(max(v, low), high) for v in (-bound, bound)]
    return max(abs(v) for v in ends)


def _clip_bounds(layer: Layer, constants: dict[str, Any]) -> tuple[float, float]:
    if layer.opset < 11:
        return float(layer.attrs.get("min", -math.inf)), float(layer.attrs.get("max", math.inf))
    values = []
    for index, default in ((1, -math.inf), (2, math.inf)):
        name = layer.inputs[index] if len(layer.inputs) > index else ""
        value = constants.get(name) if name else None
        values.append(default if not name else math.nan if value is None
                      else float(np.asarray(value).reshape(-1)[0]))
    low, high = values
    # a bound the subgraph computes: no narrowing assumed
    return (-math.inf if math.isnan(low) else low), (math.inf if math.isnan(high) else high)


def _batch_norm(layer: Layer, constants: dict[str, Any]) -> Step | None:
    params = [constants.get(n) for n in layer.inputs[1:5]]
    if any(p is None for p in params) or len(layer.outputs) > 1:
        return None
    scale, shift, mean, var = (np.asarray(p, np.float64).reshape(-1) for p in params)
    factor = np.abs(scale) / np.sqrt(var + float(layer.attrs.get("epsilon", 1e-5)))
    if not np.all(np.isfinite(factor)):
        return None

    def step(b: list[float]) -> tuple[float, float]:
        out = float((factor * (b[0] + np.abs(mean)) + np.abs(shift)).max())
        return out, out
    return step


def _squeeze_excite(a: dict[str, Any]) -> Step:
    """x times a gate in [0, 1] (sigmoid or hard sigmoid) of the channels' means through two 1x1
    convolutions: the output's bound is x's; inside, the two products'."""
    first = np.abs(np.asarray(a["w1"], np.float64)).sum(1).max()
    second = np.abs(np.asarray(a["w2"], np.float64)).sum(1).max()
    b1 = float(np.abs(np.asarray(a["b1"], np.float64)).max(initial=0.0))
    b2 = float(np.abs(np.asarray(a["b2"], np.float64)).max(initial=0.0))

    def step(b: list[float]) -> tuple[float, float]:
        hidden = _unary(b[0] * first + b1, a["act"])
        return b[0], max(b[0] * first + b1, hidden * second + b2)
    return step
