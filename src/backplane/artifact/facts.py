"""The manifest's facts: what made the artifact, and what its blobs depend on where they load."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

FORMAT_VERSION = (1, 3)
"""The artifact format: a reader loads a file of its major version whose minor is not above its own.
1.3: a file may be signed (an HMAC after the header, each section's sha256 pieces); unsigned, it is
laid out as 1.2. 1.2: each section's checksum is its XXH3-64 (1.1: its CRC-32, 1.0: its sha256,
both still read)."""

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


MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "backplane": str, "model": dict, "preferences": list, "backend_options": dict, "pins": dict,
    "optimizer": dict, "input_shapes": dict, "backends": list, "machine": dict}
BACKEND_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str, "version": str, "api_version": list, "blobs": int, "facts": dict}
METADATA_FIELDS: dict[str, type | tuple[type, ...]] = {
    "producer_name": str, "producer_version": str, "graph_name": str, "domain": str,
    "description": str, "graph_description": str, "version": int, "custom_metadata_map": dict}
"""``session.ModelMetadata``'s fields: the manifest's metadata is made into one."""


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """What in the manifest is missing or of another type than a reader uses it as (it is data
    from the file, read before anything else is checked)."""
    problems = _mistyped("", manifest, MANIFEST_FIELDS)
    if problems:
        return problems
    model = manifest["model"]
    problems += _mistyped("model.", model, {"sha256": str, "metadata": dict})
    if not problems:
        problems += _mistyped("model.metadata.", model["metadata"], METADATA_FIELDS)
        problems += [f"model.metadata has the unknown field '{k}'" for k in model["metadata"]
                     if k not in METADATA_FIELDS]
    if not all(isinstance(p, str) for p in manifest["preferences"]):
        problems.append(f"preferences are {manifest['preferences']!r}, not backend ids")
    for name, shape in manifest["input_shapes"].items():
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            problems.append(f"input shape of '{name}' is {shape!r}, not sizes >= 0")
    for k, entry in enumerate(manifest["backends"]):
        wrong = _mistyped(f"backends[{k}].", entry, BACKEND_FIELDS)
        if not wrong and (len(entry["api_version"]) != 2 or not all(map(_int, entry["api_version"]))
                          or not all(isinstance(v, str) for v in entry["facts"].values())):
            wrong = [f"backends[{k}] has api_version {entry['api_version']!r} (two integers) and "
                     f"facts {entry['facts']!r} (str values)"]
        problems += wrong
    return problems


def _mistyped(where: str, data: Any, fields: dict[str, type | tuple[type, ...]]) -> list[str]:
    if not isinstance(data, dict):
        return [f"{where.rstrip('.') or 'manifest'} is a {type(data).__name__}, not a dict"]
    return [f"{where}{name} is {str(data.get(name))[:100]!r}, not a "
            f"{getattr(kind, '__name__', kind)}" for name, kind in fields.items()
            if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool)]


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
