"""CpuAcc's blob: compiled OneDnnGraphs kept as TorchScript archives without their weights, loaded
without a call, compiled by oneDNN Graph at their first run, per thread count."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
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


def _cpuacc_blob(artifact: Path) -> tuple[dict, memoryview, int]:
    """The header and payload of the artifact's one CpuAcc blob, and the constants' bytes."""
    contents = container.read(artifact)
    (blob,) = [v for k, v in contents.sections.items() if k.startswith("blob:")]
    length = int.from_bytes(blob[:8], "little")
    return (json.loads(bytes(blob[8:8 + length])), blob[8 + length:],
            len(contents.sections["constants"]))


def test_the_blob_keeps_the_module_without_its_weights(tmp_path: Path) -> None:
    """The archive's tensors are empty; each weight is a view of the artifact's constants or, for
    a layout a route made (a channels-last copy), its bytes in the payload: each weight is stored
    once, never twice as a copy of a constant."""
    path, _ = model_and_feeds("tiny_mobilenet_v3")
    artifact = tmp_path / "m.bpl"
    backplane.compile(path, COMPILED, artifact)
    header, payload, constants = _cpuacc_blob(artifact)
    (kept,) = header["modules"].values()
    start, size = kept["archive"]
    archive = zipfile.ZipFile(io.BytesIO(bytes(payload[start:start + size])))
    assert all(info.file_size == 0 for info in archive.infolist() if "/data/" in info.filename)
    kinds = [recipe[0] for recipe in kept["weights"].values()]
    assert set(kinds) <= {"view", "raw"} and kinds.count("view") > 0.9 * len(kinds)
    raw = sum(recipe[2][1] for recipe in kept["weights"].values() if recipe[0] == "raw")
    assert raw < 0.1 * constants
    assert all(recipe[2][0] % container.ALIGNMENT == 0 for recipe in kept["weights"].values()
               if recipe[0] == "raw")


def test_compiled_at_the_first_run_not_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """Loading makes the frozen module and calls nothing; the first run compiles it (one module,
    at that run's thread count: a busy machine's thread policy may pick another count for the
    second run, which compiles one more) and its outputs are the ONNX session's, bit for bit."""
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
    assert len(made) == 1 and made[0].modules == {}
    for _ in range(2):
        for a, b in zip(session.run(None, feeds), expected):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert counts and set(made[0].modules) == set(counts)


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


def test_a_weight_in_another_layout_is_mapped_in_its_own_strides() -> None:
    """A raw weight comes back with its strides (a channels-last copy stays channels-last) as a
    view of the payload, not a copy; a view of a constant as a view of the mapped array."""
    from backplane.backends.torch import delegate

    array = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    last = torch.from_numpy(array).contiguous(memory_format=torch.channels_last)
    payload = bytearray()
    raw = delegate._recipe(last, {"constants/w": array}, payload)
    view = delegate._recipe(torch.from_numpy(array)[1], {"constants/w": array}, payload)
    assert raw[0] == "raw" and view[:3] == ["view", "constants/w", 12]
    mapped = memoryview(bytearray(payload))
    again = delegate._tensor(raw, {"constants/w": array}, mapped)
    assert again.stride() == last.stride() and torch.equal(again, last)
    assert again.data_ptr() == torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
    viewed = delegate._tensor(view, {"constants/w": array}, mapped)
    assert torch.equal(viewed, torch.from_numpy(array)[1])
    assert viewed.data_ptr() == array[1].__array_interface__["data"][0]
