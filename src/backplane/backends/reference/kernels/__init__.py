"""CpuRef's kernel table: one explicit merge of the per-family tables (and of their support checks)."""

from __future__ import annotations

from backplane.backends.reference.kernels import (
    attention,
    conv,
    elementwise,
    indexing,
    losses,
    matmul,
    normalization,
    pool,
    quant,
    reduce,
    resize,
    rnn,
    shape,
    windows,
)

KERNELS = {
    **elementwise.KERNELS,
    **reduce.KERNELS,
    **shape.KERNELS,
    **indexing.KERNELS,
    **conv.KERNELS,
    **pool.KERNELS,
    **matmul.KERNELS,
    **normalization.KERNELS,
    **resize.KERNELS,
    **quant.KERNELS,
    **windows.KERNELS,
    **rnn.KERNELS,
    **attention.KERNELS,
    **losses.KERNELS,
}

CHECKS = {
    **elementwise.CHECKS,
    **shape.CHECKS,
    **indexing.CHECKS,
    **conv.CHECKS,
    **pool.CHECKS,
    **normalization.CHECKS,
    **resize.CHECKS,
    **quant.CHECKS,
    **rnn.CHECKS,
}
