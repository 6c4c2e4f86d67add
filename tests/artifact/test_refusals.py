"""Loading refuses what the blobs cannot run on, naming what differs and what was expected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import backplane
from backplane import InferenceSession
from backplane.artifact import ArtifactError, container
from backplane.backends.api.backend import Backend, PreprocessResult
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import BackendRegistry
from backplane.ir.graph import Graph
from tests.artifact.conftest import model_and_feeds


class BlobRef(CpuRef):
    """CpuRef with a delegate: its blob names the layers; init binds them; facts are settable."""

    id = "BlobRef"
    FACTS: dict[str, str] = {"isa": "avx2"}
    preprocessed = 0

    def machine_facts(self) -> dict[str, str]:
        return dict(self.FACTS)

    def preprocess(self, graph: Graph, compile_specs: Any) -> PreprocessResult:
        BlobRef.preprocessed += 1
        names = [layer.name for layer in graph.layers]
        return PreprocessResult(json.dumps(names).encode(), {n: [n] for n in names})

    def init(self, processed: Any, compile_specs: Any, context: Any) -> Any:
        from backplane.runtime.loaded_network import LoadedNetwork
        from backplane.optimizer.optimize import OptimizedNetwork
        from backplane.optimizer.report import PlacementReport

        assert json.loads(bytes(processed)) == [layer.name for layer in context.graph.layers]
        net = OptimizedNetwork(context.graph, {self.id: self}, PlacementReport([self.id]),
                               list(context.graph.inputs), list(context.graph.outputs))
        return LoadedNetwork(net, context.network_id)

    def execute(self, handle: Any, *inputs: Any) -> tuple[Any, ...]:
        return tuple(handle.execute(list(inputs)))


def registry_with(*backends: type[Backend]) -> BackendRegistry:
    registry = BackendRegistry()
    for backend in backends:
        registry.register(backend.id, backend)
    return registry


@pytest.fixture
def blob_artifact(tmp_path: Path) -> tuple[Path, BackendRegistry]:
    registry = registry_with(BlobRef)
    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.artifact.build(path, artifact, ["BlobRef"], {}, runtime=backplane.Runtime(registry=registry))
    return artifact, registry


def test_a_delegate_round_trips(blob_artifact: tuple[Path, BackendRegistry]) -> None:
    artifact, registry = blob_artifact
    path, feeds = model_and_feeds("tiny_bert")
    session = InferenceSession(artifact, runtime=backplane.Runtime(registry=registry))
    delegates = [lay for lay in session.optimized.graph.layers if lay.op_type == "Delegate"]
    assert len(delegates) == 1 and delegates[0].backend == "BlobRef"
    for a, b in zip(session.run(None, feeds), InferenceSession(path, ["CpuRef"]).run(None, feeds)):
        assert a.tobytes() == b.tobytes()


def test_missing_backend(blob_artifact: tuple[Path, BackendRegistry]) -> None:
    artifact, _ = blob_artifact
    with pytest.raises(ArtifactError, match=r"needs backend BlobRef 1\.0\.0, which is not "
                                            r"registered here.*CpuRef"):
        InferenceSession(artifact)


def test_incompatible_api_major(blob_artifact: tuple[Path, BackendRegistry]) -> None:
    artifact, _ = blob_artifact

    class NextApi(BlobRef):
        api_version = (2, 0)

    registry = registry_with(NextApi)
    with pytest.raises(ArtifactError, match=r"API version 1\.0; the BlobRef here has API version "
                                            r"2\.0"):
        InferenceSession(artifact, runtime=backplane.Runtime(registry=registry))


def test_other_machine_facts(blob_artifact: tuple[Path, BackendRegistry],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    artifact, registry = blob_artifact
    monkeypatch.setattr(BlobRef, "FACTS", {"isa": "avx512f"})
    with pytest.raises(ArtifactError, match=r"isa: the artifact was compiled for 'avx2', this "
                                            r"machine has 'avx512f'"):
        InferenceSession(artifact, runtime=backplane.Runtime(registry=registry))
    before = BlobRef.preprocessed
    _, feeds = model_and_feeds("tiny_bert")
    session = InferenceSession(artifact, runtime=backplane.Runtime(registry=registry),
                               repreprocess=True)
    assert BlobRef.preprocessed == before + 1
    assert all(np.isfinite(out).all() for out in session.run(None, feeds))


def test_other_backend_version(blob_artifact: tuple[Path, BackendRegistry]) -> None:
    artifact, _ = blob_artifact

    class Newer(BlobRef):
        version = "1.1.0"

    with pytest.raises(ArtifactError, match=r"made by BlobRef 1\.0\.0, this one is 1\.1\.0"):
        InferenceSession(artifact, runtime=backplane.Runtime(registry=registry_with(Newer)))


def test_truncated_file(tmp_path: Path) -> None:
    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.compile(path, ["CpuRef"], artifact)
    data = artifact.read_bytes()
    for keep in (len(data) - 100, 30, 200):
        cut = tmp_path / f"cut{keep}.bpl"
        cut.write_bytes(data[:keep])
        with pytest.raises(ArtifactError, match="is truncated"):
            InferenceSession(cut)


def test_corrupted_file(tmp_path: Path) -> None:
    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.compile(path, ["CpuRef"], artifact)
    data = bytearray(artifact.read_bytes())
    constants = next(s for s in container.read(artifact).header["sections"]
                     if s["name"] == "constants")
    flipped = bytearray(data)
    flipped[constants["offset"] + 10] ^= 0x40
    (tmp_path / "weights.bpl").write_bytes(flipped)
    with pytest.raises(ArtifactError, match=r"corrupted: section 'constants' has xxh3_64 \w+, "
                                            r"expected " + constants["xxh3_64"]):
        InferenceSession(tmp_path / "weights.bpl")
    header = bytearray(data)
    header[60] ^= 0x01
    (tmp_path / "header.bpl").write_bytes(header)
    with pytest.raises(ArtifactError, match="corrupted: the header's sha256"):
        InferenceSession(tmp_path / "header.bpl")


def _sha256(*parts: bytes) -> dict[str, str]:  # format 1.0's: a section's pieces, hashed in order
    import hashlib

    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return {"sha256": digest.hexdigest()}


def _crc32(*parts: bytes) -> dict[str, str]:  # format 1.1's
    import zlib

    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return {"crc32": f"{crc:08x}"}


@pytest.mark.parametrize("version, kind, checksum", [((1, 0), "sha256", _sha256),
                                                     ((1, 1), "crc32", _crc32)])
def test_an_older_format_is_checked_by_its_own_checksum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: tuple[int, int], kind: str,
        checksum) -> None:
    """Format 1.0 kept each section's sha256, 1.1 its CRC-32 (1.2: its XXH3-64): such a file
    loads, and a flipped byte in it is found by its own checksum."""
    path, feeds = model_and_feeds("tiny_bert")
    artifact = tmp_path / "old.bpl"
    with monkeypatch.context() as patch:
        patch.setattr(container, "checksum", checksum)
        patch.setattr(backplane.artifact.compiler, "FORMAT_VERSION", version)
        backplane.compile(path, ["CpuRef"], artifact)
    header = container.read(artifact).header
    assert header["format"] == list(version) and all(kind in s for s in header["sections"])
    expected = InferenceSession(path, ["CpuRef"]).run(None, feeds)
    for a, b in zip(InferenceSession(artifact).run(None, feeds), expected):
        assert a.tobytes() == b.tobytes()
    constants = next(s for s in header["sections"] if s["name"] == "constants")
    data = bytearray(artifact.read_bytes())
    data[constants["offset"] + 10] ^= 0x40
    artifact.write_bytes(data)
    with pytest.raises(ArtifactError, match=rf"section 'constants' has {kind} \w+, expected "
                                            + constants[kind]):
        InferenceSession(artifact)


def test_other_backends_than_compiled(tmp_path: Path) -> None:
    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.compile(path, ["CpuRef"], artifact)
    with pytest.raises(ArtifactError, match=r"compiled for backends \['CpuRef'\]; this session "
                                            r"asks for \['CpuAcc', 'CpuRef'\]"):
        InferenceSession(artifact, backends=["CpuAcc", "CpuRef"])


def test_not_an_artifact(tmp_path: Path) -> None:
    bad = tmp_path / "x.bpl"
    bad.write_bytes(b"BPLNART\nxx")
    with pytest.raises(ArtifactError, match="truncated"):
        InferenceSession(bad)


def test_an_artifact_gets_the_permissions_open_would_give(tmp_path: Path) -> None:
    """Written through a temporary file (made 0600), the artifact ends as a plain ``open`` would
    make it under the process's umask, readable by those the user's other files are."""
    import os

    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    old = os.umask(0o022)
    try:
        backplane.compile(path, ["CpuRef"], artifact)
        assert artifact.stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        backplane.compile(path, ["CpuRef"], artifact)
        assert artifact.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


# -- a header is data someone else may have written: every name, number and shape is checked -------
def raw(tmp_path: Path, header: Any, body: bytes = b"", length: int | None = None) -> Path:
    """A file with this header (any JSON, or text), its sha256 right, then ``body``."""
    import hashlib

    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(text) if length is None else length
    path = tmp_path / "raw.bpl"
    path.write_bytes(container.MAGIC + size.to_bytes(8, "little") + hashlib.sha256(text).digest()
                     + text + body)
    return path


def section_header(**entry: Any) -> dict[str, Any]:
    return {"format": [1, 3], "manifest": {}, "tensors": [], "network": {},
            "sections": [{"name": "constants", "offset": 4096, "size": 64,
                          "xxh3_64": container.checksum(b"\0" * 64)["xxh3_64"], **entry}]}


@pytest.mark.parametrize("entry, message", [
    ({"offset": -64}, r"malformed: section 'constants' at offset -64 of size 64; sections start "
                      r"after the header \(byte \d+\)"),
    ({"offset": 0, "size": 0}, r"malformed: section 'constants' at offset 0"),
    ({"size": -8}, r"malformed: section 'constants' at offset 4096 of size -8"),
    ({"offset": "4096"}, r"malformed: a section entry is .*not \{name: str, offset: int"),
    ({"xxh3_64": None, "md5": "x"}, r"malformed: section 'constants' has no checksum \(known: "
                                    r"xxh3_64, crc32, sha256\)"),
])
def test_a_section_out_of_bounds_is_refused(tmp_path: Path, entry: dict[str, Any],
                                            message: str) -> None:
    header = section_header(**entry)
    if entry.get("xxh3_64", "") is None:
        del header["sections"][0]["xxh3_64"]
    with pytest.raises(ArtifactError, match=message):
        container.read(raw(tmp_path, header, b"\0" * 8192))


def test_two_sections_of_one_name_are_refused(tmp_path: Path) -> None:
    header = section_header()
    header["sections"].append({**header["sections"][0], "offset": 4160})
    with pytest.raises(ArtifactError, match="malformed: two sections are named 'constants'"):
        container.read(raw(tmp_path, header, b"\0" * 8192))


@pytest.mark.parametrize("header, message", [
    ([1, 2], r"lacks or mistypes format \(a list expected\), sections"),
    ({**section_header(), "format": ["1", 3]}, r"its format is \['1', 3\], not two integers"),
    (b"[" * 100_000 + b"]" * 100_000, r"its header is not JSON"),
    (b"{not json", r"its header is not JSON"),
])
def test_a_header_of_another_shape_is_refused(tmp_path: Path, header: Any, message: str) -> None:
    with pytest.raises(ArtifactError, match=message):
        InferenceSession(raw(tmp_path, header))


def test_a_header_length_past_the_file_is_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"truncated: \d+ bytes, its header alone needs "
                                            + str(48 + 2**62)):
        container.read(raw(tmp_path, section_header(), length=2**62))


def rewritten(artifact: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """The artifact with its header changed by ``change`` and written again with every checksum
    right (as anyone can): only the checks of what the header says stand in the way."""
    contents = container.read(artifact)
    header = {k: v for k, v in contents.header.items() if k != "sections"}
    change(header)
    container.write(artifact, header, [(n, bytes(d)) for n, d in contents.sections.items()])
    return artifact


@pytest.fixture
def compiled(tmp_path: Path) -> Path:
    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.compile(path, ["CpuRef"], artifact)
    return artifact


def first_array(header: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in header["tensors"] if t.get("nbytes"))


TENSOR_ATTACKS = {
    "offset past the section": (lambda t: t.update(offset=10**12),
                                r"says it is \d+ bytes at offset 1000000000000; it needs"),
    "fewer bytes than its shape": (lambda t: t.update(nbytes=t["nbytes"] - 4),
                                   r"says it is \d+ bytes at offset \d+; it needs"),
    "a negative size": (lambda t: t.update(shape=[-1]), r"a shape of sizes >= 0 expected"),
    "a huge shape": (lambda t: t.update(shape=[2**40, 2**40], nbytes=0),
                     r"a shape of sizes >= 0 expected"),
    "object elements from bytes": (lambda t: t.update(dtype="|O"), r"\(object, shape"),
    "a name of ml_dtypes that is no dtype": (lambda t: t.update(dtype="finfo"),
                                             r"unknown dtype 'finfo' in the artifact; known: bool"),
    "a name of numpy that is no dtype": (lambda t: t.update(dtype="ndarray"),
                                         r"unknown dtype 'ndarray'"),
}


@pytest.mark.parametrize("attack", TENSOR_ATTACKS.values(), ids=TENSOR_ATTACKS.keys())
def test_a_tensor_entry_is_checked_against_its_section(compiled: Path, attack: Any) -> None:
    change, message = attack
    rewritten(compiled, lambda header: change(first_array(header)))
    with pytest.raises(ArtifactError, match=message):
        InferenceSession(compiled)


def inject(value: Any) -> Any:
    def change(header: dict[str, Any]) -> None:
        header["network"]["graph"]["layers"][0]["attrs"]["injected"] = value
    return change


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"$tuple": [value]}
    return value


NETWORK_ATTACKS = {
    "an onnx message type not written": (inject({"$proto": ["ModelProto", ""]}),
                                         r"onnx message of type 'ModelProto'.* are: TypeProto, "
                                         r"TensorProto, SparseTensorProto"),
    "a name of onnx that is no message": (inject({"$proto": ["load_model", ""]}),
                                          r"onnx message of type 'load_model'"),
    "a void scalar of 10**15 bytes": (inject({"$scalar": ["|V8", 10**15]}),
                                     r"a scalar of dtype \|V8 in the artifact: scalars are"),
    "a negative tensor index": (inject({"$tensor": -1}), r"tensor -1 of the artifact does not "
                                                         r"exist: its table has \d+"),
    "the constants as a blob": (inject({"$blob": "constants"}),
                                r"blob 'constants' is not a section of the artifact; its blobs "
                                r"are: none"),
    "an opset that is text": (lambda h: h["network"]["graph"]["layers"][0].update(opset="13"),
                              r"a layer of the artifact lacks or mistypes opset"),
    "a value nested past the stack": (inject(nested(400)), r"malformed: RecursionError"),
    "an API version of one number": (lambda h: h["manifest"]["backends"][0].update(
        api_version=[1]), r"its manifest's backends\[0\] has api_version \[1\]"),
    "metadata with a field of its own": (lambda h: h["manifest"]["model"]["metadata"].update(
        evil="x"), r"its manifest's model.metadata has the unknown field 'evil'"),
    "backends that are no list": (lambda h: h["manifest"].update(backends={"CpuRef": 1}),
                                  r"its manifest's backends is .*, not a list"),
    "a layer on a backend its network lacks": (
        lambda h: h["network"]["graph"]["layers"][0].update(backend="Nope"),
        r"runs on backend 'Nope', not one of its network's: CpuRef"),
    "a backend the manifest does not list": (
        lambda h: h["network"].update(backends=["CpuRef", "CpuAcc"]),
        r"its network uses backend 'CpuAcc', which its manifest does not list \(CpuRef"),
}


@pytest.mark.parametrize("attack", NETWORK_ATTACKS.values(), ids=NETWORK_ATTACKS.keys())
def test_a_name_or_number_from_the_network_is_checked(compiled: Path, attack: Any) -> None:
    change, message = attack
    rewritten(compiled, change)
    with pytest.raises(ArtifactError, match=message):
        InferenceSession(compiled)
