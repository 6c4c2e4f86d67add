"""What the matchers share: the subgraph context, activations as oneDNN post-ops (and their torch
equivalents), scalar-operand checks, and timing a route at load."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane import progress
from backplane.ir.graph import Graph, Layer, SubgraphView

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)


@functools.lru_cache(maxsize=1)
def half_in_float() -> bool:
    """Whether a float16 subgraph computes in float32 on this CPU (``traced.native_half``
    false: no float16 arithmetic), so that the Linear and attention patterns may take float16
    layers: their fused layers compute in float32 (``compute``), as the trace around them does."""
    from backplane.backends.torch.fusion.traced import native_half

    return not native_half()


PostOp = tuple[str, list[float], "str | None"]  # oneDNN's unary attr, its scalars, its algorithm


@dataclass
class Context:
    """What the matchers need: constants, consumers, and which layers are still free to fuse."""

    view: SubgraphView
    graph: Graph
    consumers: dict[str, list[Layer]]
    inside: set[int]
    taken: set[int] = field(default_factory=set)
    native: str = "off"
    """``CpuAcc.native`` ("auto" or "off": ``traced._alone``)."""

    def const(self, name: str) -> np.ndarray | None:
        return self.graph.constants.get(name) if name else None

    def matches(self, layers: list[Layer], matcher_for: Callable[[Layer], Any]) -> Any:
        """Each (group, fused layer) a matcher finds from a free layer, in order; a group's layers
        are taken at once, so a later layer of it starts no match of its own."""
        for layer in layers:
            matcher = None if id(layer) in self.taken else matcher_for(layer)
            found = None if matcher is None else matcher(layer, self)
            if found is not None:
                self.taken.update(map(id, found[0]))
                yield found

    def sole(self, name: str) -> Layer | None:
        """The one free layer of the subgraph that reads ``name``, if nothing else reads it."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or name in self.graph.outputs:
            return None
        user = users[0]
        return user if id(user) in self.inside and id(user) not in self.taken else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self.graph.info(name)
        return tuple(info.shape) if info.is_static and info.dtype == F32 else None  # type: ignore

    def floating(self, dtype: Any) -> bool:
        """float32, or float16 where it is computed in float32 (``half_in_float``)."""
        return dtype == F32 or (dtype == F16 and half_in_float())

    def float_shape(self, name: str) -> tuple[int, ...] | None:
        """``shape``, of a float16 tensor too where float16 is computed in float32."""
        info = self.graph.info(name)
        return tuple(info.shape) if info.is_static and self.floating(info.dtype) else None  # type: ignore


def post_op(layer: Layer, ctx: Context) -> PostOp | None:
    """The oneDNN eltwise post-op a layer is, or None."""
    op, attrs = layer.op_type, layer.attrs
    if layer.domain or op not in _SIMPLE and op not in ("LeakyRelu", "HardSigmoid", "Gelu", "Clip"):
        return None
    if op in _SIMPLE:
        return (_SIMPLE[op], [], None)
    if op == "LeakyRelu":
        return ("leaky_relu", [float(attrs.get("alpha", 0.01))], None)
    if op == "HardSigmoid":  # torch's hardsigmoid is ONNX's with alpha 1/6, beta 1/2
        alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
        return ("hardsigmoid", [], None) if math.isclose(alpha, 1 / 6, rel_tol=1e-6) and beta == 0.5 \
            else None
    if op == "Gelu":
        return ("gelu", [], attrs.get("approximate", "none"))
    bounds = _clip_bounds(layer, ctx)
    return ("hardtanh", list(bounds), None) if bounds else None


_SIMPLE = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hardswish"}


def _clip_bounds(layer: Layer, ctx: Context) -> tuple[float, float] | None:
    if layer.opset < 11:
        return float(layer.attrs.get("min", -np.inf)), float(layer.attrs.get("max", np.inf))
    values = []
    for index, default in ((1, -np.inf), (2, np.inf)):
        name = layer.inputs[index] if len(layer.inputs) > index else ""
        if name and ctx.const(name) is None:
            return None
        values.append(float(ctx.const(name).reshape(-1)[0]) if name else default)  # type: ignore
    return values[0], values[1]


def swish_layers(out: str, ctx: Context) -> list[Layer] | None:
    """x * Sigmoid(x), read from ``out``: the two layers, or None."""
    users = ctx.consumers.get(out, [])
    if len(users) != 2 or out in ctx.graph.outputs:
        return None
    sigmoid = next((u for u in users if u.op_type == "Sigmoid" and not u.domain), None)
    mul = next((u for u in users if u.op_type == "Mul" and not u.domain), None)
    if sigmoid is None or mul is None or ctx.sole(sigmoid.outputs[0]) is not mul:
        return None
    if any(id(u) not in ctx.inside or id(u) in ctx.taken for u in users):
        return None
    return [sigmoid, mul]


def hardswish_layers(out: str, ctx: Context) -> list[Layer] | None:
    """x * Clip(x + 3, 0, 6) / 6, read from ``out`` (hard-swish as exporters at opsets below 14
    write it): the Add, Clip, Mul and Div, or None. torch's hardswish computes these very steps
    in float32 (x + 3, clamped, times x, over 6), so it gives the four layers' values bit for bit,
    NaN and infinities included (checked on 2 million values, with 1 and 2 threads)."""
    users = ctx.consumers.get(out, [])
    if len(users) != 2 or out in ctx.graph.outputs:
        return None
    add = next((u for u in users if scalar_op(u, out, ctx, "Add", 3.0)), None)
    mul = next((u for u in users if u.op_type == "Mul" and not u.domain and u is not add), None)
    clip = ctx.sole(add.outputs[0]) if add is not None else None
    if mul is None or clip is None or clip.op_type != "Clip" or clip.domain \
            or _clip_bounds(clip, ctx) != (0.0, 6.0) or ctx.sole(clip.outputs[0]) is not mul \
            or sorted(mul.inputs) != sorted([out, clip.outputs[0]]):
        return None
    div = ctx.sole(mul.outputs[0])
    if div is None or not scalar_op(div, mul.outputs[0], ctx, "Div", 6.0) \
            or _value(div.inputs[1], ctx) != 6.0 or _value(add.inputs[1 - add.inputs.index(out)],
                                                            ctx) != 3.0:
        return None
    group = [add, clip, mul, div]
    if any(id(u) not in ctx.inside or id(u) in ctx.taken for u in group):
        return None
    return group


def _value(name: str, ctx: Context) -> float | None:
    """A one-element float32 constant's value, exactly (``scalar_op`` compares within 1e-6)."""
    constant = ctx.const(name)
    if constant is None or constant.size != 1 or constant.dtype != np.float32:
        return None
    return float(constant.reshape(-1)[0])


def scalar_op(layer: Layer, operand: str, ctx: Context, op: str, value: float) -> bool:
    """Whether ``layer`` is ``operand <op> value`` (or ``value <op> operand`` for Add and Mul)."""
    if layer.op_type != op or layer.domain or len(layer.inputs) != 2 or operand not in layer.inputs:
        return False
    index = layer.inputs.index(operand)
    if op in ("Div", "Pow") and index != 0:
        return False
    constant = ctx.const(layer.inputs[1 - index])
    tolerance = 1e-3 if constant is not None and constant.dtype == F16 else 1e-6  # its rounding
    return constant is not None and constant.size == 1 and math.isclose(
        float(constant.reshape(-1)[0]), value, rel_tol=tolerance)


def torch_post_op(unary: PostOp | None) -> Callable[[Any], Any] | None:
    """The post-op as torch calls, keeping NaN (and infinities) as CpuRef does, also where
    oneDNN Graph compiles the trace of it (``kernels.common``)."""
    import torch
    import torch.nn.functional as F

    from backplane.backends.torch.kernels import common

    if unary is None:
        return None
    attr, scalars, algorithm = unary
    slope = scalars[0] if scalars else 0.01
    table: dict[str, Callable[[Any], Any]] = {
        "relu": common.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "swish": F.silu,
        "leaky_relu": common.relu if slope == 0 else lambda t: F.leaky_relu(t, slope),
        "hardtanh": lambda t: common.clamp(t, _bound(scalars[0]), _bound(scalars[1])),
        "gelu": lambda t: common.gelu(t, approximate=algorithm or "none"),
    }
    return table[attr]


def _bound(value: float) -> float | None:
    return value if math.isfinite(value) else None  # Clip without a bound: no clamp on that side


def onednn_post_ops(unary: PostOp | None) -> tuple[PostOp, Callable[[Any], Any] | None]:
    """``unary`` split into what oneDNN runs fused with the product and what torch runs after it.

    oneDNN's relu (also leaky_relu with slope 0), clip (hardtanh) and hardsigmoid post-ops are
    max / min against a bound, which turn NaN into the bound (a NaN pixel vanished after a
    Conv -> Relu), and its gelu makes NaN of +Inf: those run as torch calls after it (in place:
    one pass over the result, measured in bench/nan_propagation.py); the others keep NaN fused."""
    if unary is None:
        return ("none", [], None), None
    attr, scalars, _ = unary
    drops = attr in ("relu", "hardtanh", "hardsigmoid", "gelu") or (
        attr == "leaky_relu" and scalars and scalars[0] == 0)
    return (("none", [], None), _in_place(unary)) if drops else (unary, None)


def _in_place(unary: PostOp) -> Callable[[Any], Any]:
    """The post-ops ``onednn_post_ops`` leaves to torch, on a result nothing else holds yet."""
    import torch.nn.functional as F

    attr, scalars, _ = unary
    if attr in ("relu", "leaky_relu"):
        return lambda t: t.relu_()
    if attr == "hardtanh":
        low, high = _bound(scalars[0]), _bound(scalars[1])
        return (lambda t: t) if low is None and high is None else lambda t: t.clamp_(low, high)
    if attr == "hardsigmoid":
        return lambda t: F.hardsigmoid(t, inplace=True)
    return torch_post_op(unary)  # type: ignore[return-value]


def fastest(kind: str, description: dict[str, Any], routes: dict[str, Callable[[], Any]],
            make_sample: Callable[[], list[Any]], backend: Any) -> Callable[..., Any]:
    """The route measured fastest on a sample input, or the one the disk cache remembers for this
    layer on this machine and library (``route_cache``; ``CpuAcc.route_cache`` False skips it).
    ``routes`` are makers: where the route is remembered only that one is made (a route not taken
    would copy and pack its weights at every load for nothing). On a busy machine
    (``threads.crowded``) the first of ``routes`` is taken without measuring, and not kept; one
    measured while this process's threads waited for CPUs others held is not kept either
    (``route_cache.watched``). In
    CpuAcc's background thread (``threads.making``), a ``trials.Trial`` of them all, timed in the
    thread that runs the network; or, busy, the first, made (a subgraph compiled) but untimed."""
    from backplane.backends.torch import route_cache, threads, trials

    known = remembered(kind, description, backend)
    if known in routes:
        return because(routes[known](), f"{known}: kept in the route cache")  # type: ignore[index]
    making = threads.making()
    if making == threads.TRIALS:  # CpuAcc's background: timed where the network runs
        return trials.trial(kind, description, routes, make_sample, backend)
    if making == threads.UNTIMED:  # the background on a busy machine: compiled where it compiles
        first = next(iter(routes))
        return because(routes[first](), f"{first}: the first route on a busy machine, untimed")
    if threads.deferring():  # a stand-in, replaced by the background (``background.py``)
        quick = next((n for n in QUICK_ROUTES if n in routes), next(iter(routes)))
        return deferred(because(routes[quick](), f"{quick}: {DEFERRED}"))
    if threads.crowded():  # a busy machine: the first route, unmeasured and not kept
        first = next(iter(routes))
        return because(routes[first](), f"{first}: the default on a busy machine, unmeasured")
    progress.count("CpuAcc: routes measured")
    made = {name: make() for name, make in routes.items()}
    sample = make_sample()
    with route_cache.watched() as noise:  # a route timed beside other work is not kept
        times = taking_turns(made, sample)
    name = min(made, key=times.__getitem__)
    if backend.options.get("CpuAcc.route_cache", True) and not noise():
        route_cache.store(route_cache.key(kind, description), name)
    others = ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items() if n != name)
    unkept = f"; not kept: {noise()}" if noise() else ""
    return because(made[name], f"{name}: measured fastest at load, {times[name] * 1e3:.3f} ms "
                               f"({others}){unkept}")


QUICK_ROUTES = ("torch", "mkl", "float")
"""The routes a stand-in takes where a layer has one: made without packing a weight (oneDNN's
reorder of the demo model's 52 convolution weights was 0.8 of its 1.6 s load at load average 3)."""
DEFERRED = "measured and compiled in the background, swapped in when done"
"""The ``why`` of a stand-in workload a load made at once (``background.py``)."""


def deferred(run: Any, later: bool = True) -> Any:
    """``run``, marked (``run.deferred``) as a stand-in that ``background.deferred`` replaces with
    the workload a load that measures makes, where ``later``."""
    if later:
        try:
            run.deferred = True
        except AttributeError:  # a callable without a __dict__: not replaced
            pass
    return run


def because(run: Any, why: str) -> Any:
    """``run`` with ``why`` it was chosen (``run.why``: the CLI's and the debug knob's "why this
    route"), where it takes attributes."""
    try:
        run.why = why
    except AttributeError:  # a callable without a __dict__
        pass
    return run


COMPUTE_TYPES = ("float32", "bfloat16", "float16")
"""The names a ``compute`` attribute may hold: it comes from an artifact's JSON too, so a name is
looked up in this list, never as any attribute of torch."""


def compute_type(a: dict[str, Any]) -> Any:
    """The torch type a fused layer computes float32 in: its ``compute`` attribute, set inside a
    reduced-precision subgraph (``reduced``), else float32."""
    return named_type(a.get("compute") or "float32")


def named_type(name: str) -> Any:
    """The torch dtype of one of ``COMPUTE_TYPES``, or a ValueError listing them."""
    import torch

    if name not in COMPUTE_TYPES:
        raise ValueError(f"a compute type {name!r}; the known ones are {', '.join(COMPUTE_TYPES)}")
    return getattr(torch, name)


def weight_of(a: dict[str, Any], key: str, value: Any = None) -> Any:
    """A fused layer's constant ``a[key]`` (or ``value``, an array made from it) as a torch tensor: the
    array's own memory, or a copy in ``compute_type`` where the layer computes in reduced precision."""
    from backplane.backends.torch.backend import _numpy_to_torch

    value = a[key] if value is None else value
    if value is None:
        return None
    tensor = _numpy_to_torch(value)
    return tensor.to(compute_type(a)) if a.get("compute") and tensor.is_floating_point() else tensor


def holding(run: Callable[..., Any], *tensors: Any) -> Callable[..., Any]:
    """``run`` with ``weights``: the tensors it keeps of its layer's constants, in the layout it
    reads (a packed copy, a channels-last copy, or the constant's own memory), for tests and
    debugging: a route keeps no other copy of a weight."""
    run.weights = tuple(t for t in tensors if t is not None)  # type: ignore[attr-defined]
    return run


def remembered(kind: str, description: dict[str, Any], backend: Any) -> str | None:
    """The route the disk cache keeps for this layer, if any (and if the cache is on)."""
    from backplane.backends.torch import route_cache

    if not backend.options.get("CpuAcc.route_cache", True):
        return None
    return route_cache.lookup(route_cache.key(kind, description))


ROUNDS = 3
"""Turns each route takes in ``taking_turns`` (a ``seconds`` of one timed call each)."""


def taking_turns(made: dict[str, Callable[..., Any]], sample: list[Any]) -> dict[str, float]:
    """Each route's fastest of ``ROUNDS`` timed calls, the routes taking turns, so that a burst of
    load meets them alike. Timed one route after the other, a burst met one route's calls only:
    on this project's 2-core AMD EPYC at load 6-8, a compiled route measured 100-400 ms at load on
    mobilenet_dw_dyn18 and audio_conv1d_dyn19 (0.14 ms the next time), the other route won, and
    the route cache kept it."""
    best = dict.fromkeys(made, math.inf)
    for _ in range(ROUNDS):
        for name, run in made.items():
            best[name] = min(best[name], seconds(run, *sample, repeat=1))
    return best


def seconds(run: Callable[..., Any], *sample: Any, repeat: int = 5) -> float:
    """The fastest of a few timed calls, after one untimed; a route that fails never wins."""
    try:
        run(*sample)
        best = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            run(*sample)
            best = min(best, time.perf_counter() - start)
        return best
    except RuntimeError:
        return math.inf


def activation(out: str, ctx: Context) -> tuple[list[Layer], PostOp] | None:
    """The activation applied to ``out``: its layers and its post-op."""
    swish = swish_layers(out, ctx)
    if swish is not None:
        return swish, ("swish", [], None)
    hard = hardswish_layers(out, ctx)
    if hard is not None:
        return hard, ("hardswish", [], None)
    nxt = ctx.sole(out)
    unary = post_op(nxt, ctx) if nxt is not None else None
    return ([nxt], unary) if unary is not None else None  # type: ignore[list-item]
