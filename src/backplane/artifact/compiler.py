"""Compile once into one artifact (``compile``), load it without the model (``load``).

Compiling is what a session's load does, stopped before the workloads: import, optimize (support
queries, partitioning, the backends' ``optimize_subgraph``, copies and imports), then each backend's
``preprocess`` on each of its partitions; a partition it compiles becomes one ``Delegate`` layer
holding the blob and, beside it, the partition's portable subgraph. Loading reads the manifest,
checks it against this machine and this backplane (``check``), rebuilds the network from the
stored graph and hands it to ``Runtime.load``: no ONNX file, no support query, no partitioning;
the only backend code run is each delegate's ``init`` (and the plain layers' kernel binding).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backplane import progress
from backplane.artifact import codec, container
from backplane.artifact.container import ArtifactError
from backplane.artifact.facts import (FORMAT_VERSION, cpu, describe_backend, differences,
                                      manifest_problems)
from backplane.artifact.signing import SigningKey
from backplane.backends.api.backend import (DELEGATE_DOMAIN, BackendOptions, CompileSpec,
                                            PreprocessResult)
from backplane.backends.registry import BackendRegistry, UnknownBackendError
from backplane.backends.registry import registry as default_registry
from backplane.ir.graph import Graph, Layer
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.optimizer.partition import partition
from backplane.optimizer.report import SubgraphRecord

log = logging.getLogger("backplane.artifact")
BUILTIN = "builtin"


@dataclass
class Artifact:
    """A loaded artifact: the network to load and the manifest it came with."""

    network: OptimizedNetwork
    manifest: dict[str, Any]
    path: str


def model_hash(model: Any) -> str:
    """sha256 of the model as given: a file's bytes, the bytes, or a ModelProto serialized."""
    digest = hashlib.sha256()
    if isinstance(model, (str, os.PathLike)):
        with open(model, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 22), b""):
                digest.update(chunk)
    elif isinstance(model, (bytes, bytearray, memoryview)):
        digest.update(model)
    else:
        digest.update(model.SerializeToString(deterministic=True))
    return digest.hexdigest()


# -- compile --------------------------------------------------------------------------------------------
def delegate(network: OptimizedNetwork) -> dict[str, int]:
    """Ask each backend to preprocess each of its partitions (in bodies too); a partition it
    compiles becomes one Delegate layer. Returns the blobs made per backend id."""
    from backplane.runtime.runtime import within

    blobs: dict[str, int] = {}
    parts = [(net, backend_id, view) for net in within(network)
             for backend_id, view in partition(net.graph, skip=frozenset({BUILTIN}))]
    with progress.task("compiling the partitions", total=len(parts)) as step:
        for net, backend_id, view in parts:
            step(f"compiling the partitions: {backend_id}, {len(view.layers)} layers", advance=0)
            backend = net.backends[backend_id]
            part = portable_graph(view.layers, view.inputs, view.outputs, net.graph, backend_id)
            specs = compile_specs(backend_id, net.backend_options)
            result = backend.preprocess(part, specs)
            step()
            if result is None:
                continue
            layer = delegate_layer(backend_id, part, specs, result)
            _substitute(net, view.layers, layer)
            blobs[backend_id] = blobs.get(backend_id, 0) + 1
    return blobs


def portable_graph(layers: Sequence[Layer], inputs: Sequence[str], outputs: Sequence[str],
                   graph: Graph, backend_id: str) -> Graph:
    """A partition as a graph of its own: its layers, boundary, tensor infos and constants."""
    names = {n for layer in layers for n in (*layer.inputs, *layer.outputs) if n}
    return Graph(f"{backend_id} partition", list(layers), list(inputs), list(outputs),
                 {n: graph.info(n) for n in names},
                 {n: graph.constants[n] for n in names if n in graph.constants}, dict(graph.opsets))


def compile_specs(backend_id: str, options: Mapping[str, Any]) -> list[CompileSpec]:
    """The backend's own options, as the compile specs its partitions are preprocessed with."""
    return [CompileSpec(key, value) for key, value in sorted(options.items())
            if key.startswith(f"{backend_id}.")]


def delegate_layer(backend_id: str, part: Graph, specs: Sequence[CompileSpec],
                   result: PreprocessResult) -> Layer:
    first, last = part.layers[0].name.split("+")[0], part.layers[-1].name.split("+")[-1]
    attrs = {"blob": codec.Blob(result.processed_bytes),
             "compile_specs": [[spec.key, spec.value] for spec in specs], "graph": part,
             "debug_handle_map": {k: list(v) for k, v in result.debug_handle_map.items()}}
    return Layer(f"Delegate[{backend_id}][{first}..{last}]({len(part.layers)} layers)", "Delegate",
                 list(part.inputs), list(part.outputs), attrs, DELEGATE_DOMAIN, 1, backend_id)


def _substitute(net: OptimizedNetwork, old: Sequence[Layer], layer: Layer) -> None:
    gone = set(map(id, old))
    position = min(i for i, lay in enumerate(net.graph.layers) if id(lay) in gone)
    kept = [lay for lay in net.graph.layers if id(lay) not in gone]
    net.graph.layers = kept[:position] + [layer] + kept[position:]
    net.graph.toposort()
    names = {lay.name for lay in old}
    for placement in net.report.layers.values():
        if placement.name in names or placement.substituted_by in names:
            placement.substituted_by = layer.name
    net.report.subgraphs.append(SubgraphRecord(layer.backend or "", sorted(names), "delegated"))


def save(network: OptimizedNetwork, path: str | os.PathLike, manifest: dict[str, Any],
         key: SigningKey | None = None, durable: bool = True) -> int:
    """Write ``network`` (delegated already) and ``manifest`` as one artifact, signed with ``key``
    where given; returns its size (``durable``: see ``container.write``)."""
    encoder = codec.Encoder()
    encoded = encoder.network(network)
    table, constants = codec.tensor_section(encoder.tensors)
    sections = [("constants", constants)]
    sections += [(f"blob:{i}", blob) for i, blob in enumerate(encoder.blobs)]
    header = {"format": list(FORMAT_VERSION), "manifest": manifest, "tensors": table,
              "network": encoded}
    return container.write(path, header, sections, key, durable)


def manifest_of(network: OptimizedNetwork, blobs: Mapping[str, int], *, model_sha256: str,
                metadata: Mapping[str, Any], preferences: Sequence[str],
                input_shapes: Mapping[str, Sequence[int]] | None) -> dict[str, Any]:
    import backplane
    from backplane.runtime.runtime import within

    backends: dict[str, Any] = {}
    for net in within(network):
        for backend_id, backend in net.backends.items():
            backends.setdefault(backend_id, backend)
    return {"format": list(FORMAT_VERSION), "backplane": backplane.__version__,
            "model": {"sha256": model_sha256, "metadata": dict(metadata)},
            "preferences": list(preferences),
            "backend_options": codec.Encoder().value(dict(network.backend_options)),
            "optimizer": dataclasses.asdict(network.options),
            "input_shapes": {k: list(v) for k, v in (input_shapes or {}).items()},
            "backends": [describe_backend(b, blobs.get(i, 0)) for i, b in backends.items()],
            "machine": cpu()}


# -- load -----------------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike, key: SigningKey | None = None,
                  ) -> tuple[container.Contents, dict[str, Any]]:
    """Read and check the artifact (signed with ``key`` where given) and its manifest's format."""
    contents = container.read(path, key)
    major, minor = contents.header["format"]
    if major != FORMAT_VERSION[0] or minor > FORMAT_VERSION[1]:
        raise ArtifactError(f"'{contents.path}' has artifact format {major}.{minor}; this backplane "
                            f"reads format {FORMAT_VERSION[0]}.0 to "
                            f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}")
    problems = manifest_problems(contents.header["manifest"])
    if problems:
        raise ArtifactError(f"'{contents.path}' is malformed: its manifest's " +
                            "; ".join(problems))
    return contents, contents.header["manifest"]


def load(source: str | os.PathLike | container.Contents, *,
         registry: BackendRegistry | None = None, repreprocess: bool = False,
         key: SigningKey | None = None) -> Artifact:
    """Read, check and rebuild an artifact's network, ready for ``Runtime.load``.

    ``repreprocess``: where a backend's blobs were made for other machine facts or another version
    of the backend, preprocess its partitions again from their stored subgraphs instead of
    refusing the artifact. ``key``: the artifact must be signed with it (``read_manifest``'s
    contents given must have been read with it)."""
    registry = registry or default_registry
    if isinstance(source, container.Contents):
        contents, manifest = source, source.header["manifest"]
        if key is not None and contents.verified_key != key.id:
            raise ArtifactError(f"'{contents.path}' was read without checking its signature "
                                f"under key {key.id}: read it with read_manifest(path, key)")
    else:
        contents, manifest = read_manifest(source, key)
    try:
        stale = check(manifest, registry, repreprocess, contents.path)
        network = _decoded(contents, registry)
    except (KeyError, IndexError, TypeError, ValueError, RecursionError) as exc:
        # the header is data someone else may have written: any shape it has is refused by name
        raise ArtifactError(f"'{contents.path}' is malformed: {type(exc).__name__}: "
                            f"{str(exc)[:500]}") from exc
    if stale:
        _preprocess_again(network, stale)
    return Artifact(network, manifest, contents.path)


def _decoded(contents: container.Contents, registry: BackendRegistry) -> OptimizedNetwork:
    tensors = codec.tensors_from(contents.header["tensors"], contents.sections["constants"])

    checked = [entry["id"] for entry in contents.header["manifest"]["backends"]]

    def make_backends(ids: list[str], options: Mapping[str, Any]) -> dict[str, Any]:
        made = {}
        for backend_id in ids:
            if backend_id not in checked:  # check() vetted the manifest's backends, only those
                raise ArtifactError(f"'{contents.path}': its network uses backend "
                                    f"{str(backend_id)[:100]!r}, which its manifest does not "
                                    f"list ({', '.join(checked)})")
            made[backend_id] = registry.create(backend_id)
            made[backend_id].options = BackendOptions(dict(options))
        return made

    blobs = {name: data for name, data in contents.sections.items() if name.startswith("blob:")}
    return codec.Decoder(tensors, blobs, make_backends).network(contents.header["network"])


def check(manifest: dict[str, Any], registry: BackendRegistry, repreprocess: bool,
          where: str) -> set[str]:
    """ArtifactError for a backend that is missing or unavailable here, or of another major API
    version; for blobs made for other machine facts or another backend version too, unless
    ``repreprocess``: then the ids of the backends whose partitions must be preprocessed again."""
    stale: set[str] = set()
    for entry in manifest["backends"]:
        backend_id = entry["id"]
        try:
            backend = registry.create(backend_id)
        except UnknownBackendError as exc:
            raise ArtifactError(f"'{where}' needs backend {backend_id} {entry['version']}, which "
                                f"is not registered here: {exc}") from exc
        status = backend.availability()
        if not status.ok:
            raise ArtifactError(f"'{where}' needs backend {backend_id}, which is not available "
                                f"here: {status.reason}")
        stored_api, api = tuple(entry["api_version"]), tuple(backend.api_version)
        if stored_api[0] != api[0]:
            raise ArtifactError(f"'{where}' was compiled for backend {backend_id} of API version "
                                f"{stored_api[0]}.{stored_api[1]}; the {backend_id} here has API "
                                f"version {api[0]}.{api[1]} (the major versions must be equal)")
        if not entry["blobs"]:
            continue
        problems = differences(entry["facts"], backend.machine_facts())
        if entry["version"] != backend.version:
            problems.append(f"version: the blobs were made by {backend_id} {entry['version']}, "
                            f"this one is {backend.version}")
        if problems and not repreprocess:
            raise ArtifactError(f"'{where}': the {entry['blobs']} blob(s) of {backend_id} cannot "
                                f"load here:\n  " + "\n  ".join(problems) + "\n(compile the "
                                f"model again here, or load with repreprocess=True to preprocess "
                                f"those partitions again from their stored subgraphs)")
        if problems:
            log.warning("%s: %s preprocesses its partitions again: %s", where, backend_id,
                        "; ".join(problems))
            stale.add(backend_id)
    return stale


def _preprocess_again(network: OptimizedNetwork, stale: set[str]) -> None:
    from backplane.runtime.runtime import within

    for net in within(network):
        for layer in list(net.graph.layers):
            if layer.domain != DELEGATE_DOMAIN or layer.backend not in stale:
                continue
            specs = [CompileSpec(k, v) for k, v in layer.attrs["compile_specs"]]
            result = net.backends[layer.backend].preprocess(layer.attrs["graph"], specs)
            if result is not None:
                layer.attrs = {**layer.attrs, "blob": result.processed_bytes}
                continue
            position = net.graph.layers.index(layer)  # no blob now: the partition's plain layers
            net.graph.layers[position:position + 1] = layer.attrs["graph"].layers
            net.graph.constants.update(layer.attrs["graph"].constants)
