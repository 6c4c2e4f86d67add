"""The compile cache: a model compiled on its first load, its artifact reused after.

An entry is one artifact, ``<folder>/<key>.bpl``. The key is a sha256 over everything the artifact
depends on: the model's bytes, the backends in order with their versions, API versions and machine
facts, the options, pins, optimizer options and input shapes, backplane's version and the format's.
Any change gives another key, so an entry never goes stale: it is simply not found. Entries are
written atomically (a temporary file in the folder, then ``os.replace``): two processes filling one
entry at once each write a whole artifact and the last rename wins; a reader sees one or the other,
never a mixture. An entry that fails its checks (truncated, corrupted) is compiled again and
replaced, never loaded.

A hit must not cost more than loading the artifact, yet the key needs the model's sha256, which for
a 437 MB model is most of a load. A model file's digest is remembered in the folder
(``model-digests.json``) under the file's identity: device, inode, size, and its modification and
change times in nanoseconds. Any write to the file moves its change time, which no tool sets back
(only the clock could), so a changed file is hashed again, as git's index trusts its stat data. A
file changed less than ``SETTLED_NS`` before it was hashed is not remembered (two writes in one
tick of its time stamps would look like one: git's "racy" case).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from backplane.artifact.compiler import Artifact, load, model_hash
from backplane.artifact.container import ArtifactError
from backplane.artifact.facts import FORMAT_VERSION, cpu
from backplane.backends.registry import BackendRegistry

log = logging.getLogger("backplane.artifact")
CACHE_VARIABLE = "BACKPLANE_COMPILE_CACHE"
"""A folder: when set, every InferenceSession of an ONNX model uses the compile cache there."""
SUFFIX = ".bpl"
DIGESTS = "model-digests.json"
SETTLED_NS = 2_000_000_000


def folder(cache_dir: str | os.PathLike | None) -> str | None:
    """The compile cache's folder: ``cache_dir`` where given, else ``$BACKPLANE_COMPILE_CACHE``."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_VARIABLE) or None
    return os.fspath(chosen) if chosen is not None else None


def key(model: Any, ids: Sequence[str], options: Mapping[str, Any], registry: BackendRegistry, *,
        pins: Mapping[str, str] | None = None, optimizer: Mapping[str, Any] | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        directory: str | None = None) -> str:
    """The entry's key: sha256 of ``key_parts`` (``directory``: the cache's folder, where a model
    file's digest is remembered)."""
    parts = key_parts(model, ids, options, registry, pins=pins, optimizer=optimizer,
                      input_shapes=input_shapes, directory=directory)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def key_parts(model: Any, ids: Sequence[str], options: Mapping[str, Any],
              registry: BackendRegistry, *, pins: Mapping[str, str] | None = None,
              optimizer: Mapping[str, Any] | None = None,
              input_shapes: Mapping[str, Sequence[int]] | None = None,
              directory: str | None = None) -> dict[str, Any]:
    """Everything an artifact depends on, as data (what ``key`` hashes)."""
    import backplane

    backends = []
    for backend_id in [*ids, "builtin"]:
        try:
            backend = registry.create(backend_id)
        except Exception:  # noqa: BLE001  # unknown here: the compile names it, with the choices
            backends.append({"id": backend_id})
            continue
        backend.options = _options(options)
        backends.append({"id": backend_id, "version": backend.version,
                         "api_version": list(backend.api_version),
                         "facts": backend.machine_facts()})
    return {"model": model_digest(model, directory), "backends": backends, "options": dict(options),
            "pins": dict(pins or {}), "optimizer": dict(optimizer or {}),
            "input_shapes": {k: list(v) for k, v in (input_shapes or {}).items()},
            "backplane": backplane.__version__, "format": list(FORMAT_VERSION), "machine": cpu()}


def fetch(directory: str, entry_key: str, compile_into: Callable[[str], Any],
          registry: BackendRegistry) -> Artifact:
    """The artifact of ``entry_key``: loaded where the entry is whole, else compiled (by
    ``compile_into(path)``, which writes atomically) and loaded."""
    path = str(Path(directory) / f"{entry_key}{SUFFIX}")
    if os.path.exists(path):
        try:
            return load(path, registry=registry)
        except ArtifactError as exc:
            log.warning("compile cache entry %s cannot be loaded, compiling again: %s", path, exc)
    compile_into(path)
    return load(path, registry=registry)


def model_digest(model: Any, directory: str | None) -> str:
    """``model_hash(model)``; for a file, remembered in ``directory`` under the file's identity."""
    if directory is None or not isinstance(model, (str, os.PathLike)):
        return model_hash(model)
    path, memo = os.path.realpath(model), Path(directory) / DIGESTS
    try:
        before = os.stat(path)
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    identity = _identity(before)
    entry = known.get(path) if isinstance(known, dict) else None
    if isinstance(entry, list) and entry[:-1] == identity:
        return str(entry[-1])
    digest = model_hash(model)
    settled = time.time_ns() - max(before.st_mtime_ns, before.st_ctime_ns) > SETTLED_NS
    if settled and _identity(os.stat(path)) == identity:  # not written to while hashed
        _remember(memo, {**(known if isinstance(known, dict) else {}), path: [*identity, digest]})
    return digest


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _remember(memo: Path, known: dict[str, Any]) -> None:
    """Write the digests atomically; a folder that cannot be written is left as it is."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=memo.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(known, tmp)
        os.replace(tmp.name, memo)
    except OSError:
        pass


def _options(options: Mapping[str, Any]) -> Any:
    from backplane.backends.api.backend import BackendOptions

    return BackendOptions(dict(options))
