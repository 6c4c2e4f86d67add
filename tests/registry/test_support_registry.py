"""The support registry: layer-support objects by backend id (seed 001's LayerSupportRegistry)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from backplane.backends.api.backend import SUPPORTED, Backend, Support, unsupported
from backplane.backends.openvino.backend import OpenVINO
from backplane.backends.registry import BackendRegistry, UnknownBackendError
from backplane.backends.registry.support import SupportRegistry, bundled
from backplane.backends.torch.backend import CpuAcc
from backplane.ir.graph import Layer, TensorInfo

F32 = TensorInfo((2, 3), np.dtype("float32"))
F64 = TensorInfo((2, 3), np.dtype("float64"))
LAYERS = [(Layer("relu", "Relu", ["x"], ["y"], opset=17), [F32], [F32]),
          (Layer("relu64", "Relu", ["x"], ["y"], opset=17), [F64], [F64]),
          (Layer("foo", "Foo", ["x"], ["y"], opset=17), [F32], [F32]),
          (Layer("soft", "Softmax", ["x"], ["y"], {"axis": 1}, opset=13), [F32], [F32]),
          (Layer("bad", "Relu", ["x"], ["y"], {"alpha": 1.0}, opset=17), [F32], [F32])]


@pytest.fixture
def constructions(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many CpuAcc and OpenVINO backends get made (by anyone) while the test runs."""
    made = {"CpuAcc": 0, "OpenVINO": 0}
    for cls in (CpuAcc, OpenVINO):
        original = cls.__init__

        def counted(self: Backend, _original=original) -> None:  # type: ignore[no-untyped-def]
            made[type(self).id] += 1
            _original(self)

        monkeypatch.setattr(cls, "__init__", counted)
    return made


@pytest.mark.parametrize("backend_id", ["CpuAcc", "OpenVINO"])
def test_a_support_query_makes_no_backend(backend_id: str, constructions: dict[str, int]) -> None:
    """Seed 001: "the backends need to register a factory function that can create an object that
    implements the ILayerSupport interface. When ArmNN needs to decide if a layer is supported on a
    backend, it looks up the factory function through the registry. Then it creates an
    ILayerSupport object for the given backend and calls the corresponding API function"."""
    if backend_id == "OpenVINO" and importlib.util.find_spec("openvino") is None:
        pytest.skip("OpenVINO is not installed (the GPU machine): every answer is 'absent'")
    supports = bundled(BackendRegistry())  # a backend registry without CpuAcc or OpenVINO
    answers = [supports.is_layer_supported(backend_id, layer, ins, outs)
               for layer, ins, outs in LAYERS]
    assert constructions == {"CpuAcc": 0, "OpenVINO": 0}
    backend = CpuAcc() if backend_id == "CpuAcc" else OpenVINO()  # the same check, on a backend
    assert answers == [backend.is_layer_supported(layer, ins, outs) for layer, ins, outs in LAYERS]
    assert answers[0].ok and not answers[2].ok  # the check decides
    assert "Foo" in answers[2].reason


def test_a_plugin_registers_its_layer_support() -> None:
    """A plugin's layer support answers for its id; its backend is never made for a query."""
    made = []

    class Npu(Backend):
        id = "Npu"

        def __init__(self) -> None:
            made.append(self)

    class NpuSupport:
        id = "Npu"

        def is_layer_supported(self, layer, inputs, outputs):  # type: ignore[no-untyped-def]
            return SUPPORTED if layer.op_type == "Relu" else unsupported("the NPU runs Relu only")

    backends = BackendRegistry()
    backends.register("Npu", Npu)
    supports = SupportRegistry(backends)
    supports.register("Npu", NpuSupport)
    relu, foo = LAYERS[0], LAYERS[2]
    assert supports.is_layer_supported("Npu", *relu) == SUPPORTED
    assert supports.is_layer_supported("Npu", *foo) == Support(False, "the NPU runs Relu only")
    assert made == []
    with pytest.raises(ValueError, match="already registered"):
        supports.register("Npu", NpuSupport)


def test_an_id_without_layer_support_is_answered_by_its_backend() -> None:
    """A backend is its own layer support: made once, for every later query."""
    made = []

    class Npu(Backend):
        id = "Npu"
        KERNELS = {"Relu": {1: lambda x: (np.maximum(x, 0),)}}

        def __init__(self) -> None:
            made.append(self)

    backends = BackendRegistry()
    backends.register("Npu", Npu)
    supports = SupportRegistry(backends)
    answers = [supports.is_layer_supported("Npu", *case) for case in LAYERS[:3]]
    assert [a.ok for a in answers] == [True, True, False]
    assert len(made) == 1
    with pytest.raises(UnknownBackendError, match="Known backends are: Npu"):
        supports.support("Nup")


def test_a_support_object_that_raises_is_a_refusal_naming_it() -> None:
    class Broken:
        id = "Broken"

        def is_layer_supported(self, layer, inputs, outputs):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    supports = SupportRegistry(BackendRegistry())
    supports.register("Broken", Broken)
    answer = supports.is_layer_supported("Broken", *LAYERS[0])
    assert not answer.ok and "Broken.is_layer_supported raised RuntimeError: boom" in answer.reason
    supports.deregister("Broken")
    with pytest.raises(KeyError, match="no layer support registered for backend id 'Broken'"):
        supports.deregister("Broken")


@pytest.mark.parametrize("backend_id", ["CpuRef", "CpuAcc", "GpuAcc", "OpenVINO"])
def test_the_layer_support_answers_as_the_backend_over_real_models(backend_id: str) -> None:
    """Every layer of tiny_bert and tiny_mobilenet_v3, and again with its float32 inputs as
    float64: the registered layer support and the backend give the same answer."""
    from backplane.backends.api.backend import support_of
    from backplane.backends.registry import registry
    from backplane.frontends.onnx import import_onnx

    supports, backend = bundled(BackendRegistry()), registry.create(backend_id)
    asked = 0
    for name in ("tiny_bert", "tiny_mobilenet_v3"):
        graph = import_onnx(Path(__file__).parents[1] / "data" / f"{name}.onnx")
        for layer in graph.layers:
            ins = [graph.info(n) for n in layer.inputs if n]
            outs = [graph.info(n) for n in layer.outputs if n]
            wide = [TensorInfo(i.shape, np.dtype("float64")) if i.dtype == np.float32 else i
                    for i in ins]
            for case in (ins, wide):
                answer = supports.is_layer_supported(backend_id, layer, case, outs)
                assert answer == support_of(backend, layer, case, outs), layer.describe()
                asked += 1
    assert asked > 300
