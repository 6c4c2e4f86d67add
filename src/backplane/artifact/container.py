"""The artifact's file: a checked JSON header, then aligned binary sections, each with its checksum.

::

    offset 0   b"BPLNART\\n"                      8 bytes, the magic
    offset 8   header length                       8 bytes, little-endian
    offset 16  sha256 of the header                32 bytes
    offset 48  the header: UTF-8 JSON              {"format": [1, 2], "sections": [...], ...}
    then       the sections, each starting at a multiple of ALIGNMENT bytes from the file's start

A section is raw bytes (the constants, one blob per delegated partition); the header lists each one's
name, offset, size and XXH3-64 (``xxhash``: a checksum at the speed memory is read, 0.04 s for BERT's
437 MB here against 0.14-0.27 s for a CRC-32 and 0.31 s for a sha256; the header, small, keeps its
sha256). Loading reads every section's bytes for it, so its cost is a load's floor. Files of format
1.1 carry each section's CRC-32 (``zlib.crc32``), of 1.0 its sha256, checked as before.

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
          sections: Sequence[tuple[str, Section]]) -> int:
    """Write the artifact atomically; returns its size in bytes."""
    table, offset = [], 0
    pieces = [[data] if isinstance(data, (bytes, memoryview)) else list(data)
              for _, data in sections]
    for (name, _), parts in zip(sections, pieces):
        table.append({"name": name, "size": sum(len(p) for p in parts), **checksum(*parts)})
    text = b""
    while True:  # the offsets depend on the header's length, which depends on the offsets
        offset = _aligned(_PREFIX + len(text))
        for entry in table:
            entry["offset"] = offset
            offset = _aligned(offset + entry["size"])
        laid_out = _header_bytes({**header, "sections": table})
        settled, text = len(laid_out) == len(text), laid_out
        if settled:
            break
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=folder, delete=False, suffix=".tmp") as tmp:
        try:
            tmp.write(MAGIC + len(text).to_bytes(8, "little") + hashlib.sha256(text).digest() + text)
            for entry, parts in zip(table, pieces):
                tmp.write(b"\0" * (entry["offset"] - tmp.tell()))
                for part in parts:
                    tmp.write(part)
            tmp.flush()
            os.fsync(tmp.fileno())
            os.chmod(tmp.name, 0o666 & ~_umask())  # as open() would make it, not the temporary's 0600
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)
    return os.path.getsize(path)


def read(path: str | os.PathLike) -> Contents:
    """Map and check an artifact: magic, header checksum, every section's bounds and checksum."""
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
            text = file.read(length)
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    except OSError as exc:
        raise ArtifactError(f"'{path}' could not be read: {exc}") from exc
    if len(text) < length:
        raise ArtifactError(f"'{path}' is truncated: {size} bytes, its header alone needs "
                            f"{_PREFIX + length}")
    if hashlib.sha256(text).digest() != prefix[16:48]:
        raise ArtifactError(f"'{path}' is corrupted: the header's sha256 is "
                            f"{hashlib.sha256(text).hexdigest()}, expected {prefix[16:48].hex()}")
    header = json.loads(text)
    return Contents(header, _sections(path, header, mapping, size), path)


def _sections(path: str, header: dict[str, Any], mapping: Any, size: int) -> dict[str, memoryview]:
    whole = memoryview(mapping) if mapping is not None else memoryview(b"")
    sections = {}
    for entry in header["sections"]:
        end = entry["offset"] + entry["size"]
        if end > size:
            raise ArtifactError(f"'{path}' is truncated: {size} bytes, section '{entry['name']}' "
                                f"ends at byte {end}")
        data = whole[entry["offset"]:end]
        kind = next((k for k in CHECKSUMS if k in entry), "sha256")
        digest = CHECKSUMS[kind](data)
        if digest != entry[kind]:
            raise ArtifactError(f"'{path}' is corrupted: section '{entry['name']}' has {kind} "
                                f"{digest}, expected {entry[kind]}")
        sections[entry["name"]] = data
    return sections


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
