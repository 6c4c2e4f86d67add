"""Math torch kernels beyond elementwise arithmetic: IsNaN/IsInf, Mod, BitShift and the bitwise ops, CumSum, Einsum, ArgMax/ArgMin, the reductions, window functions, DFT, QuantizeLinear/DequantizeLinear."""

from __future__ import annotations

from backplane.backends.api.kernels import KernelTable

KERNELS: KernelTable = {}

CHECKS: dict = {}

INPUT_DTYPES: dict = {}
