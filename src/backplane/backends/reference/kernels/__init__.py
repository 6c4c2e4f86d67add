"""CpuRef's kernel table: one explicit merge of the per-family tables."""

from __future__ import annotations

from backplane.backends.reference.kernels import elementwise

KERNELS = {**elementwise.KERNELS}
CHECKS = {**getattr(elementwise, "CHECKS", {})}
