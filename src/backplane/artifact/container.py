"""The artifact's file: a checked JSON header, then aligned binary sections, each with its checksum.

::

    offset 0   b"BPLNART\\n"                      8 bytes, the magic
    offset 8   header length                       8 bytes, little-endian
    offset 16  sha256 of the header                32 bytes
    offset 48  the header: UTF-8 JSON              {"format": [1, 3], "sections": [...], ...}
    then       a signed file's HMAC-SHA256 of the header (32 bytes; the header names its key)
    then       the sections, each starting at a multiple of ALIGNMENT bytes from the file's start

A section is raw bytes (the constants, one blob per delegated partition); the header lists each one's
name, offset, size and XXH3-64 (``xxhash``: a checksum at the speed memory is read, 0.04 s for BERT's
437 MB here against 0.14-0.27 s for a CRC-32 and 0.31 s for a sha256; the header, small, keeps its
sha256). Loading reads every section's bytes for it, so its cost is a load's floor. Files of format
1.1 carry each section's CRC-32 (``zlib.crc32``), of 1.0 its sha256, checked as before. These catch
damage; a signed file (format 1.3, ``signing.py``) also lists the sha256 of every 16 MiB piece of
each section, and a reader given the key checks the HMAC and those instead. Every offset, size and
type the header gives is checked before it is used.

Reading maps the file copy-on-write (``mmap.ACCESS_COPY``): a section is a view of the mapping,
never read into memory first, and arrays made on it are writable without writing to the file.
Writing goes to a temporary file in the same folder, then ``os.replace``: a reader sees the whole
file or none.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from backplane.artifact import signing
from backplane.artifact.signing import ALGORITHM, MAC_BYTES, SigningKey

MAGIC = b"BPLNART\n"
ALIGNMENT = 64
_PREFIX = len(MAGIC) + 8 + 32


class ArtifactError(RuntimeError):
    """An artifact that cannot be loaded here: not one, damaged, or made for something else; the
    message names what differs and what was expected."""


@dataclass
class Contents:
    """A read artifact: its header (checked) and its sections by name (views of the mapping)."""

    header: dict[str, Any]
    sections: dict[str, memoryview]
    path: str
    verified_key: str | None = None
    """The id of the key whose signature was checked (``read(path, key)``), None where none was."""


def is_artifact(source: Any) -> bool:
    """Whether ``source`` (a path or bytes) starts as an artifact does."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[:len(MAGIC)]) == MAGIC
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        with open(source, "rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    return False


Section = bytes | memoryview | Sequence[bytes | memoryview]
"""A section's bytes: one buffer, or its pieces in order (written one after the other)."""


def write(path: str | os.PathLike, header: dict[str, Any],
          sections: Sequence[tuple[str, Section]], key: SigningKey | None = None,
          durable: bool = True) -> int:
    """Write the artifact atomically, signed where ``key`` is given; returns its size in bytes.

    ``durable``: flushed to the disk (fsync) before it replaces ``path``. The compile cache passes
    False: an fsync costs 0.1-0.6 s on a busy disk, more than the rest of a small model's session
    creation, and an entry a crash leaves short or garbled fails its checksums at the next read
    and is compiled again."""
    table, offset = [], 0
    pieces = [[data] if isinstance(data, (bytes, memoryview)) else list(data)
              for _, data in sections]
    for (name, _), parts in zip(sections, pieces):
        table.append({"name": name, "size": sum(len(p) for p in parts), **checksum(*parts)})
        if key is not None:
            table[-1]["sha256_pieces"] = signing.piece_digests(parts)
    if key is not None:
        header = {**header, "signature": {"algorithm": ALGORITHM, "key_id": key.id}}
    text, mac_bytes = b"", MAC_BYTES if key is not None else 0
    while True:  # the offsets depend on the header's length, which depends on the offsets
        offset = _aligned(_PREFIX + len(text) + mac_bytes)
        for entry in table:
            entry["offset"] = offset
            offset = _aligned(offset + entry["size"])
        laid_out = _header_bytes({**header, "sections": table})
        settled, text = len(laid_out) == len(text), laid_out
        if settled:
            break
    mac = key.mac(text) if key is not None else b""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=folder, delete=False, suffix=".tmp") as tmp:
        try:
            tmp.write(MAGIC + len(text).to_bytes(8, "little") + hashlib.sha256(text).digest()
                      + text + mac)
            for entry, parts in zip(table, pieces):
                tmp.write(b"\0" * (entry["offset"] - tmp.tell()))
                for part in parts:
                    tmp.write(part)
            tmp.flush()
            if durable:
                os.fsync(tmp.fileno())
            os.chmod(tmp.name, 0o666 & ~_umask())  # as open() would make it, not the temporary's 0600
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)
    return os.path.getsize(path)


def read(path: str | os.PathLike, key: SigningKey | None = None) -> Contents:
    """Map and check an artifact: magic, header checksum, every section's bounds and checksum.
    With ``key``: the artifact must be signed with it (its MAC checked, then every section's
    sha256 pieces instead of the XXH3)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            prefix = file.read(_PREFIX)
            if prefix[:len(MAGIC)] != MAGIC:
                raise ArtifactError(f"'{path}' is not a backplane artifact: it starts with "
                                    f"{prefix[:len(MAGIC)]!r}, an artifact with {MAGIC!r}")
            if len(prefix) < _PREFIX:
                raise ArtifactError(f"'{path}' is truncated: {size} bytes, shorter than the "
                                    f"{_PREFIX} bytes of an artifact's prefix")
            length = int.from_bytes(prefix[8:16], "little")
            if length > size - _PREFIX:  # checked before reading: a length of 2**63 reads nothing
                raise ArtifactError(f"'{path}' is truncated: {size} bytes, its header alone needs "
                                    f"{_PREFIX + length}")
            text = file.read(length)
            mac = file.read(MAC_BYTES)  # where the header says it is signed
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    except OSError as exc:
        raise ArtifactError(f"'{path}' could not be read: {exc}") from exc
    if hashlib.sha256(text).digest() != prefix[16:48]:
        raise ArtifactError(f"'{path}' is corrupted: the header's sha256 is "
                            f"{hashlib.sha256(text).hexdigest()}, expected {prefix[16:48].hex()}")
    header = _parsed(path, text)
    start = _PREFIX + length
    if header.get("signature") is not None:
        start += MAC_BYTES
        if key is not None:
            _check_signature(path, header["signature"], key, text, mac)
    elif key is not None:
        raise ArtifactError(f"'{path}' is not signed; this session takes only artifacts signed "
                            f"with key {key.id} (SessionOptions.artifact_key): sign it with "
                            f"'backplane compile --sign KEYFILE' or backplane.compile(..., "
                            f"sign_key=...)")
    sections = _sections(path, header["sections"], mapping, size, start, key)
    return Contents(header, sections, path, key.id if key is not None else None)


def _parsed(path: str, text: bytes) -> dict[str, Any]:
    """The header's JSON, with the fields every reader uses of the types it uses them as."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"'{path}' is malformed: its header is not JSON: {exc}") from exc
    expected = {"format": list, "sections": list, "manifest": dict, "tensors": list,
                "network": dict}
    wrong = [f"{name} (a {kind.__name__} expected)" for name, kind in expected.items()
             if not isinstance(header.get(name) if isinstance(header, dict) else None, kind)]
    if wrong:
        raise ArtifactError(f"'{path}' is malformed: its header lacks or mistypes " +
                            ", ".join(wrong))
    version = header["format"]
    if len(version) != 2 or not all(_is_int(v) for v in version):
        raise ArtifactError(f"'{path}' is malformed: its format is {version!r}, not two integers")
    return header


def _check_signature(path: str, signature: Any, key: SigningKey, text: bytes, mac: bytes) -> None:
    if not isinstance(signature, dict) or signature.get("algorithm") != ALGORITHM:
        raise ArtifactError(f"'{path}' is signed as {signature!r}; this backplane checks "
                            f"'{ALGORITHM}' signatures")
    if signature.get("key_id") != key.id:
        raise ArtifactError(f"'{path}' is signed with key {signature.get('key_id')!r}, not with "
                            f"this session's key {key.id} (SessionOptions.artifact_key)")
    if len(mac) < MAC_BYTES or not key.verifies(mac, text):
        raise ArtifactError(f"'{path}': its signature does not verify under key {key.id}: the "
                            f"header was changed after it was signed, or signed with another key")


def _sections(path: str, table: list[Any], mapping: Any, size: int, start: int,
              key: SigningKey | None) -> dict[str, memoryview]:
    """Each section's bytes, bounds checked, and checked: by its sha256 pieces (signed: the key's
    check), else by the checksum its entry names."""
    whole = memoryview(mapping) if mapping is not None else memoryview(b"")
    sections: dict[str, memoryview] = {}
    signed = []
    for entry in table:
        name, offset, length = _bounds(path, entry, start)
        if name in sections:
            raise ArtifactError(f"'{path}' is malformed: two sections are named '{name}'")
        if offset + length > size:
            raise ArtifactError(f"'{path}' is truncated: {size} bytes, section '{name}' ends at "
                                f"byte {offset + length}")
        data = sections[name] = whole[offset:offset + length]
        if key is not None:
            signed.append((name, data, _pieces(path, entry, name, length)))
            continue
        kind = next((k for k in CHECKSUMS if k in entry), None)
        if kind is None:
            raise ArtifactError(f"'{path}' is malformed: section '{name}' has no checksum (known: "
                                f"{', '.join(CHECKSUMS)})")
        digest = CHECKSUMS[kind](data)
        if digest != entry[kind]:
            raise ArtifactError(f"'{path}' is corrupted: section '{name}' has {kind} "
                                f"{digest}, expected {entry[kind]}")
    wrong = signing.mismatched_pieces(signed) if signed else []
    if wrong:
        raise ArtifactError(f"'{path}' is corrupted or altered after signing: the sha256 of "
                            + "; ".join(wrong) + " differs from the signed header's")
    return sections


def _bounds(path: str, entry: Any, start: int) -> tuple[str, int, int]:
    """A section entry's name, offset and size, each of its type, the section after the header."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
            not _is_int(entry.get("offset")) or not _is_int(entry.get("size")):
        raise ArtifactError(f"'{path}' is malformed: a section entry is {str(entry)[:200]}, not "
                            f"{{name: str, offset: int, size: int, checksum}}")
    name, offset, length = entry["name"], entry["offset"], entry["size"]
    if offset < start or length < 0:
        raise ArtifactError(f"'{path}' is malformed: section '{name}' at offset {offset} of size "
                            f"{length}; sections start after the header (byte {start}) and have "
                            f"a size >= 0")
    return name, offset, length


def _pieces(path: str, entry: dict[str, Any], name: str, length: int) -> list[str]:
    expected = entry.get("sha256_pieces")
    count = -(-length // signing.PIECE)
    if not isinstance(expected, list) or len(expected) != count or \
            not all(isinstance(d, str) for d in expected):
        raise ArtifactError(f"'{path}' is malformed: section '{name}' of {length} bytes needs "
                            f"the sha256 of its {count} pieces of {signing.PIECE} bytes in its "
                            f"signed entry, which has {str(expected)[:200]}")
    return expected


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checksum(*parts: bytes | memoryview) -> dict[str, str]:
    """A section's checksum, as its header entry holds it, over its bytes (given in pieces)."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return {"xxh3_64": digest.hexdigest()}


CHECKSUMS = {"xxh3_64": xxhash.xxh3_64_hexdigest,
             "crc32": lambda data: f"{zlib.crc32(data):08x}",  # format 1.1
             "sha256": lambda data: hashlib.sha256(data).hexdigest()}  # format 1.0
"""A section's checksum by the name its header entry gives it: each format's, for reading."""


def _umask() -> int:
    """The process's file-creation mask: from /proc where it says, else set and set back."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _header_bytes(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT
