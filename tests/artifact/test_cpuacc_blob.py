"""CpuAcc's blob: data only (routes, the compiled OneDnnGraphs' names, packed weights); a compiled
OneDnnGraph traced again from its layer and compiled by oneDNN Graph at its first run, per thread
count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import backplane
from backplane import InferenceSession
from backplane.artifact import container
from backplane.backends.api.backend import DELEGATE_DOMAIN
from tests.artifact.conftest import model_and_feeds

torch = pytest.importorskip("torch")
COMPILED = [("CpuAcc", {"compile": "onednn_graph"}), "CpuRef"]
"""The OneDnnGraph compiled whatever "auto" would measure (layer by layer can win on a busy
machine)."""


def cpuacc_blob(artifact: Path) -> tuple[dict, memoryview]:
    """The header and payload of the artifact's one CpuAcc blob."""
    contents = container.read(artifact)
    (blob,) = [v for k, v in contents.sections.items() if k.startswith("blob:")]
    length = int.from_bytes(blob[:8], "little")
    return json.loads(bytes(blob[8:8 + length])), blob[8 + length:]


@pytest.mark.parametrize("options", [{"compile": "onednn_graph"},
                                     {"compile": "layers", "conv_route": "onednn"}])
def test_the_blob_holds_routes_names_and_packed_weights_only(tmp_path: Path,
                                                             options: dict) -> None:
    """Layout 3: the routes, the compiled OneDnnGraph by name, and a payload made of the packed
    weights' descriptors and bytes alone, each at a multiple of 64 bytes: no archive, no module,
    no weight copied from the constants."""
    path, _ = model_and_feeds("tiny_mobilenet_v3")
    artifact = tmp_path / "m.bpl"
    backplane.compile(path, [("CpuAcc", options), "CpuRef"], artifact)
    header, payload = cpuacc_blob(artifact)
    assert sorted(header) == ["compiled", "layout", "packed", "routes"] and header["layout"] == 3
    assert all(isinstance(v, str) for v in header["routes"].values())
    if options["compile"] == "onednn_graph":
        (name,) = header["compiled"]
        assert name.startswith("OneDnnGraph")
    else:
        assert header["compiled"] == [] and header["packed"]
    pieces = sorted(where for entry in header["packed"].values()
                    for where in (entry["descriptor"], entry["data"]))
    covered = 0
    for offset, size in pieces:  # one after the other, aligned, and nothing else
        assert offset % container.ALIGNMENT == 0 and offset == covered + (-covered % container.ALIGNMENT)
        covered = offset + size
    assert covered == len(payload)


def test_compiled_at_the_first_run_not_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """Loading makes no module and calls nothing; the first run traces the module again from its
    layer, freezes and compiles it (one module, at that run's thread count: a busy machine's
    thread policy may pick another count for the second run, which freezes and compiles one more)
    and its outputs are the ONNX session's, bit for bit."""
    from backplane.backends.torch.fusion import onednn_graph

    made: list[onednn_graph.CompiledPerThreads] = []
    counts: list[int] = []

    class Recorded(onednn_graph.CompiledPerThreads):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)
            count = self._count
            self._count = lambda: counts.append(count()) or counts[-1]  # the counts runs asked for

    path, feeds = model_and_feeds("tiny_mobilenet_v3")
    artifact = tmp_path / "m.bpl"
    backplane.compile(path, COMPILED, artifact)
    expected = InferenceSession(path, backends=COMPILED).run(None, feeds)
    monkeypatch.setattr(onednn_graph, "CompiledPerThreads", Recorded)
    session = InferenceSession(artifact)
    (delegate,) = [lay for lay in session.optimized.graph.layers if lay.domain == DELEGATE_DOMAIN]
    assert [lay.op_type for lay in delegate.attrs["graph"].layers] == ["OneDnnGraph"]
    assert made == []
    for _ in range(2):
        for a, b in zip(session.run(None, feeds), expected):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert len(made) == 1 and counts and set(made[0].modules) == set(counts)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # TorchScript's
def test_each_thread_count_compiles_its_own_module_at_its_first_call() -> None:
    """oneDNN Graph's partitions keep the threads they were compiled with: another count makes
    and compiles another module, on the inputs of its first call, whose result is that call's."""
    from backplane.backends.torch.fusion.onednn_graph import CompiledPerThreads

    scripted = torch.jit.script(torch.nn.Linear(4, 3).eval())
    makes = []

    def make() -> object:
        makes.append(torch.jit.freeze(scripted))
        return makes[-1]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        kept = CompiledPerThreads(make)
        x = torch.ones(2, 4)
        with torch.no_grad():
            expected = scripted(x)
            torch.testing.assert_close(kept(x), expected, rtol=0, atol=0)
            assert len(makes) == 1 and set(kept.modules) == {2}
            torch.set_num_threads(1)
            torch.testing.assert_close(kept(x), expected, rtol=0, atol=0)
            torch.testing.assert_close(kept(x), expected, rtol=0, atol=0)
            assert len(makes) == 2 and set(kept.modules) == {1, 2}
    finally:
        torch.set_num_threads(before)
