"""CpuRef's kernel table: one explicit merge of the per-family tables (and of their support checks)."""

from __future__ import annotations

from backplane.backends.reference.kernels import (
    attention,
    blocks,
    cast,
    contrib_attention,
    contrib_quant,
    contrib_transformer,
    conv,
    elementwise,
    grid_sample,
    image,
    indexing,
    linear_attention,
    losses,
    matmul,
    ml,
    nms,
    normalization,
    pool,
    quant,
    reduce,
    resize,
    rnn,
    roi_align,
    shape,
    spectral,
    strings,
    training,
    windows,
)

KERNELS = {
    **elementwise.KERNELS,
    **cast.KERNELS,
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
    **strings.KERNELS,
    **attention.KERNELS,
    **linear_attention.KERNELS,
    **losses.KERNELS,
    **grid_sample.KERNELS,
    **blocks.KERNELS,
    **roi_align.KERNELS,
    **nms.KERNELS,
    **spectral.KERNELS,
    **ml.KERNELS,
    **training.KERNELS,
    **image.KERNELS,
    **contrib_quant.KERNELS,  # ONNX Runtime's com.microsoft ops
    **contrib_transformer.KERNELS,
    **contrib_attention.KERNELS,
}

CHECKS = {
    **elementwise.CHECKS,
    **attention.CHECKS,
    **linear_attention.CHECKS,
    **cast.CHECKS,
    **shape.CHECKS,
    **indexing.CHECKS,
    **conv.CHECKS,
    **pool.CHECKS,
    **normalization.CHECKS,
    **resize.CHECKS,
    **quant.CHECKS,
    **rnn.CHECKS,
    **strings.CHECKS,
    **grid_sample.CHECKS,
    **roi_align.CHECKS,
    **ml.CHECKS,
    **training.CHECKS,
    **image.CHECKS,
    **contrib_quant.CHECKS,
    **contrib_transformer.CHECKS,
    **contrib_attention.CHECKS,
}

ANY_DTYPE_OPS = (cast.ANY_DTYPE | quant.ANY_DTYPE | shape.ANY_DTYPE | indexing.ANY_DTYPE
                 | elementwise.ANY_DTYPE | matmul.ANY_DTYPE | reduce.ANY_DTYPE | attention.ANY_DTYPE
                 | contrib_quant.ANY_DTYPE)
"""Ops CpuRef runs for every element type their schema allows, ml_dtypes' included (Backend)."""
