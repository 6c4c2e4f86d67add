"""Elementwise layers of one 8-bit tensor as one table lookup (a ``Lookup`` layer).

Why: ONNX Runtime's QOperator format writes a hard-swish as DequantizeLinear -> HardSigmoid ->
QuantizeLinear -> QLinearMul(x, that) (and QLinearSigmoid, QLinearLeakyRelu alone): four layers,
each dequantizing and quantizing again, about twenty passes over the activation (on the full
tier's QOperator mobilenet, two thirds of its time). Every one of them is a function of x alone,
and x holds one of 256 values: the layers' own kernels (CpuAcc's: the values a run layer by layer
gives, bit for bit) are run once at load on those 256 values, and a run is one gather of the
table by x's bytes (``numpy.take``: 0.47 ms for (1, 96, 56, 112) on 1 thread of this AMD EPYC,
torch's indexing 1.3 ms), keeping x's memory layout. ONNX Runtime computes QLinearSigmoid and
QLinearLeakyRelu by a table too.

Taken: the layers (``OPS``) reading x or each other's outputs and scalar constants (so each output
value depends on one x value), one output read outside them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import Context
from backplane.ir.graph import Layer

OPS = frozenset({("", op) for op in ("DequantizeLinear", "QuantizeLinear", "HardSigmoid",
                                     "HardSwish", "Sigmoid", "Relu", "Clip", "LeakyRelu", "Tanh",
                                     "Add", "Sub", "Mul", "Div")}
                | {("com.microsoft", op) for op in ("QLinearMul", "QLinearAdd", "QLinearSigmoid",
                                                    "QLinearLeakyRelu")})
"""The elementwise ops a table may take (with scalar constants, each a function of one x)."""
EIGHT_BIT = frozenset({np.dtype(np.uint8), np.dtype(np.int8)})


def match_lookup(first: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """``first`` (reading an 8-bit x) and the layers after it that read only x, their outputs
    and scalar constants, with one output read elsewhere; at least two layers, or one of ONNX
    Runtime's QLinear ops."""
    x = first.inputs[0] if first.inputs else ""
    if ctx.graph.info(x).dtype not in EIGHT_BIT or x in ctx.graph.constants:
        return None
    group = _region(first, x, ctx)
    if not group or len(group) < 2 and first.domain != "com.microsoft":
        return None
    taken = {id(layer) for layer in group}
    leaving = [name for layer in group for name in layer.outputs if name and (
        name in ctx.graph.outputs or any(id(user) not in taken
                                         for user in ctx.consumers.get(name, [])))]
    if len(leaving) != 1:
        return None
    constants = {n: ctx.graph.constants[n] for layer in group for n in layer.inputs
                 if n in ctx.graph.constants}
    attrs = {"layers": group, "x": x, "y": leaving[0], "constants": constants,
             "signed": ctx.graph.info(x).dtype == np.int8}
    fused = Layer("+".join(layer.name for layer in group), "Lookup", [x], leaving, attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _region(first: Layer, x: str, ctx: Context) -> list[Layer]:
    """The layers from ``first`` on, in order, that ``match_lookup`` may take."""
    layers = ctx.view.layers
    start = next(k for k, layer in enumerate(layers) if layer is first)
    group: list[Layer] = []
    made = {x}
    for layer in layers[start:]:
        if id(layer) not in ctx.inside or id(layer) in ctx.taken \
                or (layer.domain, layer.op_type) not in OPS:
            continue
        if layer is not first and _feeds_others(layer, ctx):
            continue  # its integers leave instead (a QDQ convolution after it reads them)
        names = [n for n in layer.inputs if n]
        scalars = all(n in made or (ctx.const(n) is not None and ctx.const(n).size == 1)
                      for n in names)
        if scalars and any(n in made for n in names) and (layer is first or group):
            group.append(layer)
            made.update(n for n in layer.outputs if n)
        elif layer is first:
            break
    return group


def _feeds_others(layer: Layer, ctx: Context) -> bool:
    """A DequantizeLinear read by a layer no table takes (a QDQ convolution, ``qdq_chain``)."""
    return layer.op_type == "DequantizeLinear" and not layer.domain and any(
        (user.domain, user.op_type) not in OPS for name in layer.outputs
        for user in ctx.consumers.get(name, []))


def lookup_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The table (the layers' kernels on each of x's 256 values, indexed by x's byte), and the
    gather by x's bytes in x's memory order (a dense tensor's elements as they lie in memory)."""
    import torch

    from backplane.backends.api.kernels import bind_kernel

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # each byte
    a = layer.attrs  # its own names: the layer's inputs and outputs may be renamed since
    env: dict[str, Any] = {a["x"]: values.view(torch.int8) if a["signed"] else values}
    env.update((n, torch.from_numpy(np.array(v))) for n, v in a["constants"].items())
    for lay in a["layers"]:
        kernel = bind_kernel(backend.kernel_for(lay), lay.attrs, len(lay.outputs))
        env.update(zip(lay.outputs, kernel(*[env[n] if n else None for n in lay.inputs])))
    table = env[a["y"]].contiguous()
    numbers = table.numpy()
    pairs = _pairs(numbers)

    def run(x):
        if torch.jit.is_tracing():  # a trace holds torch's gather, not NumPy's
            return (traced_gather(x, table),)
        if not (x.is_contiguous() or x.dim() == 4
                and x.is_contiguous(memory_format=torch.channels_last)):
            x = x.contiguous()
        memory = x.view(torch.uint8).numpy().ravel(order="K")  # a view: dense, in memory order
        if pairs is not None and memory.size % 2 == 0:  # two bytes a gather
            flat = torch.from_numpy(np.take(pairs, memory.view(np.uint16)).view(numbers.dtype))
        else:
            flat = torch.from_numpy(np.take(numbers, memory))
        return (flat.as_strided(x.shape, x.stride()),)
    run.route = "lookup"  # type: ignore[attr-defined]
    return run


def traced_gather(x: Any, table: Any) -> Any:
    """The gather a trace holds: x's bytes in memory order (a dense x: contiguous or channels
    last) as int32 indices of the table (a trace takes no view of another type, so no pairs),
    the values laid out as x. (1, 96, 56, 112), 1 thread, thread CPU: ``table[x.long()]``
    1.35-1.43 ms, this 0.39-0.40 (NumPy's pairs outside a trace 0.24, on one thread where this
    gather runs on the intra-op threads)."""
    import torch

    last = x.dim() == 4 and not x.is_contiguous() \
        and x.is_contiguous(memory_format=torch.channels_last)
    dense = x.permute(0, 2, 3, 1) if last else x.contiguous()  # views where x is dense
    index = dense.reshape(-1).int()  # relative to x: no storage offset kept in the trace
    if x.dtype == torch.int8:
        index = index.bitwise_and_(0xFF)  # the byte's unsigned value, as the table is made
    y = torch.index_select(table, 0, index).view_as(dense)
    return y.permute(0, 3, 1, 2) if last else y


def _pairs(numbers: np.ndarray) -> np.ndarray | None:
    """A table of one-byte values as a table of two-byte pairs (65536 entries, 128 KiB): entry
    b0 + 256 * b1 holds the values of b0 and b1 as they lie in memory, so a gather by x's bytes
    taken two at a time (uint16) gives the same bytes in half the gathers (NumPy widens each index
    to 8 bytes first): (1, 96, 56, 112), 1 thread, this AMD EPYC at load 7: 3.7 -> 1.8 ms. None
    for wider values (a table ending in a DequantizeLinear: float32)."""
    if numbers.dtype.itemsize != 1 or numbers.size != 256:
        return None
    raw = numbers.view(np.uint8).astype(np.uint16)
    index = np.arange(1 << 16)
    # the first byte in memory is the low one of a little-endian uint16, the high one of a
    # big-endian one: either way its value's table entry lands where it came from
    return (raw[index & 0xFF] | (raw[index >> 8] << 8)).astype(np.uint16)
