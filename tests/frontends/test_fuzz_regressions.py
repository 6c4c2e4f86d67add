"""What fuzzing the loader found (tests/frontends/test_fuzz_loader.py), one small model per bug.

Each of these models once got past the importer and failed deep inside with a bare KeyError,
IndexError, TypeError or AttributeError, hung, read a file it should not, or ran to a wrong answer;
each is now a ModelError naming the node, input, field or value at import.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession, ModelError, import_onnx
from tests.conftest import float_input, make_model, small_cnn_model


def relu_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                      [float_input("x", [2])], [float_input("y", [2])])


def loop_model() -> onnx.ModelProto:
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "one"], ["t"], name="b_add"),
         helper.make_node("Mul", ["t", "one"], ["acc_out"], name="b_mul"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="b_cond")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 float_input("acc_in", [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), float_input("acc_out", [2])])
    node = helper.make_node("Loop", ["trip", "", "x"], ["acc"], name="loop", body=body)
    trip = numpy_helper.from_array(np.array(3, np.int64), "trip")
    one = numpy_helper.from_array(np.ones(2, np.float32), "one")
    return make_model([node], [float_input("x", [2])], [float_input("acc", [2])], [trip, one])


def test_the_loop_model_runs() -> None:
    """The control for the Loop regressions below: unmutated, it loads and counts to 3."""
    (acc,) = InferenceSession(loop_model(), ["CpuRef"]).run(None, {"x": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(acc, [3, 3])


def test_a_body_of_the_wrong_type_is_refused_by_attribute() -> None:
    """Was AttributeError: 'str' object has no attribute 'layers', in the optimizer."""
    model = loop_model()
    model.graph.node[0].attribute[0].CopyFrom(helper.make_attribute("body", "not a graph"))
    with pytest.raises(ModelError, match=r"node 'loop' \(Loop, opset 17\): attribute 'body' is of "
                                         r"type STRING; Loop-16 takes GRAPH"):
        import_onnx(model)


def test_a_missing_required_attribute_is_named() -> None:
    """Was KeyError: 'body', in the optimizer; a Cast without 'to' failed in its kernel."""
    model = loop_model()
    del model.graph.node[0].attribute[:]
    with pytest.raises(ModelError, match=r"node 'loop' \(Loop, opset 17\): required attribute\(s\) "
                                         r"\['body'\] of Loop-16 missing"):
        import_onnx(model)


def test_a_loop_without_trip_count_or_condition_is_refused() -> None:
    """Was a hang: with neither M nor cond, the ONNX spec's loop never ends."""
    model = loop_model()
    model.graph.node[0].input[0] = ""
    with pytest.raises(ModelError, match=r"node 'loop' .*neither a trip count \(M\) nor a condition"):
        import_onnx(model)


def test_sub_graph_nodes_out_of_order_are_sorted() -> None:
    """Was KeyError in partition(): a body's nodes were not put in order, as the main graph's are."""
    model = loop_model()
    body = model.graph.node[0].attribute[0].g
    nodes = list(body.node)[::-1]
    body.ClearField("node")
    body.node.extend(nodes)
    (acc,) = InferenceSession(model, ["CpuRef"]).run(None, {"x": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(acc, [3, 3])


def test_a_cycle_in_a_sub_graph_is_named() -> None:
    """Was KeyError in partition()."""
    model = loop_model()
    body = model.graph.node[0].attribute[0].g
    body.node[0].input[0] = "acc_out"  # b_add reads what b_mul makes of its output
    with pytest.raises(ModelError, match=r"sub-graph 'body': the graph has a cycle through layer "
                                         r"'b_(add|mul)'"):
        import_onnx(model)


def test_a_cycle_through_a_bodys_capture_is_named() -> None:
    """An If whose branch reads a tensor computed from the If's own output: a cycle no input shows."""
    then = helper.make_graph([helper.make_node("Neg", ["later"], ["t"], name="t_neg")], "then", [],
                             [float_input("t", [2])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"], name="e_abs")], "else", [],
                              [float_input("e", [2])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other),
             helper.make_node("Relu", ["y"], ["later"], name="after")]
    model = make_model(nodes, [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                               float_input("x", [2])], [float_input("later", [2])])
    with pytest.raises(ModelError, match="cycle through layer '(branch|after)'"):
        import_onnx(model)


def test_text_that_is_not_utf8_is_named() -> None:
    """Was TypeError from onnx.defs.has: protobuf hands back bytes for a string field that is not
    UTF-8 (a flipped bit in an op_type)."""
    blob = relu_model().SerializeToString().replace(b"Relu", b"R\xfflu")
    with pytest.raises(ModelError, match=r"node\[0\] 'relu': its field 'op_type' is not valid UTF-8 "
                                         r"text: b'R\\xfflu'"):
        import_onnx(blob)


def scale_function_model() -> onnx.ModelProto:
    fn = helper.make_function("local", "Scale", ["a"], ["b"],
                              [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 17)])
    node = helper.make_node("Scale", ["x"], ["y"], domain="local", name="scale")
    graph = helper.make_graph([node], "g", [float_input("x", [2])], [float_input("y", [2])])
    return helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                   helper.make_opsetid("local", 1)])


def test_a_function_called_with_too_many_inputs_is_a_model_error() -> None:
    """Was RuntimeError from onnx's inliner (an assertion in inliner.cc)."""
    model = scale_function_model()
    model.graph.node[0].input.append("x")
    with pytest.raises(ModelError, match="local functions cannot be inlined: .*formal parameters"):
        import_onnx(model)


def test_a_recursive_function_is_named() -> None:
    """Was onnx's ValidationError from the inliner."""
    model = scale_function_model()
    model.functions[0].node.append(helper.make_node("Scale", ["a"], ["again"], domain="local"))
    with pytest.raises(ModelError, match="local function 'local::Scale' calls itself"):
        import_onnx(model)


def test_a_function_left_uninlined_is_named_as_such() -> None:
    """onnx's inliner leaves a function whose opsets differ from the model's; the call was then an
    'unknown op', which did not say why."""
    model = scale_function_model()
    model.opset_import[0].version = 13
    with pytest.raises(ModelError, match=r"calls local function 'local::Scale', which could not be "
                                         r"inlined, its opsets differing from the model's \(ai.onnx: 17 "
                                         r"in the function, 13 in the model\)"):
        import_onnx(model)


def test_functions_that_would_inline_to_millions_of_nodes_are_refused() -> None:
    """Each of 30 functions calls the next twice: 2**30 nodes once inlined."""
    functions = [helper.make_function("local", "F0", ["a"], ["b"], [helper.make_node("Neg", ["a"], ["b"])],
                                      [helper.make_opsetid("", 17)])]
    for k in range(1, 30):
        functions.append(helper.make_function(
            "local", f"F{k}", ["a"], ["b"],
            [helper.make_node(f"F{k - 1}", ["a"], ["m"], domain="local"),
             helper.make_node(f"F{k - 1}", ["m"], ["b"], domain="local")],
            [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]))
    node = helper.make_node("F29", ["x"], ["y"], domain="local", name="top")
    graph = helper.make_graph([node], "g", [float_input("x", [2])], [float_input("y", [2])])
    model = helper.make_model(graph, functions=functions, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    with pytest.raises(ModelError, match="would inline to more than 1000000 nodes"):
        import_onnx(model)


def test_an_empty_required_input_is_named() -> None:
    """Was AttributeError: 'NoneType' object has no attribute 'ndim', in a kernel run by folding."""
    model = small_cnn_model()
    model.graph.node[0].input[1] = ""
    with pytest.raises(ModelError, match=r"node 'conv1' \(Conv, opset 17\): input 1 \('W'\) is empty; "
                                         r"Conv-11 requires it"):
        import_onnx(model)


def test_too_few_outputs_are_named() -> None:
    """Was IndexError in remove_identities: an Identity with no output."""
    model = make_model([helper.make_node("Identity", ["x"], [], name="ident"),
                        helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [float_input("x", [2])], [float_input("y", [2])])
    with pytest.raises(ModelError, match=r"node 'ident' \(Identity, opset 17\): 0 output\(s\); "
                                         r"Identity-16 takes exactly 1"):
        import_onnx(model)


def test_an_initializer_given_twice_is_refused() -> None:
    """Was a wrong answer: the second copy replaced the first, which ONNX Runtime keeps."""
    model = small_cnn_model()
    twin = onnx.TensorProto()
    twin.CopyFrom(model.graph.initializer[0])
    twin.raw_data = bytes(len(twin.raw_data))
    model.graph.initializer.append(twin)
    with pytest.raises(ModelError, match="the graph: 'w1' is defined twice, as an initializer and "
                                         "as an initializer"):
        import_onnx(model)


def test_a_tensor_produced_twice_is_refused() -> None:
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="first"),
                        helper.make_node("Neg", ["x"], ["y"], name="second")],
                       [float_input("x", [2])], [float_input("y", [2])])
    with pytest.raises(ModelError, match=r"'y' is defined twice, as an output of node 'first' \(Relu\) "
                                         r"and as an output of node 'second' \(Neg\)"):
        import_onnx(model)


def test_a_constant_value_of_the_wrong_type_is_refused() -> None:
    """Was a wrong answer: a FLOAT attribute named 'value' became a float64 constant."""
    const = helper.make_node("Constant", [], ["c"], name="const")
    const.attribute.append(helper.make_attribute("value", 1.5))
    model = make_model([const, helper.make_node("Add", ["x", "c"], ["y"], name="add")],
                       [float_input("x", [2])], [float_input("y", [2])])
    with pytest.raises(ModelError, match=r"node 'const' \(Constant, opset 17\): attribute 'value' is "
                                         r"of type FLOAT; Constant-13 takes TENSOR"):
        import_onnx(model)


def test_a_constant_with_two_values_is_refused() -> None:
    const = helper.make_node("Constant", [], ["c"], name="const", value_float=1.0)
    const.attribute.append(helper.make_attribute("value_int", 2))
    model = make_model([const, helper.make_node("Add", ["x", "c"], ["y"], name="add")],
                       [float_input("x", [2])], [float_input("y", [2])])
    with pytest.raises(ModelError, match=r"layer 'const' \(Constant, opset 17\) has 2 value "
                                         r"attributes \(value_float, value_int\)"):
        import_onnx(model)


def test_an_attribute_of_the_wrong_type_is_named() -> None:
    """Was TypeError: unhashable type: 'list', in Pad's support check."""
    model = small_cnn_model()
    model.graph.node[-1].attribute[0].CopyFrom(helper.make_attribute("axis", [1, 2]))
    with pytest.raises(ModelError, match=r"node 'softmax' \(Softmax, opset 17\): attribute 'axis' is "
                                         r"of type INTS; Softmax-13 takes INT"):
        import_onnx(model)


def test_external_data_is_not_read_for_a_model_given_as_bytes(tmp_path, monkeypatch) -> None:
    """Was a read of any file relative to the working directory, for a model given as bytes."""
    (tmp_path / "secret.bin").write_bytes(bytes(range(8)))
    monkeypatch.chdir(tmp_path)
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")],
                       [helper.make_tensor_value_info("x", TensorProto.UINT8, [8])],
                       [helper.make_tensor_value_info("y", TensorProto.UINT8, [8])])
    weight = model.graph.initializer.add()
    weight.name, weight.data_type, weight.data_location = "w", TensorProto.UINT8, TensorProto.EXTERNAL
    weight.dims.append(8)
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "secret.bin"
    with pytest.raises(ModelError, match="tensor 'w' keeps its data in the external file 'secret.bin'; "
                                         "external data is read only for a model loaded from its path"):
        import_onnx(model.SerializeToString())
    assert os.path.exists("secret.bin")


def test_a_negative_initializer_dim_is_refused() -> None:
    """Was accepted: NumPy read dims [-1] as 'whatever is left', so data of any length loaded."""
    model = small_cnn_model()
    model.graph.initializer[2].dims[0] = -1  # fc: [5, 4] -> [-1, 4]
    with pytest.raises(ModelError, match=r"initializer 'fc' cannot be read: its dims \[-1, 4\] include "
                                         r"a negative size"):
        import_onnx(model)


def test_a_sparse_constant_with_indices_out_of_range_is_refused() -> None:
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "v")
    indices = numpy_helper.from_array(np.array([1, -1], np.int64), "i")  # NumPy would wrap -1
    const = helper.make_node("Constant", [], ["c"], name="const",
                             sparse_value=helper.make_sparse_tensor(values, indices, [2, 3]))
    model = make_model([const, helper.make_node("Add", ["x", "c"], ["y"], name="add")],
                       [float_input("x", [2, 3])], [float_input("y", [2, 3])])
    with pytest.raises(ModelError, match=r"node 'const' .*indices fall outside its dims \[2, 3\]"):
        import_onnx(model)


def test_a_huge_sparse_constant_is_refused() -> None:
    """A few bytes of sparse tensor must not become gigabytes at import."""
    values = numpy_helper.from_array(np.array([1.0], np.float32), "v")
    indices = numpy_helper.from_array(np.array([0], np.int64), "i")
    const = helper.make_node("Constant", [], ["c"], name="const",
                             sparse_value=helper.make_sparse_tensor(values, indices, [1 << 20, 1 << 20]))
    model = make_model([const, helper.make_node("Add", ["x", "c"], ["y"], name="add")],
                       [float_input("x", [2])], [float_input("y", None)])
    with pytest.raises(ModelError, match="dense form .* would take 4398046511104 bytes"):
        import_onnx(model)


def test_non_positive_dilations_are_refused_as_onnx_runtime_does() -> None:
    """Was a run to some answer; ONNX's own inference function for Conv refuses them, as ORT does."""
    model = small_cnn_model()
    model.graph.node[0].attribute.append(helper.make_attribute("dilations", [-1, 1]))
    with pytest.raises(ModelError, match=r"inference refuses the model: .*node name: conv1\).*"
                                         r"dilations must only contain positive values"):
        import_onnx(model)


def test_an_input_of_an_unknown_element_type_is_named() -> None:
    """Was accepted: the input then took any value unchecked."""
    model = relu_model()
    model.graph.input[0].type.tensor_type.elem_type = 999
    with pytest.raises(ModelError, match="input 'x' has element type 999 \\(not an ONNX element "
                                         "type\\), which backplane cannot read"):
        import_onnx(model)


def test_an_input_without_a_type_is_named() -> None:
    model = relu_model()
    model.graph.input[0].ClearField("type")
    with pytest.raises(ModelError, match="input 'x' has no type"):
        import_onnx(model)


def test_an_opset_past_a_c_int_is_refused() -> None:
    """Was TypeError from onnx.defs.get_schema, which takes a C int."""
    model = relu_model()
    model.graph.node[0].domain = "ai.onnx.ml"
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 1 << 40))
    with pytest.raises(ModelError, match="opset 1099511627776 of domain 'ai.onnx.ml'"):
        import_onnx(model)


def test_a_domain_imported_twice_at_two_opsets_is_refused() -> None:
    model = relu_model()
    model.opset_import.append(helper.make_opsetid("ai.onnx", 13))
    with pytest.raises(ModelError, match="imports domain 'ai.onnx' twice, at opsets 17 and 13"):
        import_onnx(model)


def test_inputs_of_one_type_parameter_must_share_a_type() -> None:
    """Was a run: NumPy promoted a float Gemm input with int32 weights (ONNX Runtime refuses)."""
    model = small_cnn_model()
    fc = model.graph.initializer[2]
    fc.CopyFrom(numpy_helper.from_array(np.ones((5, 4), np.int32), "fc"))
    with pytest.raises(ModelError, match=r"layer 'fc' \(Gemm, opset 17\): type parameter T of Gemm-13 "
                                         r"is bound to tensor\(float\) by input 0 'f' and to "
                                         r"tensor\(int32\) by input 1 'fc'"):
        import_onnx(model)


def test_an_input_of_a_type_the_op_does_not_take_is_named() -> None:
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [helper.make_tensor_value_info("x", TensorProto.BOOL, [2])],
                       [helper.make_tensor_value_info("y", TensorProto.BOOL, [2])])
    with pytest.raises(ModelError, match=r"layer 'relu' \(Relu, opset 17\): input 0 'x' is a "
                                         r"tensor\(bool\); Relu-14 takes .*tensor\(float\)"):
        import_onnx(model)


@pytest.mark.parametrize("value", [2, -1, 2**40])
def test_a_flag_attribute_other_than_0_or_1_is_refused(value: int) -> None:
    """Was a wrong answer: ArgMax with keepdims=2**40 kept the axis (a truthy test), where ONNX
    Runtime reads it as 0 and drops it (found by bench/fuzz_loader.py, seed 7, case 793)."""
    node = helper.make_node("ArgMax", ["x"], ["y"], name="argmax", axis=0, keepdims=value)
    model = make_model([node], [float_input("x", [2, 3])],
                       [helper.make_tensor_value_info("y", TensorProto.INT64, [3])])
    with pytest.raises(ModelError, match=rf"node 'argmax' \(ArgMax, opset 17\): attribute "
                                         rf"'keepdims' is {value}; it is a flag of ArgMax-13: 0 or 1"):
        import_onnx(model)
