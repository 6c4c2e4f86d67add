"""backplane on Ray: batch scoring with Ray Data and serving with Ray Serve (``backplane[ray]``).

``map_batches(dataset, model, backends=..., concurrency=..., num_cpus=...)`` scores a Ray
Dataset on a pool of actors, one session each (``Scorer`` is the callable class it maps);
``deployment(model, backends=...)`` is a Ray Serve application of ``ModelDeployment``: one session
per replica, requests batched by Serve, a health check that runs the model. docs/scaling.md has
both recipes.

This package is ``backplane.ray``; ``import ray`` inside backplane is Ray itself (imports are
absolute).
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("backplane.ray needs Ray: pip install 'backplane[ray]' (ray[data,serve])"
                      ) from exc

from backplane.ray.batches import BatchError
from backplane.ray.data import Scorer, map_batches
from backplane.ray.serve import ModelDeployment, deployment

__all__ = ["BatchError", "ModelDeployment", "Scorer", "deployment", "map_batches"]
