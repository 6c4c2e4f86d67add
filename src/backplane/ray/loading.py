"""One session per Ray actor, from what the driver handed over: a path, bytes or an object ref.

A path (an ONNX file, or an artifact made by ``backplane.compile``) goes to ``InferenceSession``
as it is: every worker must see the file there. Bytes travel through Ray's object store, put there
once by the driver (``ray.put``) and read by each actor: ONNX bytes go to the session as bytes,
an artifact's bytes are written to a file of the actor's first (an artifact loads from a file,
whose constants it maps).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import onnx

import ray
from backplane.artifact import is_artifact
from backplane.session import BackendSpec, InferenceSession, SessionOptions

Model = str | os.PathLike | bytes | onnx.ModelProto | ray.ObjectRef


def shipped(model: Model) -> Model:
    """What to hand the actors for ``model``: bytes as one object in Ray's object store (put once,
    not pickled into every actor's arguments), anything else as it is."""
    if isinstance(model, (bytes, bytearray, memoryview)):
        return ray.put(bytes(model))
    return model


def threads_of(num_cpus: float, backends: Sequence[BackendSpec] | None,
               sess_options: SessionOptions | None) -> SessionOptions | None:
    """The session's options for an actor of ``num_cpus`` CPUs: as given where given; else as many
    threads as CPUs (``intra_op_num_threads``, CpuAcc's), unless a backend's options set its own."""
    if sess_options is not None or num_cpus < 1:
        return sess_options
    for spec in backends or ():
        options = {} if isinstance(spec, str) else spec[1]
        if any(key.rsplit(".", 1)[-1] == "threads" for key in options):
            return None
    return SessionOptions(intra_op_num_threads=int(num_cpus))


def load_session(model: Model, backends: Sequence[BackendSpec] | None,
                 sess_options: SessionOptions | None,
                 session_kwargs: Mapping[str, Any] | None) -> InferenceSession:
    """The actor's session. backplane's own errors (a model that does not load, an unknown backend
    or option) are raised as they are: they fail the actor with their message."""
    if isinstance(model, ray.ObjectRef):
        model = ray.get(model)
    if isinstance(model, (bytearray, memoryview)):
        model = bytes(model)
    if not (isinstance(model, bytes) and is_artifact(model)):
        return InferenceSession(model, sess_options, backends=backends, **dict(session_kwargs or {}))
    path = _artifact_file(model)
    try:
        return InferenceSession(path, sess_options, backends=backends, **dict(session_kwargs or {}))
    finally:
        with contextlib.suppress(OSError):  # where a mapped file cannot be removed, it stays
            os.unlink(path)


def _artifact_file(contents: bytes) -> str:
    """The artifact written to a file of this process's, removed once loaded (the mapping of its
    constants keeps the data; nothing is left behind when the actor dies)."""
    handle, path = tempfile.mkstemp(prefix="backplane-", suffix=".bpl")
    with os.fdopen(handle, "wb") as file:
        file.write(contents)
    return path
