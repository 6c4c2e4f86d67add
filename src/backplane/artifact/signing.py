"""Signed artifacts: an HMAC-SHA256 under a key the user holds, over a header that holds a sha256
of every 16 MiB piece of every section.

The header's sha256 and the sections' XXH3-64 catch damage, not an attacker: anyone can compute
them again. A signed artifact's header also lists, per section, the sha256 of each ``PIECE`` bytes
(``sha256_pieces``), and the file carries ``HMAC-SHA256(key, header)`` right after its header. A
reader given the key checks the MAC, then every piece against its sha256 (collision resistant,
unlike XXH3), the pieces in parallel: hashing a whole section is one thread's work and the
sections of a few hundred megabytes are a load's floor (docs/artifact.md measures it).

The key is bytes (a file of them: ``SigningKey.from_file``), at least ``MIN_KEY_BYTES`` long;
``SigningKey.id`` names it in messages without giving it away.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

ALGORITHM = "hmac-sha256"
MAC_BYTES = 32
PIECE = 1 << 24
"""The bytes of a section hashed as one: small enough to share among threads, big enough that the
header stays short (55 digests for BERT's 874 MB of sections)."""
MIN_KEY_BYTES = 16


class SigningKey:
    """An HMAC key: ``SigningKey(bytes)`` or ``SigningKey.from_file(path)``. Its ``repr`` shows
    its length and ``id``, never the key."""

    def __init__(self, key: bytes | bytearray | memoryview) -> None:
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise TypeError(f"a signing key is bytes (SigningKey.from_file reads a key file), got "
                            f"{type(key).__name__}")
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a signing key needs at least {MIN_KEY_BYTES} bytes, got {len(key)} "
                             f"(make one with: head -c 32 /dev/urandom > backplane.key)")
        self._key = bytes(key)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> SigningKey:
        """The key file's bytes, as they are (a trailing newline is part of the key)."""
        try:
            with open(path, "rb") as file:
                return cls(file.read())
        except OSError as exc:
            raise ValueError(f"the key file '{os.fspath(path)}' cannot be read: {exc}") from exc

    @property
    def id(self) -> str:
        """The key's fingerprint (16 hex digits of a sha256 of it): names it, does not reveal it."""
        return hashlib.sha256(b"backplane key id\0" + self._key).hexdigest()[:16]

    def mac(self, *parts: bytes | memoryview) -> bytes:
        """HMAC-SHA256 of the parts, in order."""
        digest = hmac.new(self._key, digestmod="sha256")
        for part in parts:
            digest.update(part)
        return digest.digest()

    def verifies(self, mac: bytes, *parts: bytes | memoryview) -> bool:
        return hmac.compare_digest(mac, self.mac(*parts))

    def __repr__(self) -> str:
        return f"SigningKey(<{len(self._key)} bytes, id {self.id}>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SigningKey) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.id)


def signing_key(value: SigningKey | bytes | bytearray | None) -> SigningKey | None:
    """``value`` as a SigningKey (None stays None)."""
    return value if value is None or isinstance(value, SigningKey) else SigningKey(value)


def piece_digests(parts: Iterable[bytes | memoryview]) -> list[str]:
    """The sha256 of each PIECE bytes of a section given in parts (the last piece may be short;
    an empty section has none)."""
    digests, digest, filled = [], hashlib.sha256(), 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = min(PIECE - filled, len(view))
            digest.update(view[:take])
            view, filled = view[take:], filled + take
            if filled == PIECE:
                digests.append(digest.hexdigest())
                digest, filled = hashlib.sha256(), 0
    if filled:
        digests.append(digest.hexdigest())
    return digests


def pieces_of(data: memoryview) -> list[memoryview]:
    return [data[start:start + PIECE] for start in range(0, len(data), PIECE)]


def mismatched_pieces(sections: Sequence[tuple[str, memoryview, Sequence[str]]]) -> list[str]:
    """Each section (name, bytes, its pieces' expected sha256) whose pieces do not all match, with
    the first piece that differs; the pieces hashed on as many threads as this process may use."""
    jobs = [(name, k, piece, expected[k]) for name, data, expected in sections
            for k, piece in enumerate(pieces_of(data))]
    threads = max(1, min(len(jobs), len(os.sched_getaffinity(0))
                         if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))

    def differs(job: tuple[str, int, memoryview, str]) -> bool:
        return not hmac.compare_digest(hashlib.sha256(job[2]).hexdigest(), job[3])

    with ThreadPoolExecutor(threads) as pool:
        bad = [job for job, wrong in zip(jobs, pool.map(differs, jobs)) if wrong]
    first: dict[str, int] = {}
    for name, k, _, _ in bad:
        first.setdefault(name, k)
    return [f"section '{name}' piece {k} (bytes {k * PIECE} to {(k + 1) * PIECE})"
            for name, k in first.items()]
