"""A delegate that fails at load or at run is named by the model's nodes it runs: its debug handles
(ExecuTorch's ``PreprocessResult.debug_handle_map``), read back into the error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import backplane
from backplane import ExecutionError, InferenceSession
from backplane.backends.api.backend import PreprocessResult, WorkloadFactory
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import BackendRegistry
from backplane.ir.graph import Graph, Layer

NODES = ["first_relu", "the_add", "last_mul"]


class Handles(CpuRef):
    """A plugin delegate: its blob is the partition's node names, in handles of two nodes; init
    or execute raises where the test says so (a driver's error, say)."""

    id = "Handles"
    FAIL: ClassVar[dict[str, bool]] = {"init": False, "execute": False}
    MAP: ClassVar[bool] = True

    def preprocess(self, graph: Graph, compile_specs: Any) -> PreprocessResult:
        names = [layer.name for layer in graph.layers]
        handles = {f"kernel{i // 2}": names[i:i + 2] for i in range(0, len(names), 2)}
        return PreprocessResult(json.dumps(names).encode(), handles if self.MAP else {})

    def init(self, processed: Any, compile_specs: Any, context: Any) -> Any:
        if self.FAIL["init"]:
            raise RuntimeError("the driver refused the blob")
        return context.graph

    def execute(self, handle: Any, *inputs: Any) -> tuple[Any, ...]:
        if self.FAIL["execute"]:
            raise RuntimeError("the device reported a fault")
        x, = inputs
        y = np.maximum(x, 0) + np.float32(1)
        return (y * np.float32(2),)


@pytest.fixture
def artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, BackendRegistry]:
    monkeypatch.setattr(Handles, "FAIL", {"init": False, "execute": False})
    return _compiled(tmp_path)


def _compiled(tmp_path: Path) -> tuple[Path, BackendRegistry]:
    """x -> first_relu -> the_add -> last_mul -> y, compiled for Handles into one delegate."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name=NODES[0]),
                               helper.make_node("Add", ["r", "one"], ["a"], name=NODES[1]),
                               helper.make_node("Mul", ["a", "two"], ["y"], name=NODES[2])],
                              "three", [x], [y], [one, two])
    model = tmp_path / "three.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    registry = BackendRegistry()
    registry.register(Handles.id, Handles)
    path = tmp_path / "three.bpl"
    backplane.artifact.build(model, path, [Handles.id], {},
                             runtime=backplane.Runtime(registry=registry))
    return path, registry


def _session(artifact: tuple[Path, BackendRegistry]) -> InferenceSession:
    path, registry = artifact
    return InferenceSession(path, runtime=backplane.Runtime(registry=registry))


def test_a_delegate_that_fails_at_run_names_its_nodes(
        artifact: tuple[Path, BackendRegistry], monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's PreprocessResult carries ``debug_handle_map: Optional[Union[Dict[int,
    Tuple[int]], Dict[str, Tuple[int]]]]``, each handle inside the blob to the nodes it holds;
    the error of a delegate's ``execute`` names those nodes."""
    session = _session(artifact)
    x = np.array([[-1, 0, 1], [2, -3, 4]], np.float32)
    assert session.run(None, {"x": x})[0].tolist() == ((np.maximum(x, 0) + 1) * 2).tolist()
    monkeypatch.setattr(Handles, "FAIL", {"init": False, "execute": True})
    with pytest.raises(ExecutionError) as caught:
        session.run(None, {"x": x})
    message = str(caught.value)
    assert "running model nodes first_relu, the_add, last_mul" in message
    assert "the device reported a fault" in message


def test_a_delegate_that_fails_at_load_names_its_nodes(
        artifact: tuple[Path, BackendRegistry], monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's ``init`` turns the blob into a handle at load; when it fails, the error names
    the model's nodes of the partition it was given (an artifact has no model to fall back on)."""
    monkeypatch.setattr(Handles, "FAIL", {"init": True, "execute": False})
    with pytest.raises(Exception, match="the driver refused the blob") as caught:
        _session(artifact)
    assert "running model nodes first_relu, the_add, last_mul" in str(caught.value)
    assert "Handles could not create a workload" in str(caught.value)


def test_without_a_map_the_partitions_layers_are_named(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A preprocess that gives no debug handles: the delegate's stored partition names them."""
    monkeypatch.setattr(Handles, "MAP", False)
    monkeypatch.setattr(Handles, "FAIL", {"init": True, "execute": False})
    with pytest.raises(Exception, match="the driver refused the blob") as caught:
        _session(_compiled(tmp_path))
    assert "running model nodes first_relu, the_add, last_mul)" in str(caught.value)


def test_a_plain_layer_is_described_as_before() -> None:
    layer = Layer("relu", "Relu", ["x"], ["y"], opset=14)
    assert layer.describe() == "layer 'relu' (Relu, opset 14)"
    big = Layer("d", "Delegate", [], [], {"debug_handle_map": {
        f"h{i}": [f"n{i}"] for i in range(20)}}, "backplane.delegate")
    assert big.describe().endswith("n10, n11 and 8 more)")


class Fuser(CpuRef):
    """A plugin that substitutes its whole partition by one layer holding the nodes' names
    (``attrs["layers"]``, as OpenVINO's compiled partitions keep them); its workload raises."""

    id = "Fuser"

    def optimize_subgraph(self, view: Any) -> OptimizationViews:
        fused = Layer("fused", "Fused", list(view.inputs), list(view.outputs),
                      {"layers": [layer.name for layer in view.layers]}, "fuser", 1)
        return OptimizationViews(substitutions=[Substitution(view, [fused])])

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return FuserFactory(self, memory_manager)


class FuserFactory(WorkloadFactory):
    def create_workload(self, layer: Layer, inputs: Any, outputs: Any) -> Any:
        def run(*values: Any) -> tuple[Any, ...]:
            raise RuntimeError("the fused kernel overflowed")

        return run if layer.domain == "fuser" else super().create_workload(layer, inputs, outputs)


def test_a_substituted_layer_that_fails_at_run_names_its_nodes(
        artifact: tuple[Path, BackendRegistry]) -> None:
    registry = BackendRegistry()
    registry.register(Fuser.id, Fuser)
    model = artifact[0].with_suffix(".onnx")
    session = InferenceSession(model, [Fuser.id], runtime=backplane.Runtime(registry=registry))
    with pytest.raises(ExecutionError, match="the fused kernel overflowed") as caught:
        session.run(None, {"x": np.ones((2, 3), np.float32)})
    assert "layer 'fused' (fuser::Fused, opset 1, running model nodes first_relu, the_add, " \
           "last_mul) failed on Fuser" in str(caught.value)
