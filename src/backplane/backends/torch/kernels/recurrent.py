"""Network torch kernels beyond convolution and pooling: ConvTranspose, Instance/Group normalization, LSTM, GRU, RNN, Attention."""

from __future__ import annotations

from backplane.backends.api.kernels import KernelTable

KERNELS: KernelTable = {}

CHECKS: dict = {}

INPUT_DTYPES: dict = {}
