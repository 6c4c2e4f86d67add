"""Ahead of time: a model compiled once into one artifact, loaded anywhere without the model.

``compile(model, backends, output)`` writes the artifact; ``InferenceSession(artifact)`` (or
``load``) loads it; ``InferenceSession(model, cache_dir=...)`` compiles on first load and reuses
the artifact after (``cache``). The format and the delegate contract: ``docs/artifact.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backplane.artifact.compiler import Artifact, load, read_manifest
    from backplane.artifact.container import ArtifactError, is_artifact
    from backplane.artifact.signing import SigningKey
    from backplane.optimizer.optimize import OptimizerOptions
    from backplane.runtime.runtime import Runtime
    from backplane.session import BackendSpec, SessionOptions

__all__ = ["Artifact", "ArtifactError", "SigningKey", "build", "compile", "is_artifact", "load",
           "read_manifest"]

_LAZY = {"Artifact": "compiler", "delegate": "compiler", "load": "compiler",
         "manifest_of": "compiler", "model_hash": "compiler", "read_manifest": "compiler",
         "save": "compiler", "ArtifactError": "container", "is_artifact": "container",
         "SigningKey": "signing", "signing_key": "signing"}
"""Names imported at their first use: a session of a model file, with no compile cache, reads no
artifact, and the modules that write and read one (their hashing, signing, temporary files) are
not on its load's path (issue 27, item 5). ``cache`` and the other submodules load the same way."""


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"backplane.artifact.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if name in ("cache", "codec", "compiler", "container", "facts", "signing"):
        return importlib.import_module(f"backplane.artifact.{name}")
    raise AttributeError(f"module 'backplane.artifact' has no attribute {name!r}")


def compile(model: Any, backends: Sequence[BackendSpec] | None = None,
            output: str | os.PathLike | None = None, *,
            sess_options: SessionOptions | None = None,
            provider_options: Sequence[Mapping[str, Any]] | None = None,
            pins: Mapping[str, str] | None = None,
            optimizer_options: OptimizerOptions | None = None,
            input_shapes: Mapping[str, Sequence[int]] | None = None,
            sign_key: SigningKey | bytes | None = None) -> int:
    """Compile ``model`` (a path, bytes or ModelProto) for ``backends`` (as ``InferenceSession``
    takes them) into the artifact ``output`` (default: the model's path with ".bpl"); returns the
    artifact's size in bytes. ``sign_key``: sign it with this key (``SigningKey`` or its bytes;
    default: ``sess_options.artifact_key``); a session whose ``SessionOptions.artifact_key`` is
    that key loads only artifacts signed with it."""
    from backplane.artifact.signing import signing_key
    from backplane.session import (backend_list, default_backends, optimizer_options_for,
                                   qualified)

    if output is None:
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError("output= is needed where the model is not a file")
        output = os.path.splitext(os.fspath(model))[0] + ".bpl"
    ids, per_backend = backend_list(backends or default_backends(), provider_options)
    options = dict(qualified(per_backend))
    threads = sess_options.intra_op_num_threads if sess_options is not None else 0
    if threads:
        options.setdefault("CpuAcc.threads", threads)
    all_pins = {**(sess_options.pins if sess_options is not None else {}), **(pins or {})}
    if sess_options is not None:
        optimizer_options = optimizer_options_for(sess_options, optimizer_options)
        sign_key = sign_key if sign_key is not None else sess_options.artifact_key
    return build(model, output, ids, options, pins=all_pins, optimizer_options=optimizer_options,
                 input_shapes=input_shapes, sign_key=signing_key(sign_key))


def build(model: Any, output: str | os.PathLike, ids: Sequence[str], options: Mapping[str, Any], *,
          pins: Mapping[str, str] | None = None, optimizer_options: OptimizerOptions | None = None,
          input_shapes: Mapping[str, Sequence[int]] | None = None,
          runtime: Runtime | None = None, sign_key: SigningKey | None = None,
          durable: bool = True) -> int:
    """Import, optimize, preprocess and write: ``compile`` with the options already resolved
    (``durable``: see ``container.write``; the compile cache writes without an fsync)."""
    from backplane import against_cpu
    from backplane.artifact.compiler import delegate, manifest_of, model_hash, save
    from backplane.frontends.onnx import import_onnx
    from backplane.frontends.onnx_file import read_model
    from backplane.optimizer.optimize import optimize
    from backplane.runtime.runtime import Runtime, RuntimeOptions
    from backplane.session import metadata_of

    runtime = runtime or Runtime(RuntimeOptions(backend_options=dict(options)))
    digest = model_hash(model)
    read = read_model(model)  # each weight read into an array of its own: never proto and arrays both
    meta = metadata_of(read.proto)
    graph = import_onnx(read, input_shapes)
    del read
    network = optimize(graph, ids, pins=pins, options=optimizer_options, registry=runtime.registry,
                       backend_options=dict(options))
    network = against_cpu.at_compile(
        runtime, graph, network, ids, options, pins or {},
        lambda without: optimize(graph, without, pins=pins, options=optimizer_options,
                                 registry=runtime.registry, backend_options=dict(options)))
    runtime.prepare(network)
    blobs = delegate(network)
    manifest = manifest_of(network, blobs, model_sha256=digest, metadata=vars(meta),
                           preferences=ids, input_shapes=input_shapes)
    manifest["pins"] = dict(pins or {})
    return save(network, output, manifest, sign_key, durable)
