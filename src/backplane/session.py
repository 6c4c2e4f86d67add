"""InferenceSession: the ONNX Runtime-style facade over import, optimize, load and run."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from backplane.frontends.onnx import import_onnx
from backplane.ir.graph import TensorInfo
from backplane.optimizer.optimize import OptimizedNetwork, OptimizerOptions, optimize
from backplane.optimizer.report import PlacementReport
from backplane.runtime.loaded_network import LayerTiming
from backplane.runtime.runtime import InvalidInputError, Runtime, RuntimeOptions

DEFAULT_BACKENDS = ("CpuRef",)


@dataclass(frozen=True)
class NodeArg:
    """An input or output as ONNX Runtime describes it: name, shape (None / str for free dims), type."""

    name: str
    shape: list[int | str | None] | None
    type: str


def _node_arg(name: str, info: TensorInfo) -> NodeArg:
    if info.dtype is None:
        return NodeArg(name, None, "unknown")
    elem = onnx.helper.tensor_dtype_to_string(onnx.helper.np_dtype_to_tensor_dtype(info.dtype))
    elem = elem.removeprefix("TensorProto.").lower()
    return NodeArg(name, list(info.shape) if info.shape is not None else None, f"tensor({elem})")


class InferenceSession:
    """Load an ONNX model onto a list of backends, in order of preference, and run it.

    Args:
        model: a path, the serialized bytes, or an onnx.ModelProto.
        backends: backend ids, most preferred first; each layer runs on the first that supports it.
        pins: layer name or op type -> backend id, tried before the preferences.
        optimizer_options: turn generic passes off.
        runtime: a Runtime to load into (one per session by default); its
            ``RuntimeOptions.backend_options`` are this session's backend options.
    """

    def __init__(self, model: str | os.PathLike | bytes | onnx.ModelProto,
                 backends: Sequence[str] = DEFAULT_BACKENDS, *, pins: Mapping[str, str] | None = None,
                 optimizer_options: OptimizerOptions | None = None, runtime: Runtime | None = None,
                 input_shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        self.graph = import_onnx(model, input_shapes)
        self.runtime = runtime or Runtime(RuntimeOptions())
        self.optimized: OptimizedNetwork = optimize(
            self.graph, list(backends), pins=pins, options=optimizer_options,
            registry=self.runtime.registry, backend_options=self.runtime.options.backend_options)
        self.network_id = self.runtime.load(self.optimized)
        self.optimized = self.runtime.network(self.network_id).network  # as loaded: see Runtime.load
        self._outputs = list(self.optimized.output_names)

    @property
    def report(self) -> PlacementReport:
        return self.optimized.report

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(n, self.graph.info(n)) for n in self.optimized.input_names]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(n, self.graph.info(n)) for n in self._outputs]

    def get_providers(self) -> list[str]:
        return list(self.optimized.report.preferences)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        """Outputs named in ``output_names`` (all when None), in that order."""
        results = self.runtime.run(self.network_id, input_feed)
        return self._select(output_names, results)

    def run_profiled(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                     ) -> tuple[list[Any], list[LayerTiming]]:
        results, timings = self.runtime.run_profiled(self.network_id, input_feed)
        return self._select(output_names, results), timings

    def _select(self, output_names: Sequence[str] | None, results: list[Any]) -> list[Any]:
        if output_names is None:
            return results
        index = {name: i for i, name in enumerate(self._outputs)}
        unknown = [name for name in output_names if name not in index]
        if unknown:
            raise InvalidInputError(f"{unknown}: not output(s) of the model; its outputs are: "
                                    f"{', '.join(self._outputs)}")
        return [results[index[name]] for name in output_names]

    def close(self) -> None:
        self.runtime.unload(self.network_id)
