"""Elementwise layers inside a captured subgraph as one CUDA kernel (issue 28: launch-bound runs).

A captured graph replays every kernel however small, 1-2 us each (bench/gpu_profile.py): the
exported GELU (Div, Erf, Add, Mul, Mul) is five kernels over one tensor, a decomposed LayerNorm's
tail (Div, Mul, Add) three, the tanh GELU of GPT-2 eight. Here a tree of float32 elementwise layers
(each value it makes read by the next layer alone, the tree's last value the one that leaves it) is
written as one CUDA function and compiled by torch's jiterator (``gpu_jit``): one kernel, reading
each outside tensor once. Scalar constants are written into the code as float literals; other
inputs, up to eight, are the kernel's tensors, broadcast as the layers broadcast them.

The kernel computes each layer's operation in float32 in the layers' order, with CUDA's math
functions (``erff``, ``tanhf``, ``sqrtf``: torch's kernels call the same); a division by a constant
divides, where torch on CUDA may multiply by the reciprocal: outputs within an ulp or so of the
layers' (``tests/backends/torch/test_gpu_chains.py``). Where the kernel cannot run (another type,
another device, no NVRTC, a trace), the layers' own steps run one after another.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.torch import gpu_jit
from backplane.backends.torch.gpu_small import Step
from backplane.ir.graph import Layer

BINARY = {"Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})"}
UNARY = {"Erf": "erff({0})", "Tanh": "tanhf({0})", "Sqrt": "sqrtf({0})", "Neg": "(-{0})",
         "Reciprocal": "(1.0f / {0})", "Sigmoid": "(1.0f / (1.0f + expf(-{0})))",
         "Relu": "({0} < 0.0f ? 0.0f : {0})"}
"""Each as torch's CUDA kernel computes it in float32 (sigmoid as 1 / (1 + exp(-x))); a NaN
passes every comparison written here as false, so it comes out NaN, as torch's clamps give it."""
CLIP = "({0} < {1} ? {1} : ({0} > {2} ? {2} : {0}))"
POWERS = {2.0: "({0} * {0})", 3.0: "({0} * {0} * {0})"}  # torch's pow by 2 and 3 multiplies
MAX_TENSORS = 8  # jiterator's inputs


def chain_steps(layers: Sequence[Layer], steps: list[Step | None], original: Sequence[Any],
                sole: Callable[[str], int | None], outputs: Sequence[str],
                constants: dict[str, np.ndarray]) -> None:
    """Trees of two or more elementwise layers still running their own kernels (``original``:
    each layer's bound kernel) as one step each. Rewrites ``steps`` in place."""
    group: dict[int, list[int]] = {}  # a layer's index -> the tree it closes so far
    for index, layer in enumerate(layers):
        if not _fusible(layer, steps[index], original[index], constants):
            continue
        tree = [index]
        trip = _trip(steps[index])
        for name in steps[index][1][:1] if trip else layer.inputs:  # type: ignore[index]
            producer = next((i for i in group if layers[i].outputs[0] == name), None)
            reader = sole(name)  # a round trip's x: read by its QuantizeLinear
            if trip and reader is not None:
                reader = index if layers[reader].outputs[:1] == layer.inputs[:1] else None
            if producer is not None and reader == index and name not in outputs:
                tree = group.pop(producer) + tree
        group[index] = tree
    for root, tree in group.items():
        if len(tree) > 1:
            made = _kernel(layers, tree, steps, constants)
            if made is not None:
                for i in tree:
                    steps[i] = None
                steps[root] = made


def _trip(step: Step | None) -> tuple[float, float, float, float] | None:
    """A QDQ round trip's step (``gpu_int8._round_trip``: on the DequantizeLinear, reading x,
    then its constants): its scale, clamp bounds and NaN's value."""
    return None if step is None else getattr(step[0], "round_trip", None)


def _fusible(layer: Layer, step: Step | None, kernel: Any,
             constants: dict[str, np.ndarray]) -> bool:
    if _trip(step) is not None:
        return "" not in step[1] and len(layer.outputs) == 1  # type: ignore[index]
    if step is None or step[0] is not kernel or layer.domain or len(layer.outputs) != 1:
        return False
    if layer.op_type in UNARY:
        return len(layer.inputs) == 1
    if layer.op_type == "Clip":  # opset 11 on: its bounds 0-d constants, each or both absent
        values = [_scalar(b, constants) if b else None for b in [*layer.inputs[1:], "", ""][:2]]
        if layer.attrs or any(b and v is None for b, v in zip(layer.inputs[1:], values)):
            return False
        return None in values or values[0] <= values[1]  # type: ignore[operator]
    if layer.op_type == "HardSigmoid":
        return len(layer.inputs) == 1
    if layer.op_type == "Pow":
        exponent = _scalar(layer.inputs[1], constants) if len(layer.inputs) == 2 else None
        return exponent in POWERS
    return layer.op_type in BINARY and len(layer.inputs) == 2


def _scalar(name: str, constants: dict[str, np.ndarray]) -> float | None:
    """A 0-d float32 constant, as a finite float (None otherwise: a [1] or [1, 1] constant
    broadcasts the layer's output to its rank, which a literal would not)."""
    value = constants.get(name)
    if value is None or value.dtype != np.float32 or value.ndim != 0:
        return None
    number = float(value.reshape(()))
    return number if math.isfinite(number) else None


def _kernel(layers: Sequence[Layer], tree: list[int], steps: list[Step | None],
            constants: dict[str, np.ndarray]) -> Step | None:
    """The tree's CUDA function and its step (None past jiterator's eight tensors)."""
    inside = {layers[i].outputs[0]: f"v{n}" for n, i in enumerate(tree)}
    tensors: list[str] = []
    literals: list[str] = []  # scalar constants written into the code (the fallback reads them)
    lines = []

    def operand(name: str) -> str:
        if name in inside:
            return inside[name]
        number = _scalar(name, constants)
        if number is not None:
            literals.append(name)
            return f"{float(np.float32(number)).hex()}f"
        if name not in tensors:
            tensors.append(name)
        return f"in{tensors.index(name)}"

    for n, i in enumerate(tree):
        layer = layers[i]
        trip = _trip(steps[i])
        if trip is not None:  # as gpu_jit.ROUND_TRIP; the product unfused (no FMA with an Add)
            x = operand(steps[i][1][0])  # type: ignore[index]
            literals.extend(steps[i][1][1:])  # type: ignore[index]
            scale, low, high, nan = (f"{float(np.float32(v)).hex()}f" for v in trip)
            lines.append(f"    T q{n} = rintf(__fdiv_rn({x}, {scale}));")
            lines.append(f"    q{n} = q{n} < {low} ? {low} : (q{n} > {high} ? {high} : q{n});")
            text = f"{x} != {x} ? {nan} : __fmul_rn(q{n}, {scale})"
        elif layer.op_type == "Pow":
            literals.append(layer.inputs[1])
            power = POWERS[_scalar(layer.inputs[1], constants)]  # type: ignore[index]
            text = power.format(operand(layer.inputs[0]))
        elif layer.op_type == "Clip":
            low, high = [*layer.inputs[1:], "", ""][:2]
            text = CLIP.format(operand(layer.inputs[0]), operand(low) if low else "-INFINITY",
                               operand(high) if high else "INFINITY")
        elif layer.op_type == "HardSigmoid":  # clamp(x * alpha + beta, 0, 1), as the kernel
            alpha, beta = (f"{float(np.float32(layer.attrs.get(k, d))).hex()}f"
                           for k, d in (("alpha", 0.2), ("beta", 0.5)))
            lines.append(f"    T h{n} = {operand(layer.inputs[0])} * {alpha} + {beta};")
            text = CLIP.format(f"h{n}", "0.0f", "1.0f")
        else:
            table = UNARY if layer.op_type in UNARY else BINARY
            text = table[layer.op_type].format(*[operand(x) for x in layer.inputs])
        lines.append(f"    T v{n} = {text};")
    if not tensors or len(tensors) > MAX_TENSORS:
        return None
    body = "\n".join(lines)
    params = ", ".join(f"T in{k}" for k in range(len(tensors)))
    name = f"backplane_ew_{zlib.crc32(body.encode()):08x}"
    code = f"template <typename T> T {name}({params}) {{\n{body}\n    return v{len(tree) - 1};\n}}"
    parts = [steps[i] for i in tree]
    names = tensors + sorted(set(literals) - set(tensors))
    return (_workload(code, names, len(tensors), parts), names,  # type: ignore[arg-type]
            layers[tree[-1]].outputs)


def _workload(code: str, names: list[str], count: int, parts: list[Step]) -> Any:
    """The kernel over the first ``count`` inputs; the layers' steps where it cannot run."""
    import torch

    def workload(*values: Any) -> tuple[Any, ...]:
        tensors = values[:count]
        if all(isinstance(v, torch.Tensor) and v.is_cuda and v.dtype == torch.float32
               for v in tensors) and len({v.device for v in tensors}) == 1:
            out = gpu_jit.call(code, *tensors)
            if out is not None:
                return (out,)
        known = dict(zip(names, values))
        for kernel, reads, outs in parts:
            known.update(zip(outs, kernel(*[known[n] for n in reads])))
        return (known[parts[-1][2][0]],)

    workload.code = code  # type: ignore[attr-defined]  # what the tests and profiles read
    return workload
