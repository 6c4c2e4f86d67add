"""Reading a model: the proto without its large weights, each weight read from the file into an array
of its own (the proto and the arrays never hold a weight twice), and read again by name later."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane.frontends.onnx import ModelError, import_onnx
from backplane.frontends.onnx_file import LARGE_INITIALIZER, read_model
from tests.conftest import float_input, make_model

RNG = np.random.default_rng(0)


def weighted_model() -> onnx.ModelProto:
    """x (2, 64) -> MatMul(w (64, 64)) -> Add(b (64)) -> Mul(s (64, 64), int64 counts cast) ..."""
    w = (RNG.standard_normal((64, 64))).astype(np.float32)
    half = RNG.standard_normal((64, 64)).astype(np.float16)
    b = RNG.standard_normal(64).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Cast", ["half"], ["h"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["a", "h"], ["y"], name="matmul2")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(half, "half")]
    return make_model(nodes, [float_input("x", [2, 64])], [float_input("y", [2, 64])], inits)


def expected(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_a_files_large_weights_are_arrays_apart_from_its_proto(tmp_path: Path) -> None:
    model = weighted_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    read = read_model(path)
    assert sorted(read.arrays) == ["half", "w"]  # b: 64 values, read with the proto
    for init in read.proto.graph.initializer:
        assert init.HasField("raw_data") == (init.name == "b")
    assert read.proto.ByteSize() < 2 * LARGE_INITIALIZER
    for name, array in read.arrays.items():
        want = expected(model)[name]
        assert array.dtype == want.dtype and array.tobytes() == want.tobytes()
        assert array.flags.owndata and array.flags.writeable
    assert read.weights is not None and read.weights.read("w").tobytes() == read.arrays["w"].tobytes()
    arrays = dict(read.arrays)
    graph = import_onnx(read)
    assert not read.arrays  # given to the graph, not copied
    assert all(graph.constants[name] is array for name, array in arrays.items())


def test_bytes_are_read_the_same_way_and_a_modelproto_is_left_as_it_is() -> None:
    model = weighted_model()
    read = read_model(model.SerializeToString())
    assert sorted(read.arrays) == ["half", "w"] and read.weights is None
    for name, array in read.arrays.items():
        assert array.tobytes() == expected(model)[name].tobytes()
    given = read_model(model)
    assert given.proto is model and not given.arrays
    for source in (model, model.SerializeToString()):
        graph = import_onnx(source)
        assert all(graph.constants[n].tobytes() == v.tobytes() for n, v in expected(model).items())


def test_external_weights_are_read_into_arrays_and_again(tmp_path: Path) -> None:
    model = weighted_model()
    want = expected(model)
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="ext.data",
                    size_threshold=1024)  # the model now describes external data
    read = read_model(path)
    assert sorted(read.arrays) == ["half", "w"]
    assert not any(onnx.external_data_helper.uses_external_data(t)
                   for t in read.proto.graph.initializer)
    assert read.weights is not None
    for name in ("half", "w"):
        assert read.arrays[name].tobytes() == want[name].tobytes()
        assert read.weights.read(name).tobytes() == want[name].tobytes()


def test_a_weight_is_not_read_again_from_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(weighted_model(), str(path))
    read = read_model(path)
    assert read.weights is not None
    onnx.save(weighted_model(), str(path))  # other random weights, same layout
    os.utime(path, ns=(0, 0))
    with pytest.raises(ModelError, match="changed since the model was loaded"):
        read.weights.read("w")


def test_a_file_the_walk_cannot_follow_is_parsed_as_before(tmp_path: Path) -> None:
    model = weighted_model()
    twice = model.graph.initializer.add()
    twice.CopyFrom(model.graph.initializer[0])
    path = tmp_path / "twice.onnx"
    onnx.save(model, str(path))
    read = read_model(path)  # whole, by onnx: the importer names the clash
    assert not read.arrays and len(read.proto.graph.initializer) == 4
    with pytest.raises(ModelError, match="'w' is defined twice"):
        import_onnx(path)
