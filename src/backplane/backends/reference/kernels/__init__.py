"""CpuRef's kernel table: one explicit merge of the per-family tables (and of their support checks)."""

from __future__ import annotations

from backplane.backends.reference.kernels import elementwise, indexing, reduce, shape

KERNELS = {
    **elementwise.KERNELS,
    **reduce.KERNELS,
    **shape.KERNELS,
    **indexing.KERNELS,
}

CHECKS = {
    **elementwise.CHECKS,
    **shape.CHECKS,
    **indexing.CHECKS,
}
