"""Sizes that come from data are checked before anything is allocated, at constant folding and at
run time, and a long chain of layers loads without recursion."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import ExecutionError, InferenceSession
from backplane.backends.api.memory import LIMIT_VARIABLE
from tests.conftest import host_backend_lists, make_model


def constant_of_shape_model(shape: list[int]):
    size = numpy_helper.from_array(np.array(shape, np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="huge"),
             helper.make_node("Add", ["x", "big"], ["y"], name="add")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [size])


@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
def test_four_terabytes_of_constant_load_and_fail_naming_the_layer_and_the_size(backends) -> None:
    """Folding computed it (NumPy's MemoryError out of the optimizer); now the inferred size keeps
    it out of folding, and the run says which layer asked for how much."""
    session = InferenceSession(constant_of_shape_model([100000, 100000, 100]), backends)
    assert session.report.layers["huge"].backend == backends[0]
    with pytest.raises(ExecutionError, match=r"layer 'huge' \(ConstantOfShape.*\(100000, 100000, "
                                             r"100\) and type float32 would take 3.638 TiB"):
        session.run(None, {"x": np.ones(1, np.float32)})


@pytest.mark.parametrize("op, inputs, out", [
    ("Expand", [np.ones((1, 4), np.float32), np.array([1024, 4], np.int64)], (1024, 4)),
    ("Tile", [np.ones((2, 4), np.float32), np.array([512, 1], np.int64)], (1024, 4)),
    ("Range", [np.array(0, np.float32), np.array(4096, np.float32), np.array(1, np.float32)], (4096,)),
    ("Pad", [np.ones((2, 4), np.float32), np.array([0, 0, 1022, 0], np.int64)], (1024, 4)),
    ("ConstantOfShape", [np.array([1024, 4], np.int64)], (1024, 4)),
])
@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
def test_the_limit_can_be_set_and_names_the_op(op, inputs, out, backends, monkeypatch) -> None:
    """16 KiB outputs against a limit of 8 KiB (``$BACKPLANE_MAX_TENSOR_BYTES``); the inputs come
    from the user, so the size is known only at run time."""
    names = [f"i{k}" for k in range(len(inputs))]
    infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
             for n, v in zip(names, inputs)]
    model = make_model([helper.make_node(op, names, ["y"], name="grow")], infos,
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    session = InferenceSession(model, backends)
    assert session.report.layers["grow"].backend == backends[0]
    feeds = dict(zip(names, inputs))
    assert session.run(None, feeds)[0].shape == out
    monkeypatch.setenv(LIMIT_VARIABLE, str(8 << 10))
    with pytest.raises(ExecutionError, match=rf"layer 'grow' \({op}.*{op}'s output of shape "
                                             rf".* would take (16|32) KiB; the limit is 8 KiB"):
        session.run(None, feeds)


def test_a_chain_of_twenty_thousand_layers_loads_and_runs() -> None:
    n = 20000
    nodes = [helper.make_node("Relu" if i % 2 else "Neg", [f"t{i}"], [f"t{i + 1}"], name=f"n{i}")
             for i in range(n)]
    model = make_model(nodes, [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [4])],
                       [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [4])])
    x = np.array([-2, -1, 1, 2], np.float32)
    (y,) = InferenceSession(model, ["CpuRef"]).run(None, {"t0": x})
    np.testing.assert_array_equal(y, [0, 0, 0, 0])  # Relu(Neg(Relu(Neg(x)))) is 0 for every x
