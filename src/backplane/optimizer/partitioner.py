"""``backplane.partition``: a model's layers tagged for delegation, without loading it (ExecuTorch).

ExecuTorch's partitioner "tag[s] the nodes to be lowered to the backend" and returns the tags with a
``DelegationSpec(backend_id, compile_specs)`` each. Here the tags come from the optimizer's own
placement step (its pins, its preferences, its reasons) answered by the support registry alone
(``backends/registry/support.py``): no backend is made, nothing compiled, no workload created. The
tags are those ``optimize`` reports where no backend's ``optimize_subgraph`` moves a layer (it can:
OpenVINO gives back the layers its plugin refuses as a whole partition, and a network's report
holds what a load will run). Control-flow layers stay with builtin, untagged; their bodies are not
partitioned here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backplane.backends.api.backend import check_options
from backplane.backends.registry.support import SupportRegistry
from backplane.backends.registry.support import supports as default_supports
from backplane.ir.graph import Graph
from backplane.optimizer.optimize import (OptimizationError, OptimizerOptions, _assign,
                                          _run_passes)
from backplane.optimizer.partition import BUILTIN, DelegationSpec, delegation_tags
from backplane.optimizer.report import PlacementReport


@dataclass
class PartitionResult:
    """ExecuTorch's PartitionResult: the tagged model and each tag's DelegationSpec."""

    graph: Graph
    """The model after the generic passes, each layer's ``backend`` set (a copy: the caller's
    graph is untouched)."""
    tags: dict[str, str]
    """Layer name -> delegation tag; builtin's layers (control flow, sequences) have none."""
    partition_tags: dict[str, DelegationSpec]
    report: PlacementReport
    """Every support decision, with each refusal's reason; each layer's ``tag``."""

    def layers_of(self, tag: str) -> list[str]:
        """The names of the layers ``tag`` holds, in execution order."""
        if tag not in self.partition_tags:
            raise KeyError(f"no delegation tag '{tag}'; the tags are: "
                           f"{', '.join(self.partition_tags) or '(none)'}")
        return [layer.name for layer in self.graph.layers if self.tags.get(layer.name) == tag]


def partition(model: Graph | str | os.PathLike | bytes | Any, backends: Sequence[str], *,
              pins: Mapping[str, str] | None = None,
              backend_options: Mapping[str, object] | None = None,
              options: OptimizerOptions | None = None,
              supports: SupportRegistry | None = None) -> PartitionResult:
    """Tag ``model``'s layers with the partitions ``backends`` (in preference order) would take.

    ``model``: a Graph, or an ONNX model (path, bytes, ModelProto) imported first. ``pins`` and
    ``options`` are ``optimize``'s; ``backend_options`` become each tag's compile specs. An id
    the support registry does not know is an OptimizationError naming the known backends; a
    backend unavailable here refuses every layer with its reason; an option named after a backend
    that it does not take is an OptionError, as in ``optimize``."""
    graph = model if isinstance(model, Graph) else _imported(model)
    graph = graph.private_copy()
    _run_passes(graph, options or OptimizerOptions())
    supports = supports or default_supports
    pins = dict(pins or {})
    if not backends:
        raise OptimizationError("no backend preferences given to partition")
    report = PlacementReport(list(backends))
    asked = dict.fromkeys([*backends, *pins.values(), BUILTIN])
    try:
        known = {backend_id: supports.support(backend_id) for backend_id in asked}
    except KeyError as exc:  # UnknownBackendError: its message names the known backends
        raise OptimizationError(str(exc)) from exc
    for support in known.values():  # a misspelled option is an error, as ``optimize`` makes it
        if hasattr(support, "OPTIONS"):
            check_options(support, backend_options or {})  # type: ignore[arg-type]
    _assign(graph, known, pins, report)  # type: ignore[arg-type]  # a layer support suffices
    tags, specs = delegation_tags(graph, backend_options)
    for placement in report.layers.values():
        placement.tag = tags.get(placement.name)
    report.delegations = specs
    return PartitionResult(graph, tags, specs, report)


def _imported(model: Any) -> Graph:
    from backplane.frontends.onnx import import_onnx

    return import_onnx(model)
