"""What a session checks before it loads (split from ``session.py``): its arguments placed by kind
(``by_kind``), pins that name a layer or an op type of the model, and an artifact's manifest against
the backends, options and input shapes a session asks for."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import onnx

from backplane import artifact
from backplane.ir.graph import Graph, Layer
from backplane.session_options import BackendSpec, SessionOptions

_log = logging.getLogger("backplane.session")


def check_pins(graph: Graph, pins: Mapping[str, str]) -> None:
    """A pin naming neither a layer nor an op type of the model (its bodies included) is an error,
    with the closest names; an ONNX op type the model does not use is only logged (one pin list
    serves many models)."""
    names: set[str] = set()
    op_types: set[str] = set()
    for layer in _all_layers(graph):
        names.add(layer.name)
        op_types.add(layer.op_type)
    for key in pins:
        if key in names or key in op_types:
            continue
        if onnx.defs.has(key):
            _log.info("pin %s: the model has no %s layer; the pin does nothing", key, key)
            continue
        close = difflib.get_close_matches(key, [*op_types, *names], n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"pin '{key}': no layer of the model has that name or op type{hint}; a pin "
                         f"names a layer or an op type, and this model's op types are: "
                         f"{', '.join(sorted(op_types))}")


def _all_layers(graph: Graph) -> Iterator[Layer]:
    for layer in graph.layers:
        yield layer
        for value in layer.attrs.values():
            if isinstance(value, Graph):
                yield from _all_layers(value)


def stored_artifact(model: Any, key: artifact.SigningKey | None,
                     ) -> tuple[Any, dict[str, Any]] | None:
    """An artifact's contents and manifest, read and checked (signed with ``key`` where given),
    or None where ``model`` is not one."""
    if isinstance(model, (str, os.PathLike)) and artifact.is_artifact(model):
        return artifact.read_manifest(model, key)
    return None


def artifact_backends(manifest: Mapping[str, Any]) -> list[BackendSpec]:
    """The backends an artifact was compiled for, with their options, as ``backends=`` takes them."""
    options = manifest["backend_options"]
    return [(b, {k.removeprefix(f"{b}."): v for k, v in options.items() if k.startswith(f"{b}.")})
            for b in manifest["preferences"]]


def check_artifact_choices(manifest: Mapping[str, Any], ids: Sequence[str],
                           chosen: Mapping[str, Any],
                           input_shapes: Mapping[str, Sequence[int]] | None) -> None:
    """ArtifactError where the backends, options or input shapes asked for are not the artifact's
    (its partitions and blobs were made for those)."""
    theirs = {k: v for k, v in manifest["backend_options"].items() if k != "CpuAcc.threads"}
    mine = {k: v for k, v in chosen.items() if k != "CpuAcc.threads"}  # threads: this machine's
    shapes = manifest["input_shapes"] if input_shapes is None else \
        {k: list(v) for k, v in input_shapes.items()}
    for what, given, compiled in (("backends", list(ids), manifest["preferences"]),
                                  ("backend options", mine, theirs),
                                  ("input shapes", shapes, manifest["input_shapes"])):
        if given != compiled:
            raise artifact.ArtifactError(f"the artifact was compiled for {what} {compiled!r}; "
                                         f"this session asks for {given!r} (compile again for "
                                         f"those, or give none to take the artifact's)")


def by_kind(positional: Sequence[Any], **named: Any) -> dict[str, Any]:
    """The arguments after the model, placed by what they are, as ONNX Runtime's
    ``(model, sess_options, providers, provider_options)`` and backplane's ``(model, backends,
    sess_options)`` both give them: a SessionOptions is ``sess_options``, a list of mappings
    ``provider_options``, another list the backends (``providers`` or ``backends``)."""
    if len(positional) > 3:
        raise TypeError(f"InferenceSession takes the model and at most 3 more positional "
                        f"arguments (sess_options, providers, provider_options), got "
                        f"{len(positional)}")
    for index, value in enumerate(positional, start=2):
        if isinstance(value, SessionOptions):
            name = "sess_options"
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and value \
                and all(isinstance(item, Mapping) for item in value):
            name = "provider_options"
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            name = "backends" if named["providers"] is None else "providers"
        elif value is None:
            continue
        else:
            raise TypeError(f"argument {index} of InferenceSession is a {type(value).__name__}: "
                            f"give a SessionOptions, a list of providers (backend ids) or a list "
                            f"of provider options")
        taken = [n for n in (name, *(("providers",) if name == "backends" else ()))
                 if named[n] is not None]
        if taken:
            raise TypeError(f"argument {index} of InferenceSession is {name}, and {taken[0]}= "
                            f"is given too")
        named[name] = value
    return named
