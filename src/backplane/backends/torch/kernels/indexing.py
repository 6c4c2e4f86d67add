"""Indexing and layout torch kernels: Pad, GatherND, GatherElements, ScatterND/ScatterElements, OneHot, NonZero, DepthToSpace/SpaceToDepth, TopK's companions, NonMaxSuppression."""

from __future__ import annotations

from backplane.backends.api.kernels import KernelTable

KERNELS: KernelTable = {}

CHECKS: dict = {}

INPUT_DTYPES: dict = {}
