"""The loader fuzzer's seed models (tests/frontends/test_fuzz_loader.py): the committed tiny models,
the demo model and small hand-made ones, each covering constructs the mutations then damage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
SEED_FILES = [ROOT / "tests" / "data" / f"tiny_{n}.onnx" for n in ("bert", "gpt2", "mobilenet_v3")]
SEED_FILES.append(ROOT / "models" / "mobilenet_v2_w020_c10.onnx")



def _model(nodes: list[NodeProto], inputs: list, outputs: list, inits: Sequence[TensorProto] = (),
           opset: int = 17, functions: Sequence[onnx.FunctionProto] = (),
           extra_opsets: Sequence[onnx.OperatorSetIdProto] = ()) -> ModelProto:
    graph = helper.make_graph(nodes, "seed", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
                              functions=list(functions))
    model.ir_version = 8
    return model


def _vi(name: str, elem: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _f(name: str, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return _vi(name, TensorProto.FLOAT, shape)


def _arr(values: Any, name: str, dtype: Any = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def seed_small_cnn() -> ModelProto:
    from tests.conftest import small_cnn_model
    return small_cnn_model()


def seed_constants() -> ModelProto:
    """A Constant node, an initializer, a symbolic batch dimension."""
    const = helper.make_node("Constant", [], ["c"], name="const",
                             value=_arr([1.0, 2.0, 3.0], "c_value"))
    nodes = [const, helper.make_node("Add", ["x", "c"], ["y"], name="add1"),
             helper.make_node("Mul", ["y", "bias"], ["z"], name="mul1"),
             helper.make_node("Sigmoid", ["z"], ["out"], name="sig")]
    return _model(nodes, [_f("x", ["batch", 3])], [_f("out", ["batch", 3])],
                  [_arr([0.5, -1.0, 2.0], "bias")])


def seed_shapes() -> ModelProto:
    """Reshape, Transpose, Slice, Concat, Split (two outputs), Unsqueeze, ReduceMean, Gather, Cast."""
    rng = np.random.default_rng(1)
    inits = [_arr([2, 3, 4], "shape", np.int64), _arr([0], "starts", np.int64),
             _arr([2], "ends", np.int64), _arr([1], "axes1", np.int64),
             _arr([2, 1], "split", np.int64), _arr([0, 2], "idx", np.int64),
             _arr(rng.standard_normal((4, 5)), "w")]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[1, 0, 2]),
        helper.make_node("Slice", ["t", "starts", "ends"], ["s"], name="slice"),
        helper.make_node("Concat", ["s", "s"], ["cat"], name="concat", axis=2),
        helper.make_node("Split", ["t", "split"], ["p0", "p1"], name="split", axis=0),
        helper.make_node("ReduceMean", ["p0"], ["m"], name="mean", axes=[0], keepdims=1),
        helper.make_node("Unsqueeze", ["p1", "axes1"], ["u"], name="unsq"),
        helper.make_node("Gather", ["cat", "idx"], ["g"], name="gather", axis=2),
        helper.make_node("MatMul", ["m", "w"], ["mm"], name="matmul"),
        helper.make_node("Cast", ["mm"], ["mm64"], name="cast", to=TensorProto.DOUBLE),
        helper.make_node("Tanh", ["mm64"], ["th"], name="tanh"),
    ]
    return _model(nodes, [_f("x", [6, 4])],
                  [_vi("th", TensorProto.DOUBLE, [1, 2, 5]), _f("u", None), _f("g", None)], inits)


def seed_ints() -> ModelProto:
    """Integer and boolean tensors: Equal, Where, Not, ArgMax, Expand, ConstantOfShape."""
    nodes = [
        helper.make_node("Equal", ["ids", "zero"], ["eq"], name="equal"),
        helper.make_node("Not", ["eq"], ["ne"], name="not"),
        helper.make_node("Where", ["ne", "ids", "ten"], ["w"], name="where"),
        helper.make_node("ArgMax", ["w"], ["am"], name="argmax", axis=1, keepdims=0),
        helper.make_node("Shape", ["ids"], ["shp"], name="shape"),
        helper.make_node("ConstantOfShape", ["shp"], ["ones"], name="cos",
                         value=_arr([1.5], "v")),
        helper.make_node("Cast", ["w"], ["wf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Add", ["ones", "wf"], ["sum"], name="add"),
        helper.make_node("Expand", ["sum", "eshape"], ["big"], name="expand"),
    ]
    inits = [_arr(0, "zero", np.int64), _arr(10, "ten", np.int64), _arr([2, 3, 4], "eshape", np.int64)]
    return _model(nodes, [_vi("ids", TensorProto.INT64, [3, 4])],
                  [_vi("am", TensorProto.INT64, [3]), _f("big", [2, 3, 4])], inits)


def seed_if() -> ModelProto:
    """If whose branches read outer tensors."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["t0"], name="t_mul"),
                              helper.make_node("Relu", ["t0"], ["t"], name="t_relu")],
                             "then", [], [_f("t", [4])])
    other = helper.make_graph([helper.make_node("Add", ["x", "w"], ["e0"], name="e_add"),
                               helper.make_node("Neg", ["e0"], ["e"], name="e_neg")],
                              "else", [], [_f("e", [4])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["sx"], name="sum", keepdims=0),
             helper.make_node("Less", ["sx", "w0"], ["cond"], name="less"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then,
                              else_branch=other)]
    return _model(nodes, [_f("x", [4])], [_f("y", [4])],
                  [_arr([1, -2, 3, -4], "w"), _arr(1.0, "w0")])


def seed_loop() -> ModelProto:
    """Loop carrying a value, with a scan output and an outer tensor read in the body."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "step"], ["acc_out"], name="b_add"),
         helper.make_node("Mul", ["acc_out", "acc_out"], ["sq"], name="b_square"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="b_cond")],
        "body", [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []),
                 _f("acc_in", [3])],
        [_vi("cond_out", TensorProto.BOOL, []), _f("acc_out", [3]), _f("sq", [3])])
    nodes = [helper.make_node("Loop", ["trip", "", "x"], ["acc", "squares"], name="loop", body=body)]
    return _model(nodes, [_f("x", [3])], [_f("acc", [3]), _f("squares", [4, 3])],
                  [_arr(4, "trip", np.int64), _arr([0.5, 1.0, -1.0], "step")])


def seed_scan() -> ModelProto:
    """Scan: a running sum over the first axis."""
    body = helper.make_graph([helper.make_node("Add", ["s_in", "x_t"], ["s_out"], name="b_add"),
                              helper.make_node("Identity", ["s_out"], ["y_t"], name="b_id")],
                             "body", [_f("s_in", [2]), _f("x_t", [2])], [_f("s_out", [2]), _f("y_t", [2])])
    node = helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body,
                            num_scan_inputs=1)
    return _model([node], [_f("s0", [2]), _f("xs", [5, 2])], [_f("s", [2]), _f("ys", [5, 2])])


def seed_function() -> ModelProto:
    """A local function (inlined at import) and a second domain."""
    fn = helper.make_function("local", "Scale", ["a"], ["b"],
                              [helper.make_node("Constant", [], ["k"], value_float=3.0),
                               helper.make_node("Mul", ["a", "k"], ["b"])],
                              [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Scale", ["x"], ["y"], domain="local", name="scale"),
             helper.make_node("Softmax", ["y"], ["z"], name="softmax", axis=-1)]
    return _model(nodes, [_f("x", [2, 3])], [_f("z", [2, 3])], functions=[fn],
                  extra_opsets=[helper.make_opsetid("local", 1)])


def seed_norm() -> ModelProto:
    """BatchNormalization, LayerNormalization, Pad, MaxPool, Resize."""
    rng = np.random.default_rng(2)
    inits = [_arr(rng.uniform(0.5, 1.5, 2), "scale"), _arr(rng.standard_normal(2), "bias"),
             _arr(rng.standard_normal(2), "mean"), _arr(rng.uniform(0.5, 1.5, 2), "var"),
             _arr([0, 0, 1, 1, 0, 0, 1, 1], "pads", np.int64),
             _arr([1, 1, 2, 2], "scales"), _arr(rng.uniform(0.5, 1.5, 8), "ln_scale")]
    nodes = [
        helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["bn"], name="bn"),
        helper.make_node("Pad", ["bn", "pads"], ["pad"], name="pad", mode="constant"),
        helper.make_node("MaxPool", ["pad"], ["mp"], name="pool", kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("Resize", ["mp", "", "scales"], ["rs"], name="resize", mode="nearest"),
        helper.make_node("LayerNormalization", ["rs", "ln_scale"], ["ln"], name="ln", axis=-1),
    ]
    return _model(nodes, [_f("x", [1, 2, 3, 3])], [_f("ln", [1, 2, 8, 8])], inits)


HAND_MADE: dict[str, Callable[[], ModelProto]] = {
    "small_cnn": seed_small_cnn, "constants": seed_constants, "shapes": seed_shapes,
    "ints": seed_ints, "if": seed_if, "loop": seed_loop, "scan": seed_scan,
    "function": seed_function, "norm": seed_norm,
}


def seed_models() -> dict[str, ModelProto]:
    seeds = {name: make() for name, make in HAND_MADE.items()}
    for path in SEED_FILES:
        seeds[path.stem] = onnx.load(str(path))
    return seeds

