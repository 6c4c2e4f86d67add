"""The ops ONNX Runtime adds to ONNX that backplane knows: its ``com.microsoft`` domain (written by
its quantizer, its transformer optimizer and its 4-bit weight quantizer) and the one op it adds to
the default domain (SimplifiedLayerNormalization, RMS normalization).

onnx has no schemas for them, so their arity is kept here as data, from ONNX Runtime's contrib-op
documentation (``docs/ContribOperators.md``); their attributes are checked against the kernels.
CpuRef has a kernel for each (``backends/reference/kernels/contrib_*.py``).
"""

from __future__ import annotations

from typing import NamedTuple

CONTRIB_DOMAIN = "com.microsoft"


class Arity(NamedTuple):
    since_version: int
    min_inputs: int
    max_inputs: int
    min_outputs: int
    max_outputs: int


ANY = 2**31 - 1  # a variadic input

ORT_OPS: dict[str, dict[str, Arity]] = {
    CONTRIB_DOMAIN: {
        # quantized (QOperator format)
        "QLinearAdd": Arity(1, 7, 8, 1, 1),
        "QLinearMul": Arity(1, 7, 8, 1, 1),
        "QLinearSigmoid": Arity(1, 4, 5, 1, 1),
        "QLinearLeakyRelu": Arity(1, 4, 5, 1, 1),
        "QLinearConcat": Arity(1, 3, ANY, 1, 1),
        "QLinearGlobalAveragePool": Arity(1, 5, 5, 1, 1),
        "QLinearAveragePool": Arity(1, 4, 5, 1, 1),
        "QLinearSoftmax": Arity(1, 5, 5, 1, 1),
        "QGemm": Arity(1, 6, 9, 1, 1),
        "DynamicQuantizeMatMul": Arity(1, 3, 5, 1, 1),
        "MatMulIntegerToFloat": Arity(1, 4, 7, 1, 1),
        "MatMulNBits": Arity(1, 3, 6, 1, 1),
        # transformer fusions
        "SkipLayerNormalization": Arity(1, 3, 5, 1, 4),
        "SkipSimplifiedLayerNormalization": Arity(1, 3, 4, 1, 4),
        "EmbedLayerNormalization": Arity(1, 7, 9, 1, 3),
        "BiasGelu": Arity(1, 2, 2, 1, 1),
        "FastGelu": Arity(1, 1, 2, 1, 1),
        "Gelu": Arity(1, 1, 1, 1, 1),
        "QuickGelu": Arity(1, 1, 1, 1, 1),
        "BiasAdd": Arity(1, 3, 3, 1, 1),
        "Attention": Arity(1, 2, 7, 1, 2),
        "MultiHeadAttention": Arity(1, 1, 10, 1, 4),
        "RotaryEmbedding": Arity(1, 4, 4, 1, 1),
        "FusedMatMul": Arity(1, 2, 2, 1, 1),
        "FusedConv": Arity(1, 2, 4, 1, 1),
    },
    "": {"SimplifiedLayerNormalization": Arity(1, 2, 2, 1, 2)},
}
"""domain -> op -> its since-version and how many inputs and outputs it takes."""


def ort_arity(domain: str, op_type: str) -> Arity | None:
    """The arity of an op ONNX Runtime adds that backplane knows, or None."""
    return ORT_OPS.get(domain, {}).get(op_type)


def check_ort_node(domain: str, op_type: str, opset: int, n_inputs: int, n_outputs: int,
                   ) -> str | None:
    """Why a node of ONNX Runtime's ops cannot be imported, or None."""
    arity = ORT_OPS[domain][op_type]
    if opset < arity.since_version:
        return f"{op_type} exists from opset {arity.since_version} of '{domain}'"
    for kind, count, low, high in (("input", n_inputs, arity.min_inputs, arity.max_inputs),
                                   ("output", n_outputs, arity.min_outputs, arity.max_outputs)):
        if not low <= count <= high:
            takes = f"exactly {low}" if low == high else \
                f"at least {low}" if high == ANY else f"{low} to {high}"
            return f"{count} {kind}(s); {op_type} takes {takes}"
    return None


def known_ops(domain: str) -> str:
    """The ops of ``domain`` backplane knows, for error messages."""
    return ", ".join(sorted(ORT_OPS.get(domain, {}))) or "none"
