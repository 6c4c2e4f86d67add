"""Whether this CPU's int8 products are exact in ONNX Runtime and in torch, for the tests that
compare with them.

Without VNNI (AVX2, AVX-512 without it) ONNX Runtime's u8 x s8 kernels (MLAS) and torch's
(oneDNN, FBGEMM) add pairs of products in 16 bits and saturate (255 * 127 * 2 > 32767), as
ONNX Runtime's quantization guide says: on such a CPU (this project's 2-core AMD EPYC of family
25 model 1, AVX2 only) their int8 results are not CpuRef's, and a test that holds backplane to
them there tests the CPU. CpuAcc takes its exact float routes there (``fusion/int8_exact.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

SATURATES = "this CPU's int8 kernels saturate (no VNNI): torch's int8 routes are not taken"
"""The reason of a skip where ``torch_int8_exact`` is False."""


def ort_int8_exact() -> bool:
    """Whether ONNX Runtime's u8 x s8 products are exact here (``tests/ort_int8.py``'s probe);
    False where ONNX Runtime is absent."""
    if importlib.util.find_spec("onnxruntime") is None:
        return False
    from tests import ort_int8

    return ort_int8.ort_int8_exact()


def torch_int8_exact() -> bool:
    """Whether torch's int8 convolution and product are exact here (CpuAcc's own probe)."""
    from backplane.backends.torch.fusion import int8_exact

    return int8_exact.exact_kernels()


def int8_reference(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs a quantized model's int8 results are held to: ONNX Runtime's where its int8
    products are exact here (``ort_int8_exact``), else CpuRef's (ONNX Runtime's then saturate)."""
    if ort_int8_exact():
        from tests.models.test_ort_tools import ort_run

        return ort_run(model, feeds)
    from backplane import InferenceSession

    return InferenceSession(model if not isinstance(model, Path) else str(model),
                            backends=["CpuRef"]).run(None, feeds)
