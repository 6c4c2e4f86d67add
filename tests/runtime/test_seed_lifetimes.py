"""Issue 30, item 4: lifetimes. Backend contexts made with the Runtime, memory held from a
network's load to its unload, dynamic backends counted per Runtime and gone with the last, and a
backend's destroy hook. Each test quotes the seed's sentence it checks."""

from __future__ import annotations

import builtins
import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession, Runtime, RuntimeOptions, import_onnx, optimize
from backplane.backends.api.backend import BackendContext
from backplane.backends.api.memory import MemoryManager
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import BackendRegistry, UnknownBackendError, registry
from backplane.runtime.loaded_network import LoadedNetwork
from tests.conftest import small_cnn_model

X = np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype(np.float32)
EVENTS: list[str] = []


class Context(BackendContext):
    def before_load_network(self, network_id: int) -> None:
        EVENTS.append(f"before_load {network_id}")


class Memory(MemoryManager):
    def acquire(self) -> None:
        EVENTS.append("acquire")

    def release(self) -> None:
        EVENTS.append("release")


class Lived(CpuRef):
    id = "TestLived"

    def create_backend_context(self, options):
        EVENTS.append("context")
        return Context()

    def create_memory_manager(self):
        return Memory()


@pytest.fixture
def lived():
    EVENTS.clear()
    with registry.temporarily(Lived.id, Lived):
        yield


def test_contexts_are_made_when_the_runtime_is_created(lived: None) -> None:
    """Seed 000: 'When the Runtime is initialized it creates an optional IBackendContext object
    and keeps this context alive for the Runtime's lifetime.'"""
    runtime = Runtime(RuntimeOptions(backends=[Lived.id, "CpuRef"]))
    assert EVENTS == ["context"] and Lived.id in runtime.contexts
    network_id = runtime.load(optimize(import_onnx(small_cnn_model()), [Lived.id]))
    assert EVENTS == ["context", f"before_load {network_id}", "acquire"]  # made once, not again
    runtime.close()


def test_a_runtime_that_names_no_backends_makes_their_contexts_at_the_first_load(
        lived: None) -> None:
    """Deviation from seed 000's "When the Runtime is initialized it creates an optional
    IBackendContext object": a runtime that names no backends makes each one's context at its
    first load (making every registered backend's at creation imports torch and OpenVINO: 2.5-7.7 s
    against 0.07 ms for a bare Runtime, docs/architecture.md)."""
    runtime = Runtime()
    assert EVENTS == [] and not runtime.contexts
    runtime.load(optimize(import_onnx(small_cnn_model()), [Lived.id]))
    assert EVENTS[0] == "context" and Lived.id in runtime.contexts


@pytest.mark.parametrize("code", [
    "Runtime(RuntimeOptions(backends=['CpuRef']))",
    "InferenceSession(small_cnn_model(), ['CpuRef']).run(None, {'x': X})",
])
def test_contexts_import_no_torch_where_no_backend_uses_it(code: str) -> None:
    script = textwrap.dedent(f"""\
        import sys
        import numpy as np
        from backplane import InferenceSession, Runtime, RuntimeOptions
        from tests.conftest import small_cnn_model
        X = np.zeros((1, 3, 8, 8), np.float32)
        {code}
        print('torch' in sys.modules, 'openvino' in sys.modules)
        """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=root, check=True).stdout
    assert out.split() == ["False", "False"]


def test_memory_is_acquired_at_load_and_released_at_unload_not_per_run(lived: None) -> None:
    """Seed 000: 'the LoadedNetwork calls Acquire() on the memory manager before it starts
    executing the network and it calls Release() in its destructor'."""
    runtime = Runtime()
    network_id = runtime.load(optimize(import_onnx(small_cnn_model()), [Lived.id]))
    for _ in range(3):
        runtime.run(network_id, {"x": X})
        runtime.run_profiled(network_id, {"x": X})
    assert EVENTS.count("acquire") == 1 and "release" not in EVENTS
    runtime.unload(network_id)
    assert EVENTS[-1] == "release" and EVENTS.count("release") == 1


def test_a_loaded_network_dropped_without_unload_releases_its_memory(lived: None) -> None:
    """'... and it calls Release() in its destructor': the finalizer, where no one unloads."""
    network = optimize(import_onnx(small_cnn_model()), [Lived.id])
    loaded = LoadedNetwork(network, 7)
    loaded.execute([X])
    assert EVENTS == ["acquire"]
    del loaded
    gc.collect()
    assert EVENTS == ["acquire", "release"]


def test_closing_a_runtime_unloads_its_networks_and_it_loads_no_more(lived: None) -> None:
    with Runtime() as runtime:
        runtime.load(optimize(import_onnx(small_cnn_model()), [Lived.id]))
    assert EVENTS[-1] == "release"
    with pytest.raises(RuntimeError, match="this Runtime is closed"):
        runtime.load(optimize(import_onnx(small_cnn_model()), ["CpuRef"]))


DYNAMIC = """\
import numpy as np
from backplane import Backend

class Dyn(Backend):
    id = "AcmeLife"
    KERNELS = {"Relu": {6: lambda x: (np.maximum(x, 0),)}}

    def create_backend_context(self, options):
        import builtins
        builtins.ACME_LIFE_CONTEXTS += 1

def get_backend_id():
    return "AcmeLife"

def get_version():
    return (1, 0)

def backend_factory():
    return Dyn()

def backend_destroy():
    import builtins
    builtins.ACME_LIFE_DESTROYED = getattr(builtins, "ACME_LIFE_DESTROYED", 0) + 1
"""


@pytest.fixture
def dynamic_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import builtins

    (tmp_path / "Acme_Life_backend.py").write_text(DYNAMIC)
    monkeypatch.delenv("BACKPLANE_DYNAMIC_BACKEND_PATHS", raising=False)
    monkeypatch.setattr(builtins, "ACME_LIFE_DESTROYED", 0, raising=False)
    monkeypatch.setattr(builtins, "ACME_LIFE_CONTEXTS", 0, raising=False)
    return tmp_path


def _destroyed() -> int:
    import builtins

    return builtins.ACME_LIFE_DESTROYED  # type: ignore[attr-defined]


def _fresh() -> BackendRegistry:
    fresh = BackendRegistry()
    fresh.register("CpuRef", CpuRef)
    return fresh


def test_dynamic_backends_are_counted_per_runtime_and_go_with_the_last(dynamic_path: Path) -> None:
    """Seed 000: 'Dynamic backends are registered during the runtime creation.' and 'At the end of
    test, the runtime object goes out of scope and the dynamic backend instance is automatically
    destroyed, and the handle to the shared object is closed.'"""
    fresh = _fresh()
    options = RuntimeOptions(dynamic_backends_path=str(dynamic_path))
    first, second = Runtime(options, registry=fresh), Runtime(options, registry=fresh)
    assert fresh.held("AcmeLife") == 2
    assert builtins.ACME_LIFE_CONTEXTS == 2  # type: ignore[attr-defined]  # one per runtime, now
    session = InferenceSession(small_cnn_model(), ["AcmeLife", "CpuRef"], runtime=second)
    assert builtins.ACME_LIFE_CONTEXTS == 2  # type: ignore[attr-defined]  # not again at load
    expected = InferenceSession(small_cnn_model(), ["CpuRef"]).run(None, {"x": X})[0]
    first.close()
    assert fresh.is_registered("AcmeLife") and _destroyed() == 0  # the second still holds it
    assert "AcmeLife" in session.report.counts()
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], expected)
    del session, second  # dropped, not closed: its finalizer lets go
    gc.collect()
    assert not fresh.is_registered("AcmeLife") and _destroyed() == 1
    Runtime(registry=fresh)  # a later Runtime without the path no longer sees it
    with pytest.raises(UnknownBackendError, match="unknown backend 'AcmeLife'"):
        fresh.create("AcmeLife")


def test_a_runtime_created_again_with_the_path_loads_the_backend_anew(dynamic_path: Path) -> None:
    fresh = _fresh()
    options = RuntimeOptions(dynamic_backends_path=str(dynamic_path))
    Runtime(options, registry=fresh).close()
    assert _destroyed() == 1 and not fresh.is_registered("AcmeLife")
    with Runtime(options, registry=fresh):
        assert fresh.origin("AcmeLife") == f"file {dynamic_path / 'Acme_Life_backend.py'}"
    assert _destroyed() == 2


def test_a_destroy_hook_is_called_when_the_last_runtime_using_the_backend_goes(lived: None) -> None:
    """Seed 002: 'onert_backend_destroy ... What they do is creating a C++ object and destroying
    it'; here for any registered backend, once per time its last Runtime goes."""
    fresh = BackendRegistry()
    destroyed: list[str] = []
    fresh.register("TestLived", Lived, destroy=lambda: destroyed.append("TestLived"))
    fresh.register("CpuRef", CpuRef)
    first = Runtime(RuntimeOptions(backends=["TestLived"]), registry=fresh)
    second = Runtime(registry=fresh)
    second.load(optimize(import_onnx(small_cnn_model()), ["TestLived"], registry=fresh))
    first.close()
    assert destroyed == []
    second.close()
    assert destroyed == ["TestLived"]


def test_a_session_closes_the_runtime_it_made_and_leaves_a_given_one_open() -> None:
    """Seed 000: "the runtime object goes out of scope and the dynamic backend instance is
    automatically destroyed": a session that made its Runtime closes it with itself (the
    backends it held let go: the last one's destroy hook called), one given to it stays open."""
    destroyed: list[str] = []
    registry.register("TestLived", Lived, destroy=lambda: destroyed.append("TestLived"))
    try:
        model = small_cnn_model().SerializeToString()
        given = Runtime(RuntimeOptions(backends=["TestLived"]))
        InferenceSession(model, ["TestLived"], runtime=given).close()
        network_id = given.load(optimize(import_onnx(small_cnn_model()), ["TestLived"]))
        given.run(network_id, {"x": X})  # still open
        session = InferenceSession(model, ["TestLived"])
        session.close()
        with pytest.raises(RuntimeError, match="this Runtime is closed"):
            session.runtime.load(optimize(import_onnx(small_cnn_model()), ["TestLived"]))
        assert destroyed == []  # the given runtime still holds TestLived
        given.close()
        assert destroyed == ["TestLived"]
        session = InferenceSession(model, ["TestLived"])
        session.close()
        assert destroyed == ["TestLived", "TestLived"]  # the session's runtime was the last
    finally:
        registry.deregister("TestLived")
