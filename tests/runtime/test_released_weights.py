"""After a load, each weight has one owner: the workload that reads it, or the layout a backend made of
it (``backplane.optimizer.release``). Checked by who refers to the arrays and by weak references, not
by the process's resident memory; and what needs the weights after a load still has them: a graph's
constant read again from the file, a second load, compiling, the compile cache."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import backplane
from backplane import InferenceSession, Runtime, SessionOptions
from backplane.optimizer.release import Released, ReleasedConstants
from tests.conftest import float_input, inner_workloads, make_model

RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 4, 128)).astype(np.float32)
WEIGHTS = {"w1": (128, 256), "w2": (256, 128)}  # 128 KiB each: past what a release keeps


def mlp_model() -> onnx.ModelProto:
    """x (1, 4, 128) -> MatMul(w1) -> Add(b1) -> Relu -> MatMul(w2) -> Add(b2): two Linears on CpuAcc."""
    inits = [numpy_helper.from_array((RNG.standard_normal(shape) * 0.1).astype(np.float32), name)
             for name, shape in WEIGHTS.items()]
    inits += [numpy_helper.from_array(RNG.standard_normal(n).astype(np.float32), name)
              for name, n in (("b1", 256), ("b2", 128))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="matmul1"),
             helper.make_node("Add", ["m1", "b1"], ["a1"], name="add1"),
             helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="matmul2"),
             helper.make_node("Add", ["m2", "b2"], ["y"], name="add2")]
    return make_model(nodes, [float_input("x", [1, 4, 128])], [float_input("y", [1, 4, 128])],
                      inits)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    file = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(file))
    return file


def holders(value: np.ndarray) -> int:
    """How many references hold ``value`` beside the caller's own name (a weak one does not; the
    garbage collector's referrers miss a dict that holds arrays alone, so they are counted)."""
    gc.collect()
    return sys.getrefcount(value) - 3  # the caller's name, this argument, getrefcount's argument


def stored(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("keep", [False, True])
def test_on_cpuref_the_loaded_network_alone_holds_each_weight(path: Path, keep: bool) -> None:
    session = InferenceSession(path, ["CpuRef"], SessionOptions(keep_initializers=keep))
    template = session.runtime.network(session.network_id)._template
    for name in WEIGHTS:
        value = session.graph.constants[name]
        assert any(slot is value for slot in template)
        # kept: the imported graph's constants and the optimized graph's hold it too
        assert holders(value) == (3 if keep else 1)


def test_a_weight_cpuacc_packs_is_freed_and_read_again_from_the_file(path: Path) -> None:
    pytest.importorskip("torch")
    session = InferenceSession(path, [("CpuAcc", {"linear_route": "onednn"})])
    constants = session.optimized.graph.constants
    assert isinstance(constants, ReleasedConstants)
    gc.collect()
    # oneDNN reads its packed weights: nothing holds the model's any more
    assert not {"w1", "w2"} & set(constants.held())
    assert [w.weights[0].is_mkldnn for w in inner_workloads(session, "Linear")] == [True, True]
    for layer in session.optimized.graph.layers:
        if layer.op_type == "Linear":
            assert isinstance(layer.attrs["weight"], Released)
    file = stored(path)
    for name in WEIGHTS:  # read again from the file, where asked
        assert constants[name].tobytes() == file[name].tobytes()
        assert session.graph.constants[name] is constants[name]  # once read, while held
    kept = InferenceSession(path, [("CpuAcc", {"linear_route": "onednn"})],
                            SessionOptions(keep_initializers=True))
    assert kept.run(None, {"x": X})[0].tobytes() == session.run(None, {"x": X})[0].tobytes()
    assert {"w1", "w2"} <= set(kept.optimized.graph.constants)
    (linear, *_) = [lay for lay in kept.optimized.graph.layers if lay.op_type == "Linear"]
    assert isinstance(linear.attrs["weight"], np.ndarray)


def test_a_released_network_loads_again_from_its_file(path: Path) -> None:
    backends = ["CpuAcc", "CpuRef"] if _has_torch() else ["CpuRef"]
    session = InferenceSession(path, backends)
    assert session.optimized.released
    expected = session.run(None, {"x": X})[0]
    again = session.runtime.load(session.optimized)
    assert session.runtime.run(again, {"x": X})[0].tobytes() == expected.tobytes()
    network = dataclasses.replace(session.optimized, remake=None)
    with pytest.raises(ValueError, match="released after its load"):
        Runtime().load(network)
    onnx.save(mlp_model(), str(path))  # other weights under the same names
    os.utime(path, ns=(0, 0))  # a time of its own, also where the clock is coarse
    with pytest.raises(backplane.ModelError, match="changed since the model was loaded from it"):
        session.runtime.load(session.optimized)
    assert session.run(None, {"x": X})[0].tobytes() == expected.tobytes()  # its own, loaded


@pytest.mark.parametrize("backends", [["CpuRef"], ["CpuAcc", "CpuRef"]])
def test_compiling_and_the_compile_cache_work_after_a_released_load(path: Path, tmp_path: Path,
                                                                    backends: list[str]) -> None:
    """CpuRef bit for bit; CpuAcc measures its routes again in the compile cache's folder, so its
    last bits may differ with the routes it picks."""
    if "CpuAcc" in backends and not _has_torch():
        pytest.skip("CpuAcc needs torch")
    session = InferenceSession(path, backends)
    expected = session.run(None, {"x": X})[0]
    backplane.compile(path, backends, tmp_path / "mlp.bpl")
    compiled = InferenceSession(tmp_path / "mlp.bpl")
    cached = InferenceSession(path, backends, cache_dir=tmp_path / "cache")
    for other in (compiled, cached, session):
        got = other.run(None, {"x": X})[0]
        if backends == ["CpuRef"]:
            assert got.tobytes() == expected.tobytes()
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_model_given_in_memory_keeps_its_weights() -> None:
    """Bytes or a ModelProto: no file to read a weight again from, so nothing is released."""
    model = mlp_model()
    for given in (model, model.SerializeToString()):
        session = InferenceSession(given, ["CpuRef"])
        assert not session.optimized.released
        assert type(session.graph.constants) is dict


def test_a_released_network_prints_and_reports_as_before(path: Path) -> None:
    released = InferenceSession(path, ["CpuRef"])
    kept = InferenceSession(path, ["CpuRef"], SessionOptions(keep_initializers=True))
    assert repr(released.optimized.graph) == repr(kept.optimized.graph)
    assert released.report.counts() == kept.report.counts()
    assert released.report.constant_bytes == kept.report.constant_bytes
    assert [n.shape for n in released.get_inputs()] == [[1, 4, 128]]


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def if_model() -> onnx.ModelProto:
    """y = If(c) then MatMul(x, w) else MatMul(x, w) * 2: a large weight both branches capture."""
    w = numpy_helper.from_array((RNG.standard_normal((128, 256)) * 0.1).astype(np.float32), "w")
    two = numpy_helper.from_array(np.float32(2), "two")
    then = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["t"], name="then_mm")],
                             "then", [], [float_input("t", [1, 4, 256])])
    other = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["e0"], name="else_mm"),
                               helper.make_node("Mul", ["e0", "two"], ["e"], name="else_mul")],
                              "else", [], [float_input("e", [1, 4, 256])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)]
    inputs = [float_input("x", [1, 4, 128]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])]
    return make_model(nodes, inputs, [float_input("y", [1, 4, 256])], [w, two])


@pytest.mark.parametrize("backends", [["CpuRef"], ["CpuAcc", "CpuRef"]])
def test_control_flow_bodies_run_as_before_after_the_release(tmp_path: Path,
                                                              backends: list[str]) -> None:
    if "CpuAcc" in backends and not _has_torch():
        pytest.skip("CpuAcc needs torch")
    path = tmp_path / "if.onnx"
    onnx.save(if_model(), str(path))
    released = InferenceSession(path, backends)
    kept = InferenceSession(path, backends, SessionOptions(keep_initializers=True))
    assert released.optimized.released
    for c in (True, False):
        feeds = {"x": X, "c": np.array(c)}
        assert released.run(None, feeds)[0].tobytes() == kept.run(None, feeds)[0].tobytes()
