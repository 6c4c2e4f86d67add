"""backplane: a neural-network inference runtime whose backends plug in."""

from backplane.backends.api.backend import Backend, Support
from backplane.backends.registry import registry
from backplane.frontends.onnx import ModelError, import_onnx
from backplane.optimizer.optimize import OptimizationError, OptimizedNetwork, OptimizerOptions, optimize
from backplane.optimizer.partitioner import PartitionResult, partition
from backplane.runtime.loaded_network import ExecutionError, RunTerminated
from backplane.runtime.runtime import InvalidInputError, Runtime, RuntimeOptions
from backplane.session import InferenceSession, ModelMetadata, RunOptions, SessionOptions

__version__ = "0.1.0"

_SUBMODULES = ("placement_picture", "debug", "profiling", "io_binding", "conformance")
"""Modules reached as ``backplane.<name>`` without an import of their own, loaded at first use."""


_FROM_ARTIFACT = ("ArtifactError", "compile")
"""backplane.compile (as the issue names it) and ArtifactError, from ``backplane.artifact`` at first
use: a session of a model file reads no artifact (issue 27, item 5: the import's cost)."""


def __getattr__(name: str) -> object:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"backplane.{name}")
    if name in _FROM_ARTIFACT:
        return getattr(importlib.import_module("backplane.artifact"), name)
    raise AttributeError(f"module 'backplane' has no attribute {name!r}")

__all__ = [
    "ArtifactError", "Backend", "ExecutionError", "InferenceSession", "InvalidInputError",
    "ModelError",
    "ModelMetadata", "OptimizationError", "OptimizedNetwork", "OptimizerOptions", "PartitionResult",
    "RunOptions",
    "RunTerminated", "Runtime", "RuntimeOptions", "SessionOptions", "Support", "compile",
    "import_onnx", "optimize", "partition",
    "registry",
]
