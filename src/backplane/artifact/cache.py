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

Whoever can write the folder chooses what its users load, so the folder is made 0700 and is not used
(a warning, then the model compiled in memory) where it or its entry belongs to another user or is
writable by group or others. An entry is loaded only where its manifest was made from this key's
parts (the model's sha256, backends, options, ...), else compiled again and replaced; with
``SessionOptions.artifact_key`` only where it is signed with that key, and a remembered digest is
taken only where it is signed with it too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from backplane.artifact.codec import Encoder
from backplane.artifact.compiler import Artifact, load, model_hash, read_manifest
from backplane.artifact.container import ArtifactError
from backplane.artifact.facts import FORMAT_VERSION, cpu
from backplane.artifact.signing import SigningKey
from backplane.backends.registry import BackendRegistry

log = logging.getLogger("backplane.artifact")
CACHE_VARIABLE = "BACKPLANE_COMPILE_CACHE"
"""A folder: when set, every InferenceSession of an ONNX model uses the compile cache there."""
SUFFIX = ".bpl"
DIGESTS = "model-digests.json"
SETTLED_NS = 2_000_000_000


def folder(cache_dir: str | os.PathLike | None) -> str | None:
    """The compile cache's folder: ``cache_dir`` where given, else ``$BACKPLANE_COMPILE_CACHE``;
    made private (0700) where it does not exist. None, with a warning saying why, where it is
    not safe to load from: owned by another user, or writable by its group or by others (whoever
    can write it chooses what this process loads). The session then compiles in memory, as pip
    disables a cache folder that is not the user's."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_VARIABLE) or None
    if chosen is None:
        return None
    path = os.fspath(chosen)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        problem = unsafe(os.stat(path), "folder")
    except OSError as exc:
        problem = f"it cannot be made or read: {exc}"
    if problem is not None:
        log.warning("the compile cache %s is not used: %s; the model is compiled in memory "
                    "(make it a folder of your own: chmod go-w, or another cache_dir)", path,
                    problem)
        return None
    return path


def unsafe(stat: os.stat_result, what: str) -> str | None:
    """Why a cache folder or entry must not be used: owned by another user than this process's
    (effective) one, or writable by group or others; None where it may be (and where the system
    has no users: Windows)."""
    if not hasattr(os, "geteuid"):
        return None
    user = os.geteuid()
    if stat.st_uid != user:
        return f"the {what} belongs to user {stat.st_uid}, not to this process's user {user}"
    if stat.st_mode & 0o022:
        return (f"the {what} is writable by its group or by others (mode "
                f"{stat.st_mode & 0o7777:o})")
    return None


def key(model: Any, ids: Sequence[str], options: Mapping[str, Any], registry: BackendRegistry, *,
        pins: Mapping[str, str] | None = None, optimizer: Mapping[str, Any] | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        directory: str | None = None) -> str:
    """The entry's key: sha256 of ``key_parts`` (``directory``: the cache's folder, where a model
    file's digest is remembered)."""
    return entry_key(key_parts(model, ids, options, registry, pins=pins, optimizer=optimizer,
                               input_shapes=input_shapes, directory=directory))


def entry_key(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def key_parts(model: Any, ids: Sequence[str], options: Mapping[str, Any],
              registry: BackendRegistry, *, pins: Mapping[str, str] | None = None,
              optimizer: Mapping[str, Any] | None = None,
              input_shapes: Mapping[str, Sequence[int]] | None = None,
              directory: str | None = None, sign_key: SigningKey | None = None) -> dict[str, Any]:
    """Everything an artifact depends on, as data (what ``key`` hashes; ``sign_key``: the
    remembered model digests are signed with it)."""
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
    return {"model": model_digest(model, directory, sign_key), "backends": backends,
            "options": dict(options), "pins": dict(pins or {}), "optimizer": dict(optimizer or {}),
            "input_shapes": {k: list(v) for k, v in (input_shapes or {}).items()},
            "backplane": backplane.__version__, "format": list(FORMAT_VERSION), "machine": cpu()}


def fetch(directory: str, parts: Mapping[str, Any], compile_into: Callable[[str], Any],
          registry: BackendRegistry, key: SigningKey | None = None) -> Artifact:
    """The artifact of ``parts`` (``key_parts``): loaded where the entry is whole, safe
    (``unsafe``), signed with ``key`` where given, and made from these parts (its manifest's
    model sha256, backends and options are these); else compiled (by ``compile_into(path)``,
    which writes atomically), replacing it, and loaded."""
    path = str(Path(directory) / f"{entry_key(parts)}{SUFFIX}")
    if os.path.lexists(path):
        try:
            return _hit(path, parts, registry, key)
        except (ArtifactError, OSError) as exc:
            log.warning("compile cache entry %s is not used, compiling again: %s", path, exc)
    compile_into(path)
    mode = os.stat(path).st_mode
    if mode & 0o022:  # a umask of 0: the entry would be refused at its next use
        os.chmod(path, mode & 0o755)
    return load(path, registry=registry, key=key)


def _hit(path: str, parts: Mapping[str, Any], registry: BackendRegistry,
         key: SigningKey | None) -> Artifact:
    problem = unsafe(os.stat(path), "entry")
    if problem is not None:
        raise ArtifactError(problem)
    contents, manifest = read_manifest(path, key)
    differs = differences(manifest, parts)
    if differs:
        raise ArtifactError("it holds another artifact than this key's: " + "; ".join(differs))
    return load(contents, registry=registry, key=key)


def differences(manifest: Mapping[str, Any], parts: Mapping[str, Any]) -> list[str]:
    """Where an entry's manifest and the key's parts disagree (an entry written under another
    entry's name): the model's sha256, backends, options, pins, shapes, versions, machine."""
    pairs = {"model sha256": (manifest["model"]["sha256"], parts["model"]),
             "backends": (manifest["preferences"], [b["id"] for b in parts["backends"][:-1]]),
             "backend options": (manifest["backend_options"], Encoder().value(parts["options"])),
             "pins": (manifest["pins"], parts["pins"]),
             "optimizer options": (manifest["optimizer"], parts["optimizer"]),
             "input shapes": (manifest["input_shapes"], parts["input_shapes"]),
             "backplane": (manifest["backplane"], parts["backplane"]),
             "format": (manifest.get("format"), parts["format"]),
             "machine": (manifest["machine"], parts["machine"])}
    return [f"its {what} {str(theirs)[:200]}, this key's {str(ours)[:200]}"
            for what, (theirs, ours) in pairs.items() if _json(theirs) != _json(ours)]


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def model_digest(model: Any, directory: str | None, sign_key: SigningKey | None = None) -> str:
    """``model_hash(model)``; for a file, remembered in ``directory`` under the file's identity
    (with ``sign_key``: only a remembered digest signed with it is taken)."""
    if directory is None or not isinstance(model, (str, os.PathLike)):
        return model_hash(model)
    path, memo = os.path.realpath(model), Path(directory) / DIGESTS
    before = os.stat(path)
    known = _known(memo)
    identity = _identity(before)
    entry = known.get(path)
    if entry is not None and entry[:5] == identity and (
            sign_key is None or entry[6:] == [_memo_mac(sign_key, path, entry[:6])]):
        return entry[5]
    digest = model_hash(model)
    settled = time.time_ns() - max(before.st_mtime_ns, before.st_ctime_ns) > SETTLED_NS
    if settled and _identity(os.stat(path)) == identity:  # not written to while hashed
        remembered = [*identity, digest]
        if sign_key is not None:
            remembered.append(_memo_mac(sign_key, path, remembered))
        _remember(memo, {**known, path: remembered})
    return digest


def _known(memo: Path) -> dict[str, list[Any]]:
    """The remembered digests: path -> [dev, ino, size, mtime_ns, ctime_ns, sha256(, mac)]; the
    file is input from the folder, so an entry of any other shape is dropped (hashed again)."""
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {path: entry for path, entry in known.items()
            if isinstance(entry, list) and len(entry) in (6, 7)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in entry[:5])
            and all(isinstance(t, str) and _HEX64.fullmatch(t) for t in entry[5:])}


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _memo_mac(sign_key: SigningKey, path: str, entry: list[Any]) -> str:
    return sign_key.mac(b"backplane model digest\0", json.dumps([path, *entry]).encode()).hex()


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _remember(memo: Path, known: dict[str, Any]) -> None:
    """Write the digests atomically; a folder that cannot be written is left as it is."""
    try:
        memo.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=memo.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(known, tmp)
        os.replace(tmp.name, memo)
    except OSError:
        pass


def _options(options: Mapping[str, Any]) -> Any:
    from backplane.backends.api.backend import BackendOptions

    return BackendOptions(dict(options))
