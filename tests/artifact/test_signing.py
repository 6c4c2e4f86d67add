"""Signed artifacts: an HMAC-SHA256 over a header holding every section's sha256 pieces. A session
with ``SessionOptions.artifact_key`` loads only what that key signed: an unsigned file, another
key's, a header changed after signing or a section changed under it is an ArtifactError naming
what failed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import backplane
from backplane import InferenceSession, SessionOptions
from backplane.artifact import ArtifactError, SigningKey, cache, container, signing
from tests.artifact.conftest import model_and_feeds

MODEL, FEEDS = model_and_feeds("tiny_bert")
KEY = SigningKey(b"k" * 32)
OTHER = SigningKey(b"o" * 32)


def signed(tmp_path: Path, key: SigningKey | None = KEY, name: str = "bert.bpl") -> Path:
    artifact = tmp_path / name
    backplane.compile(MODEL, ["CpuRef"], artifact, sign_key=key)
    return artifact


def session(artifact: Path, key: SigningKey | None = KEY) -> InferenceSession:
    return InferenceSession(artifact, SessionOptions(artifact_key=key))


def same_outputs(loaded: InferenceSession) -> None:
    expected = InferenceSession(MODEL, ["CpuRef"]).run(None, FEEDS)
    for a, b in zip(loaded.run(None, FEEDS), expected):
        assert a.tobytes() == b.tobytes()


def test_a_signed_artifact_loads_with_its_key_and_without_one(tmp_path: Path) -> None:
    artifact = signed(tmp_path)
    header = container.read(artifact).header
    assert header["format"] == [1, 3]
    assert header["signature"] == {"algorithm": "hmac-sha256", "key_id": KEY.id}
    assert all("sha256_pieces" in s and "xxh3_64" in s for s in header["sections"])
    same_outputs(session(artifact))
    same_outputs(InferenceSession(artifact))  # signing is optional for a reader without a key


def test_an_unsigned_artifact_is_refused_where_a_key_is_required(tmp_path: Path) -> None:
    artifact = signed(tmp_path, key=None)
    with pytest.raises(ArtifactError, match=rf"is not signed; this session takes only artifacts "
                                            rf"signed with key {KEY.id}"):
        session(artifact)
    same_outputs(InferenceSession(artifact))


def test_another_keys_artifact_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=rf"is signed with key '{OTHER.id}', not with this "
                                            rf"session's key {KEY.id}"):
        session(signed(tmp_path, key=OTHER))


def rewrite_header(artifact: Path, change) -> None:  # type: ignore[no-untyped-def]
    """What anyone can do: edit the header (same length, sections left in place) and compute its
    sha256 again."""
    data = bytearray(artifact.read_bytes())
    length = int.from_bytes(data[8:16], "little")
    text = change(bytes(data[48:48 + length]))
    assert len(text) == length
    data[16:48] = hashlib.sha256(text).digest()
    data[48:48 + length] = text
    artifact.write_bytes(bytes(data))


def test_a_header_changed_after_signing_is_refused(tmp_path: Path) -> None:
    artifact = signed(tmp_path)
    digest = container.read(artifact).header["manifest"]["model"]["sha256"]
    forged = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    rewrite_header(artifact, lambda text: text.replace(digest.encode(), forged.encode()))
    assert container.read(artifact).header["manifest"]["model"]["sha256"] == forged  # no key
    with pytest.raises(ArtifactError, match=rf"its signature does not verify under key {KEY.id}"):
        session(artifact)


def test_a_section_changed_under_a_matching_xxh3_is_refused(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """XXH3 is no defence: a section changed so that its XXH3 still matches (simulated: every
    XXH3 the same) loads without the key, and is refused by the signed sha256 pieces with it."""
    monkeypatch.setattr(container, "checksum", lambda *parts: {"xxh3_64": "0" * 16})
    monkeypatch.setitem(container.CHECKSUMS, "xxh3_64", lambda data: "0" * 16)
    artifact = signed(tmp_path)
    constants = next(s for s in container.read(artifact).header["sections"]
                     if s["name"] == "constants")
    data = bytearray(artifact.read_bytes())
    data[constants["offset"] + 10] ^= 0x40
    artifact.write_bytes(bytes(data))
    container.read(artifact)  # the collision gets past the XXH3
    with pytest.raises(ArtifactError, match=r"corrupted or altered after signing: the sha256 of "
                                            r"section 'constants' piece 0 \(bytes 0 to"):
        session(artifact)


def test_each_piece_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sections are hashed in pieces (in parallel); a change in any piece names that piece."""
    monkeypatch.setattr(signing, "PIECE", 4096)
    artifact = signed(tmp_path)
    header = container.read(artifact, KEY).header
    constants = next(s for s in header["sections"] if s["name"] == "constants")
    assert len(constants["sha256_pieces"]) == -(-constants["size"] // 4096) > 4
    data = bytearray(artifact.read_bytes())
    data[constants["offset"] + 3 * 4096 + 7] ^= 0x01
    artifact.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"section 'constants' piece 3 \(bytes 12288 to 16384\)"):
        container.read(artifact, KEY)


def test_a_signed_header_without_its_pieces_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signing, "piece_digests", lambda parts: [])
    artifact = signed(tmp_path)
    with pytest.raises(ArtifactError, match=r"section 'constants' of \d+ bytes needs the sha256 "
                                            r"of its 1 pieces"):
        container.read(artifact, KEY)


def test_contents_read_without_the_key_do_not_load_with_it(tmp_path: Path) -> None:
    contents, _ = backplane.artifact.read_manifest(signed(tmp_path))
    with pytest.raises(ArtifactError, match="was read without checking its signature"):
        backplane.artifact.load(contents, key=KEY)
    keyed, _ = backplane.artifact.read_manifest(signed(tmp_path), KEY)
    assert backplane.artifact.load(keyed, key=KEY).manifest["model"]["sha256"]


def test_compile_signs_with_the_sessions_key(tmp_path: Path) -> None:
    artifact = tmp_path / "bert.bpl"
    backplane.compile(MODEL, ["CpuRef"], artifact, sess_options=SessionOptions(artifact_key=KEY))
    same_outputs(session(artifact))


def test_the_key_is_checked_and_never_shown() -> None:
    options = SessionOptions(artifact_key=b"s" * 32)
    assert isinstance(options.artifact_key, SigningKey)
    assert "sss" not in repr(options) and options.artifact_key.id in repr(options)
    with pytest.raises(ValueError, match="at least 16 bytes, got 5"):
        SessionOptions(artifact_key=b"short")
    with pytest.raises(ValueError, match="artifact_key must be bytes, a SigningKey or None"):
        SessionOptions(artifact_key="a-path-or-a-password")
    assert SigningKey(b"s" * 32) == options.artifact_key != KEY


def test_a_cache_entry_must_be_signed_with_the_sessions_key(tmp_path: Path) -> None:
    """An unsigned entry is compiled again, signed; the model digest the folder remembers is
    taken only where signed with the key."""
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = folder.glob("*.bpl")
    assert "signature" not in container.read(entry).header
    same_outputs(InferenceSession(MODEL, ["CpuRef"], SessionOptions(artifact_key=KEY),
                                  cache_dir=folder))
    assert container.read(entry, KEY).header["signature"]["key_id"] == KEY.id


def test_a_remembered_digest_counts_only_where_signed(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A digests file that maps this model to another model's sha256 (as a writer of the folder
    could) is believed without a key, and ignored with one: the model is hashed."""
    model = tmp_path / "model.onnx"
    model.write_bytes(MODEL.read_bytes())
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(cache, "SETTLED_NS", -1)
    truth = cache.model_digest(model, str(folder), KEY)
    memo = folder / cache.DIGESTS
    entry = json.loads(memo.read_text())[str(model.resolve())]
    assert len(entry) == 7  # identity, digest, its MAC
    poisoned = [*entry[:5], "ab" * 32]
    memo.write_text(json.dumps({str(model.resolve()): poisoned}))
    assert cache.model_digest(model, str(folder)) == "ab" * 32
    assert cache.model_digest(model, str(folder), KEY) == truth
    memo.write_text(json.dumps({str(model.resolve()): [*poisoned, entry[6]]}))  # another's MAC
    assert cache.model_digest(model, str(folder), KEY) == truth
