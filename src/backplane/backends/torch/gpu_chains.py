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
layers' (``tests/backends/torch/test_gpu_chains.py``). A float16 or bfloat16 tree (gpt_fp16_dyn19's
tanh GELU, a model run at ``GpuAcc.precision`` fp16) computes each layer in float from its operands
and rounds its value to the type, as torch's kernels do (their "opmath" type): every operand is
read as float, every layer's value kept as T. Where the kernel cannot run (another type, another
device, no NVRTC, a trace), the layers' own steps run one after another.

A QDQ round trip (``gpu_int8._round_trip``) is an element of a tree, and a Conv's bias is added
in the tree that alone reads the Conv's output (on CUDA torch adds it after cuDNN's convolution,
in a kernel of its own), the Conv then run without it: resnet_qdq_ort17's Conv -> QDQ -> Add ->
QDQ is two kernels where it was five. A Where of a constant boolean condition joins a tree too:
an exported attention's scale Mul and causal-mask Where (gpt_causal_ts15, gpt_dynquant_ort15),
one kernel where they were two. So is a QuantizeLinear giving a QLinearConv its integers
less their zero point (``gpu_int8._quantize_centred``): resnet_qlinear_ort15's Add -> Relu ->
QuantizeLinear, one kernel. Those trees run in float32 alone.
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
WHERE = "({0} != 0.0f ? {1} : {2})"
"""Where of a constant boolean condition (an exported causal mask), read as 0 or 1 of the tree's
type (``_typed``): the attention's scale Mul and its mask Where, one kernel where they were two."""
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
        for name in _data(layers, steps, index):
            producer = next((i for i in group if layers[i].outputs[0] == name), None)
            if producer is not None and _reader(layers, steps, index, name, sole) \
                    and name not in outputs:
                tree = group.pop(producer) + tree
        group[index] = tree
    made_by = {layer.outputs[0]: i for i, layer in enumerate(layers) if layer.outputs}
    for root, tree in group.items():
        biases = {}  # a Conv's output the tree reads -> its bias, added in the tree
        for i in tree:
            for name in _data(layers, steps, i):
                conv = made_by.get(name)
                if conv is not None and name not in outputs and _reader(layers, steps, i, name,
                                                                        sole) \
                        and _biased(layers[conv], steps[conv], original[conv], constants):
                    biases[name] = layers[conv].inputs[2]
        if len(tree) > 1 or biases:
            made = _kernel(layers, tree, steps, constants, biases)
            if made is not None:
                for i in tree:
                    steps[i] = None
                steps[root] = made
                for name in biases:  # the convolution without its bias: the tree adds it
                    conv = made_by[name]
                    steps[conv] = (original[conv], [*layers[conv].inputs[:2], ""], [name])


def _data(layers: Sequence[Layer], steps: list[Step | None], index: int) -> list[str]:
    """The values a tree's layer computes on (a round trip's x; not its constants)."""
    return list(steps[index][1][:1]) if _trip(steps[index]) else list(layers[index].inputs)  # type: ignore[index]


def _reader(layers: Sequence[Layer], steps: list[Step | None], index: int, name: str,
            sole: Callable[[str], int | None]) -> bool:
    """Whether the tree's layer at ``index`` alone reads ``name`` (a round trip's x: read by
    its QuantizeLinear)."""
    reader = sole(name)
    if _trip(steps[index]) and reader is not None:
        return layers[reader].outputs[:1] == layers[index].inputs[:1]
    return reader == index


def _biased(conv: Layer, step: Step | None, kernel: Any, constants: dict[str, np.ndarray]) -> bool:
    """A Conv running its own kernel with a constant bias of one value per channel: on CUDA
    torch adds the bias after cuDNN's convolution, a kernel of its own (``elementwise_kernel``
    over the output), which the tree reading the output takes in."""
    bias = constants.get(conv.inputs[2]) if conv.op_type == "Conv" and len(conv.inputs) == 3 \
        else None
    return bias is not None and not conv.domain and step is not None and step[0] is kernel \
        and bias.ndim == 1 and bias.dtype == np.float32 and len(conv.outputs) == 1


def _trip(step: Step | None) -> tuple[float, float, float, float] | None:
    """A QDQ round trip's step (``gpu_int8._round_trip``: on the DequantizeLinear, reading x,
    then its constants): its scale, clamp bounds and NaN's value."""
    return None if step is None else getattr(step[0], "round_trip", None)


def _centred(step: Step | None) -> tuple[float, float, float, float] | None:
    """A QuantizeLinear's step giving x's integer less its zero point as float32
    (``gpu_int8._quantize_centred``, read by QLinearConv): its scale, zero point and range."""
    return None if step is None else getattr(step[0], "centred", None)


def _fusible(layer: Layer, step: Step | None, kernel: Any,
             constants: dict[str, np.ndarray]) -> bool:
    if _centred(step) is not None:
        return "" not in step[1] and len(layer.outputs) == 1  # type: ignore[index]
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
    if layer.op_type == "Where":
        condition = constants.get(layer.inputs[0]) if len(layer.inputs) == 3 else None
        return condition is not None and condition.dtype == np.bool_ \
            and not any(n in constants and constants[n].dtype == np.bool_
                        for n in layer.inputs[1:])
    if layer.op_type == "Pow":
        exponent = _scalar(layer.inputs[1], constants) if len(layer.inputs) == 2 else None
        return exponent in POWERS
    return layer.op_type in BINARY and len(layer.inputs) == 2


def _scalar(name: str, constants: dict[str, np.ndarray]) -> float | None:
    """A 0-d float32 or float16 constant, as a finite float (None otherwise: a [1] or [1, 1] constant
    broadcasts the layer's output to its rank, which a literal would not)."""
    value = constants.get(name)
    if value is None or value.dtype not in (np.float32, np.float16) or value.ndim != 0:
        return None
    number = float(value.reshape(()))
    return number if math.isfinite(number) else None


def _kernel(layers: Sequence[Layer], tree: list[int], steps: list[Step | None],
            constants: dict[str, np.ndarray], biases: dict[str, str] | None = None,
            ) -> Step | None:
    """The tree's CUDA function and its step (None past jiterator's eight tensors); ``biases``:
    convolutions' outputs it reads without their bias, and the bias each (added first)."""
    inside = {layers[i].outputs[0]: f"((float)v{n})" for n, i in enumerate(tree)}
    biases = biases or {}
    tensors: list[str] = []
    literals: list[str] = []  # scalar constants written into the code (the fallback reads them)
    lines = []
    views: dict[int, int] = {}  # a bias's tensor -> its convolution's, whose rank it takes
    conditions: set[str] = set()  # Where's boolean constants, read as the tree's type

    def operand(name: str) -> str:
        if name in inside:
            return inside[name]
        if name in biases:  # (x + b) first, as torch's add_ of the bias after the convolution
            for each in (name, biases[name]):
                if each not in tensors:
                    tensors.append(each)
            views[tensors.index(biases[name])] = tensors.index(name)
            inside[name] = f"((float)b{len(views)})"
            lines.append(f"    T b{len(views)} = (float)in{tensors.index(name)} + "
                         f"(float)in{tensors.index(biases[name])};")
            return inside[name]
        number = _scalar(name, constants)
        if number is not None:
            literals.append(name)
            return f"((float)static_cast<T>({float(np.float32(number)).hex()}f))"
        if name not in tensors:
            tensors.append(name)
        return f"((float)in{tensors.index(name)})"

    for n, i in enumerate(tree):
        layer = layers[i]
        trip = _trip(steps[i])
        if trip is not None:  # as gpu_jit.ROUND_TRIP; the product unfused (no FMA with an Add)
            x = operand(steps[i][1][0])  # type: ignore[index]
            literals.extend(steps[i][1][1:])  # type: ignore[index]
            scale, low, high, nan = (f"{float(np.float32(v)).hex()}f" for v in trip)
            lines.append(f"    float q{n} = rintf(__fdiv_rn({x}, {scale}));")
            lines.append(f"    q{n} = q{n} < {low} ? {low} : (q{n} > {high} ? {high} : q{n});")
            text = f"{x} != {x} ? {nan} : __fmul_rn(q{n}, {scale})"
        elif _centred(steps[i]) is not None:  # as gpu_jit.QUANTIZE_CENTRED
            x = operand(steps[i][1][0])  # type: ignore[index]
            literals.extend(steps[i][1][1:])  # type: ignore[index]
            scale, zero, low, high = (f"{float(np.float32(v)).hex()}f"
                                      for v in _centred(steps[i]))  # type: ignore[union-attr]
            lines.append(f"    float q{n} = rintf(__fdiv_rn({x}, {scale})) + {zero};")
            lines.append(f"    q{n} = q{n} < {low} ? {low} : (q{n} > {high} ? {high} : q{n});")
            text = f"{x} != {x} ? -({zero}) : q{n} - ({zero})"
        elif layer.op_type == "Pow":
            literals.append(layer.inputs[1])
            power = POWERS[_scalar(layer.inputs[1], constants)]  # type: ignore[index]
            text = power.format(operand(layer.inputs[0]))
        elif layer.op_type == "Clip":
            low, high = [*layer.inputs[1:], "", ""][:2]
            text = CLIP.format(operand(layer.inputs[0]), operand(low) if low else "-INFINITY",
                               operand(high) if high else "INFINITY")
        elif layer.op_type == "Where":
            conditions.add(layer.inputs[0])
            text = WHERE.format(*[operand(x) for x in layer.inputs])
        elif layer.op_type == "HardSigmoid":  # clamp(x * alpha + beta, 0, 1), as the kernel
            alpha, beta = (f"{float(np.float32(layer.attrs.get(k, d))).hex()}f"
                           for k, d in (("alpha", 0.2), ("beta", 0.5)))
            lines.append(f"    float h{n} = {operand(layer.inputs[0])} * {alpha} + {beta};")
            text = CLIP.format(f"h{n}", "0.0f", "1.0f")
        else:
            table = UNARY if layer.op_type in UNARY else BINARY
            text = table[layer.op_type].format(*[operand(x) for x in layer.inputs])
        lines.append(f"    T v{n} = {text};")
    if not tensors or len(tensors) > MAX_TENSORS or set(tensors) <= conditions:
        return None
    body = "\n".join(lines)
    params = ", ".join(f"T in{k}" for k in range(len(tensors)))
    name = f"backplane_ew_{zlib.crc32(body.encode()):08x}"
    code = f"template <typename T> T {name}({params}) {{\n{body}\n    return v{len(tree) - 1};\n}}"
    parts = [(_add_bias, [name, bias], [name]) for name, bias in biases.items()]
    parts += [steps[i] for i in tree]  # type: ignore[misc]
    names = tensors + sorted(set(literals) - set(tensors))
    strict = bool(biases) or any(_trip(steps[i]) or _centred(steps[i]) for i in tree)  # float32's
    return (_workload(code, names, len(tensors), parts, views, strict,  # type: ignore[arg-type]
                      {tensors.index(c) for c in conditions}), names, layers[tree[-1]].outputs)


def _typed() -> Callable[[Any, Any], Any]:
    """A boolean constant as a tensor of 0 and 1 of another tensor's type and device, made at its
    first call (the warm-up before a capture) and kept with the constant it was made from: the
    captured graph reads it, no conversion kernel is replayed."""
    import torch

    kept: dict[tuple[int, Any, Any], tuple[Any, Any]] = {}

    def typed(condition: Any, like: Any) -> Any:
        if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
            return condition
        key = (id(condition), like.dtype, like.device)
        made = kept.get(key)
        if made is None or made[0] is not condition:
            if len(kept) >= 8:  # a constant is one tensor a run: others come and go (tests)
                kept.clear()
            made = kept[key] = (condition, condition.to(device=like.device, dtype=like.dtype))
        return made[1]

    return typed


def _per_channel(bias: Any, like: Any) -> Any:
    """A convolution's (C,) bias viewed (C, 1, ...) against its (N, C, ...) output."""
    return bias.view(-1, *([1] * (like.dim() - 2)))


def _add_bias(y: Any, bias: Any) -> tuple[Any]:
    return (y + _per_channel(bias, y),)


def _workload(code: str, names: list[str], count: int, parts: list[Step],
              views: dict[int, int] | None = None, strict: bool = False,
              conditions: set[int] | None = None) -> Any:
    """The kernel over the first ``count`` inputs (``views``: a bias's position -> its
    convolution output's; ``conditions``: Where's boolean constants, read as the others' type),
    all float32, float16 or bfloat16 alike (float32 alone where ``strict``); the layers' steps
    where it cannot run."""
    import torch

    views, conditions = views or {}, conditions or set()
    types = (torch.float32,) if strict else (torch.float32, torch.float16, torch.bfloat16)
    typed = _typed()

    def workload(*values: Any) -> tuple[Any, ...]:
        tensors = values[:count]
        if views:
            tensors = tuple(_per_channel(t, tensors[views[k]]) if k in views else t
                            for k, t in enumerate(tensors))
        if conditions and all(isinstance(v, torch.Tensor) and v.is_cuda for v in tensors):
            like = next(t for k, t in enumerate(tensors) if k not in conditions)
            tensors = tuple(typed(t, like) if k in conditions else t
                            for k, t in enumerate(tensors))
        if all(isinstance(v, torch.Tensor) and v.is_cuda for v in tensors) \
                and tensors[0].dtype in types and len({v.dtype for v in tensors}) == 1 \
                and len({v.device for v in tensors}) == 1:
            out = gpu_jit.call(code, *tensors)
            if out is not None:
                return (out,)
        known = dict(zip(names, values))
        for kernel, reads, outs in parts:
            known.update(zip(outs, kernel(*[known[n] for n in reads])))
        return (known[parts[-1][2][0]],)

    workload.code = code  # type: ignore[attr-defined]  # what the tests and profiles read
    return workload
