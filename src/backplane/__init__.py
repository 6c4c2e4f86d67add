"""backplane: a neural-network inference runtime whose backends plug in."""

from backplane.artifact import ArtifactError
from backplane.artifact import compile  # noqa: A004  # backplane.compile, as the issue names it
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


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"backplane.{name}")
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
