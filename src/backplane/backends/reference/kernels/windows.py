"""Window functions: HannWindow, HammingWindow, BlackmanWindow (the cosine-sum windows)."""

from __future__ import annotations

import math

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.frontends.onnx_types import onnx_to_numpy_dtype


def _cosine_sum(size, coefficients, output_datatype, periodic):
    # w[n] = sum_k (-1)^k a_k cos(2 pi k n / N), N = size when periodic, size - 1 when symmetric
    n = int(np.ravel(size)[0])
    phase = 2 * math.pi * np.arange(n) / (n if periodic else n - 1)
    window = sum((-1) ** k * a * np.cos(k * phase) for k, a in enumerate(coefficients))
    return (np.asarray(window).astype(onnx_to_numpy_dtype(output_datatype)),)


def hann_window(size, output_datatype=1, periodic=1):
    return _cosine_sum(size, (0.5, 0.5), output_datatype, periodic)


def hamming_window(size, output_datatype=1, periodic=1):
    return _cosine_sum(size, (25 / 46, 21 / 46), output_datatype, periodic)


def blackman_window(size, output_datatype=1, periodic=1):
    return _cosine_sum(size, (0.42, 0.5, 0.08), output_datatype, periodic)


KERNELS: KernelTable = {
    "HannWindow": {17: hann_window},
    "HammingWindow": {17: hamming_window},
    "BlackmanWindow": {17: blackman_window},
}
