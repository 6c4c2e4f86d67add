"""The torch backends' kernel table: one explicit merge of the per-family tables, their support checks,
and the element types each op's first input may have. CpuAcc and GpuAcc share it: a torch kernel runs
on whichever device its tensors are on."""

from __future__ import annotations

from backplane.backends.torch.kernels import elementwise, indexing, numeric, nn, recurrent, shape
from backplane.backends.torch.kernels import attention, contrib_quant, ml, network, quantization, vision
from backplane.backends.torch.kernels import contrib_attention, contrib_transformer

KERNELS = {
    **elementwise.KERNELS,
    **nn.KERNELS,
    **shape.KERNELS,
    **numeric.KERNELS,
    **quantization.KERNELS,
    **indexing.KERNELS,
    **recurrent.KERNELS,
    **network.KERNELS,
    **vision.KERNELS,
    **attention.KERNELS,
    **ml.KERNELS,
    **contrib_quant.KERNELS,  # ONNX Runtime's com.microsoft quantized ops
    **contrib_transformer.KERNELS,  # its transformer fusions (normalizations, GELUs)
    **contrib_attention.KERNELS,  # its attention fusions
}

CHECKS = {
    **elementwise.CHECKS,
    **nn.CHECKS,
    **shape.CHECKS,
    **numeric.CHECKS,
    **quantization.CHECKS,
    **indexing.CHECKS,
    **recurrent.CHECKS,
    **network.CHECKS,
    **vision.CHECKS,
    **attention.CHECKS,
    **ml.CHECKS,
    **contrib_quant.CHECKS,
    **contrib_transformer.CHECKS,
    **contrib_attention.CHECKS,
}

INPUT_DTYPES = {
    **elementwise.INPUT_DTYPES,
    **nn.INPUT_DTYPES,
    **shape.INPUT_DTYPES,
    **numeric.INPUT_DTYPES,
    **quantization.INPUT_DTYPES,
    **indexing.INPUT_DTYPES,
    **recurrent.INPUT_DTYPES,
    **network.INPUT_DTYPES,
    **vision.INPUT_DTYPES,
    **attention.INPUT_DTYPES,
    **ml.INPUT_DTYPES,
}
