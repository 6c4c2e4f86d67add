"""NaN-keeping forms of the ONNX ops OpenVINO's CPU plugin computes with NaN-dropping min/max.

OpenVINO 2026.4's CPU kernels drop a NaN where CpuRef and ONNX Runtime keep it: Relu, Clip,
HardSigmoid, Max, Min and Celu of NaN give a number (the bound), Exp of NaN gives inf, ReduceMax and
ReduceMin skip NaN, Softmax and LogSoftmax of a row holding NaN or +inf give 0 or -inf beside it, and
Greater / GreaterOrEqual of NaN answer true. An all-NaN frame through tiny_mobilenet_v3 gave finite,
plausible logits. Each such node is written here as the op plus what puts NaN back:

- elementwise (``KEEP_INPUT``): ``Where(IsNaN(x), x, op(x))`` for each float input that reaches the
  output (one for Clip, all for Max and Min);
- ReduceMax / ReduceMin: ``Where(ReduceMax(IsNaN(x)), NaN, op(x))``, the same axes;
- Softmax / LogSoftmax: ``op(x) + ReduceSum(Where(IsNaN(x) | x == +inf, NaN, 0))`` over the op's axes,
  so that a row holding NaN or +inf is NaN throughout, as ``exp(x - max(x))`` makes it;
- Greater(a, b) as Less(b, a), GreaterOrEqual(a, b) as LessOrEqual(b, a): OpenVINO's Less answers
  NaN rightly.

- MaxPool, GlobalMaxPool (one output): ``Where(pool(Cast(IsNaN(x))) > 0, NaN, pool(x))``, so that
  every output whose window reads a NaN is NaN, as in CpuRef (ONNX Runtime drops NaN there, and
  OpenVINO dropped 9 where CpuRef keeps them: docs/robustness.md).

Resize is left as it is.
The helper nodes are named after the layer (``<layer>/nan_...``); they cost an extra pass over the
op's output where they break OpenVINO's fusion of the op into the layer before it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

KEEP_INPUT = {"Relu": 1, "Clip": 1, "HardSigmoid": 1, "Exp": 1, "Celu": 1, "Max": None, "Min": None}
"""Elementwise ops whose output is NaN where one of these inputs is (None: all of them)."""
SWAPPED = {"Greater": "Less", "GreaterOrEqual": "LessOrEqual"}
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)

Types = dict[str, int]  # tensor name -> ONNX element type, for the tensors the node reads


def nan_keeping(made: onnx.NodeProto, types: Types, opset: int, rank: int | None) -> \
        list[onnx.NodeProto]:
    """``made`` as the nodes that compute it and keep NaN where OpenVINO would drop it (``[made]``
    when its op needs nothing, or its input is not a float)."""
    op = made.op_type
    if made.domain or not made.input or types.get(made.input[0]) not in FLOATS:
        return [made]
    if op in SWAPPED:
        swapped = helper.make_node(SWAPPED[op], [made.input[1], made.input[0]], list(made.output),
                                   name=made.name)
        return [swapped]
    if op in KEEP_INPUT:
        return _keep_inputs(made, KEEP_INPUT[op])
    if op in ("ReduceMax", "ReduceMin"):
        return _reduce(made, types[made.input[0]])
    if op in ("MaxPool", "GlobalMaxPool") and len([n for n in made.output if n]) == 1:
        return _pool(made, types[made.input[0]])
    if op in ("Softmax", "LogSoftmax") and (opset >= 13 or rank is not None):
        return _softmax(made, types[made.input[0]], opset, rank)
    return [made]


def _renamed(made: onnx.NodeProto, output: str) -> onnx.NodeProto:
    inner = onnx.NodeProto()
    inner.CopyFrom(made)
    inner.output[0] = output
    return inner


def _keep_inputs(made: onnx.NodeProto, count: int | None) -> list[onnx.NodeProto]:
    inputs = [n for n in made.input[:count] if n]
    out, base = made.output[0], f"{made.name}/nan"
    nodes = [_renamed(made, f"{base}_free")]
    current = f"{base}_free"
    for index, name in enumerate(dict.fromkeys(inputs)):
        last = index == len(dict.fromkeys(inputs)) - 1
        target = out if last else f"{base}_kept{index}"
        nodes += [helper.make_node("IsNaN", [name], [f"{base}_is{index}"], name=f"{base}_is{index}"),
                  helper.make_node("Where", [f"{base}_is{index}", name, current], [target],
                                   name=f"{base}_where{index}")]
        current = target
    return nodes


def _constant(name: str, value: float, elem: int) -> onnx.NodeProto:
    tensor = helper.make_tensor(name, elem, [], [value])
    return helper.make_node("Constant", [], [name], name=name, value=tensor)


def _reduce(made: onnx.NodeProto, elem: int) -> list[onnx.NodeProto]:
    out, base = made.output[0], f"{made.name}/nan"
    flags = helper.make_node("Cast", [f"{base}_is"], [f"{base}_flag"], name=f"{base}_flag", to=elem)
    anywhere = onnx.NodeProto()
    anywhere.CopyFrom(made)  # the same axes (attribute or input), keepdims and noop_with_empty_axes
    anywhere.op_type, anywhere.name = "ReduceMax", f"{base}_any"
    anywhere.input[0], anywhere.output[0] = f"{base}_flag", f"{base}_any"
    return [_renamed(made, f"{base}_free"),
            helper.make_node("IsNaN", [made.input[0]], [f"{base}_is"], name=f"{base}_is"), flags,
            anywhere,
            helper.make_node("Cast", [f"{base}_any"], [f"{base}_anyb"], name=f"{base}_anyb",
                             to=TensorProto.BOOL),
            _constant(f"{base}_value", float("nan"), elem),
            helper.make_node("Where", [f"{base}_anyb", f"{base}_value", f"{base}_free"], [out],
                             name=f"{base}_where")]


def _pool(made: onnx.NodeProto, elem: int) -> list[onnx.NodeProto]:
    """``Where(pool(Cast(IsNaN(x))) > 0, NaN, pool(x))``: the same pool over the NaN flags (its
    windows, strides, pads and dilations) says which outputs a NaN reaches."""
    out, base = made.output[0], f"{made.name}/nan"
    hits = onnx.NodeProto()
    hits.CopyFrom(made)
    hits.name, hits.input[0], hits.output[0] = f"{base}_hits", f"{base}_flag", f"{base}_hits"
    return [_renamed(made, f"{base}_free"),
            helper.make_node("IsNaN", [made.input[0]], [f"{base}_is"], name=f"{base}_is"),
            helper.make_node("Cast", [f"{base}_is"], [f"{base}_flag"], name=f"{base}_flag",
                             to=elem),
            hits,
            _constant(f"{base}_zero", 0.0, elem),
            helper.make_node("Less", [f"{base}_zero", f"{base}_hits"], [f"{base}_hit"],
                             name=f"{base}_hit"),
            _constant(f"{base}_value", float("nan"), elem),
            helper.make_node("Where", [f"{base}_hit", f"{base}_value", f"{base}_free"], [out],
                             name=f"{base}_where")]


def _softmax(made: onnx.NodeProto, elem: int, opset: int, rank: int | None) -> \
        list[onnx.NodeProto]:
    out, base, x = made.output[0], f"{made.name}/nan", made.input[0]
    axis = next((a.i for a in made.attribute if a.name == "axis"), -1 if opset >= 13 else 1)
    if opset >= 13:
        axes = [axis]
    else:  # before 13 the op works on the input coerced to 2-D at ``axis``: the axes after it
        start = axis % rank  # type: ignore[operator]
        axes = list(range(start, rank))  # type: ignore[arg-type]
    reduce_inputs = [f"{base}_bad"]
    nodes = [_renamed(made, f"{base}_free"),
             helper.make_node("IsNaN", [x], [f"{base}_isnan"], name=f"{base}_isnan"),
             helper.make_node("IsInf", [x], [f"{base}_isinf"], name=f"{base}_isinf",
                              detect_negative=0),
             helper.make_node("Or", [f"{base}_isnan", f"{base}_isinf"], [f"{base}_either"],
                              name=f"{base}_either"),
             _constant(f"{base}_value", float("nan"), elem),
             _constant(f"{base}_zero", 0.0, elem),
             helper.make_node("Where", [f"{base}_either", f"{base}_value", f"{base}_zero"],
                              [f"{base}_bad"], name=f"{base}_bad")]
    if opset >= 13:
        tensor = helper.make_tensor(f"{base}_axes", TensorProto.INT64, [len(axes)], axes)
        nodes.append(helper.make_node("Constant", [], [f"{base}_axes"], name=f"{base}_axes",
                                      value=tensor))
        reduce_inputs.append(f"{base}_axes")
        reduce = helper.make_node("ReduceSum", reduce_inputs, [f"{base}_row"], name=f"{base}_row",
                                  keepdims=1)
    else:
        reduce = helper.make_node("ReduceSum", reduce_inputs, [f"{base}_row"], name=f"{base}_row",
                                  keepdims=1, axes=axes)
    return nodes + [reduce, helper.make_node("Add", [f"{base}_free", f"{base}_row"], [out],
                                             name=f"{base}_add")]
