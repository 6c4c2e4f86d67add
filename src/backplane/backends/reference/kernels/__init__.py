"""CpuRef's kernel table: one explicit merge of the per-family tables (and of their support checks)."""

from __future__ import annotations

from backplane.backends.reference.kernels import elementwise, reduce

KERNELS = {
    **elementwise.KERNELS,
    **reduce.KERNELS,
}

CHECKS = {
    **elementwise.CHECKS,
}
