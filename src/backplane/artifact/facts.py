"""The manifest's facts: what made the artifact, and what its blobs depend on where they load."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

FORMAT_VERSION = (1, 2)
"""The artifact format: a reader loads a file of its major version whose minor is not above its own.
1.2: each section's checksum is its XXH3-64 (1.1: its CRC-32, 1.0: its sha256, both still read)."""

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
"""The instruction sets a compiled kernel may be built for (x86 flags, Arm features)."""


@functools.lru_cache(maxsize=1)
def cpu() -> dict[str, str]:
    """The processor's name and the instruction sets of ``ISA_FLAGS`` it has, from /proc/cpuinfo."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                name = value.strip()
            elif key in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return {"cpu": name, "isa": " ".join(f for f in ISA_FLAGS if f in flags),
            "machine": platform.machine()}


def describe_backend(backend: Any, blobs: int) -> dict[str, Any]:
    """A backend's entry in the manifest: id, versions, its blobs, the facts they depend on."""
    return {"id": backend.id, "version": backend.version, "api_version": list(backend.api_version),
            "blobs": blobs, "facts": backend.machine_facts() if blobs else {}}


def differences(stored: dict[str, str], here: dict[str, str]) -> list[str]:
    """Each fact that differs: its name, the artifact's value and this machine's."""
    return [f"{name}: the artifact was compiled for {stored.get(name)!r}, this machine has "
            f"{here.get(name)!r}" for name in sorted(set(stored) | set(here))
            if stored.get(name) != here.get(name)]
