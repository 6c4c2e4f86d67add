"""backplane on Ray: batch scoring with Ray Data and serving with Ray Serve (``backplane-nn[ray]``).

``map_batches(dataset, model, backends=..., concurrency=..., num_cpus=...)`` scores a Ray
Dataset on a pool of actors, one session each (``Scorer`` is the callable class it maps);
``deployment(model, backends=...)`` is a Ray Serve application of ``ModelDeployment``: one session
per replica, requests batched by Serve, each checked alone first (a bad one gets its own error:
``MalformedRequest``, ``BatchError``, HTTP 400 / 422 / 413), a health check that runs the model.
docs/scaling.md has both recipes.

This package is ``backplane.ray``; ``import ray`` inside backplane is Ray itself (imports are
absolute).
"""

from __future__ import annotations

from backplane.install_hints import hint

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(f"backplane.ray needs Ray: {hint('ray')}"
                      ) from exc

from typing import TYPE_CHECKING, Any

from backplane.ray.answers import MalformedRequest, ModelRunError
from backplane.ray.batches import BatchError

if TYPE_CHECKING:
    from backplane.ray.data import Scorer, map_batches
    from backplane.ray.serve import ModelDeployment, deployment

_WHERE = {"Scorer": "data", "map_batches": "data", "ModelDeployment": "serve",
          "deployment": "serve"}
"""Names -> the module that has them, imported on first use: a Ray Data actor does not import
Ray Serve, nor a Serve replica Ray Data (seconds of a worker's start)."""

__all__ = ["BatchError", "MalformedRequest", "ModelDeployment", "ModelRunError", "Scorer",
           "deployment", "map_batches"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'backplane.ray' has no attribute '{name}'; its names are: "
                             f"{', '.join(__all__)}")
    import importlib

    return getattr(importlib.import_module(f"backplane.ray.{_WHERE[name]}"), name)
