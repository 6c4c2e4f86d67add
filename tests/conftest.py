"""Shared test fixtures: small graphs built with onnx.helper, and partial backends for placement."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backplane.backends.api.backend import Backend, Support, unsupported
from backplane.backends.api.memory import MemorySource, TensorHandleFactory
from backplane.backends.registry import registry
from backplane.backends.reference.kernels import KERNELS as REF_KERNELS
from backplane.ir.graph import Layer, TensorInfo

PARTIAL_OPS = ("Conv", "Relu", "Add", "MatMul", "Gemm", "Mul")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``python -m pytest`` with no paths and no ``-m`` leaves the tests marked ``slow`` (the long
    conformance and fuzz sweeps) out; ``-m slow`` runs them, as .ci/run does after the README's
    command. Naming a file or folder, or any ``-m``, selects as pytest always does."""
    if config.option.markexpr or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True, scope="session")
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Caches the tests fill (CpuAcc's measured routes) go to a folder of the test session's."""
    import os

    from backplane.backends.torch.route_cache import CACHE_VARIABLE

    before = os.environ.get(CACHE_VARIABLE)
    os.environ[CACHE_VARIABLE] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_VARIABLE, None)
    else:
        os.environ[CACHE_VARIABLE] = before


@pytest.fixture(autouse=True, scope="session")
def gpu_placements_untimed() -> Iterator[None]:
    """Placements are what the preferences give: the GPU tests test GpuAcc where they place it,
    and the CpuAcc tests CpuAcc on control flow, not the placement without it that
    ``backplane.against_cpu`` keeps for a small model where that is faster (both of its rules;
    tests/runtime/test_against_cpu.py and test_against_cpuref.py give the options themselves)."""
    from backplane import against_cpu

    before, against_cpu.DEFAULT = against_cpu.DEFAULT, "off"
    yield
    against_cpu.DEFAULT = before


@pytest.fixture(autouse=True, scope="session")
def loads_measure_on_busy_machines() -> Iterator[None]:
    """CpuAcc measures its routes and compiles its subgraphs whatever the load average (the tests
    test those; xdist's workers alone keep a 2-core machine busy); tests/backends/torch/
    test_crowded.py tests the busy machine's defaults."""
    from backplane.backends.torch import threads

    before, threads.CROWDED_CHECK = threads.CROWDED_CHECK, False
    yield
    threads.CROWDED_CHECK = before


@pytest.fixture(autouse=True, scope="session")
def loads_measure_at_load() -> Iterator[None]:
    """CpuAcc measures and compiles at load, not in the background (``CpuAcc.background``): the
    tests check what a load chose; tests/backends/torch/test_background.py tests the background."""
    from backplane.backends.torch import background  # imports no torch

    before, background.DEFAULT = background.DEFAULT, False
    yield
    background.DEFAULT = before


@pytest.fixture(autouse=True, scope="session")
def no_inductor_in_the_background() -> Iterator[None]:
    """No load starts a TorchInductor compile in the background (``CpuAcc.inductor``: a minute of
    both CPUs a subgraph); tests/backends/torch/test_inductor_background.py asks for it."""
    from backplane.backends.torch import inductor_background  # imports no torch

    before, inductor_background.DEFAULT = inductor_background.DEFAULT, "off"
    yield
    inductor_background.DEFAULT = before


@pytest.fixture(autouse=True, scope="session")
def default_sessions_load_at_once() -> Iterator[None]:
    """A session given no backends loads CpuAcc before it returns, whether or not the test's process
    has imported torch yet (``backplane.deferred_load``): what a test sees does not depend on the
    tests that ran before it in its worker; tests/test_deferred_load.py tests the deferred load."""
    from backplane import deferred_load

    before, deferred_load.DEFAULT = deferred_load.DEFAULT, False
    yield
    deferred_load.DEFAULT = before


class PartialBackend(Backend):
    """A backend with CpuRef's kernels for a few ops only, sharing host memory with CpuRef."""

    id = "TestPartial"
    version = "0.1.0"
    KERNELS = {op: REF_KERNELS[op] for op in PARTIAL_OPS if op in REF_KERNELS}

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        if layer.op_type not in self.KERNELS:
            return unsupported(f"{layer.op_type} is not one of {', '.join(self.KERNELS)}")
        return super().is_layer_supported(layer, inputs, outputs)


PRIVATE_FACTORY = TensorHandleFactory("test-private", MemorySource.BACKEND)


class PrivateMemoryBackend(PartialBackend):
    """The same, but its tensors live in memory of its own: crossing to it needs a copy."""

    id = "TestPrivate"

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (PRIVATE_FACTORY,)


@pytest.fixture
def partial_backends() -> Iterator[None]:
    with registry.temporarily(PartialBackend.id, PartialBackend), \
            registry.temporarily(PrivateMemoryBackend.id, PrivateMemoryBackend):
        yield


def make_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
               outputs: list[onnx.ValueInfoProto], initializers: Sequence[onnx.TensorProto] = (),
               opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def float_input(name: str, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                         None if shape is None else list(shape))


def small_cnn_model(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Add(skip) -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> Softmax."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3
    fc = rng.standard_normal((5, 4)).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (fc, "fc"))]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s"], name="skip"),
        helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1),
    ]
    return make_model(nodes, [float_input("x", [1, 3, 8, 8])], [float_input("probs", [1, 5])], inits)


def inner_workloads(session: Any, op_type: str) -> list:
    """The workloads of a session's ``op_type`` layers, those inside a layer that holds layers (a
    OneDnnGraph run layer by layer, a Specialized layer) too."""
    loaded = session.runtime.network(session.network_id)
    found = []
    for step, layer in zip(loaded.steps, loaded.layers):
        pairs = getattr(step.workload, "inner", [(layer, step.workload)])
        found += [workload for lay, workload in pairs if lay.op_type == op_type]
    return found


def host_backend_lists() -> list[list[str]]:
    """CpuRef, and CpuAcc before CpuRef where torch is installed: the host backends a test of a
    CpuRef rule holds CpuAcc to as well."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return [["CpuRef"]]
    return [["CpuRef"], ["CpuAcc", "CpuRef"]]

