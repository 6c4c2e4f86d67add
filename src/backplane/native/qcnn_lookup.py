"""Float glue between two 8-bit tensors of one source as a table: the plan's ``lut8`` record.

Why: a QDQ or QOperator hard-swish (DequantizeLinear -> HardSigmoid -> QuantizeLinear ->
DequantizeLinear -> Mul(x, that) -> QuantizeLinear, or QLinearMul's) is six records and four
float tensors of the activation's size between two byte tensors: the full tier's MobileNet spent
1.6 of its 5.0 ms a run (1 thread) in them. Its output byte is a function of the input byte alone,
so the 256 values it can take, computed here with the records' own float32 operations in their
order, are the whole layer: one gather a value (AVX-512 VBMI's ``vpermi2b``: 64 an instruction
pair), the same bytes.

``tables(planner)`` runs after the plan's records are made: each ``quant`` record whose float
input is computed by ``dequant``, ``hsig_f``, ``relu_f``, ``mul_f``, ``add_f`` and a one-value
``addc_f`` from a single byte tensor, every value of the same shape, becomes a ``lut8`` record
reading that tensor; the chain's records whose outputs nothing else reads are dropped. The
arithmetic below is ``qcnn.c``'s (``-std=c11``: no contraction; NumPy's float32 operations round
as C's do; ``rint`` rounds half to even as ``nearbyintf``): the tests compare the tabled plan's
outputs with the untabled one's, bit for bit, on each build.
"""

from __future__ import annotations

from typing import Any

import numpy as np

F32 = np.float32
CHAIN = ("dequant", "hsig_f", "relu_f", "mul_f", "add_f", "addc_f")
"""The records a table takes between a byte tensor and a ``quant`` (and the ``quant`` records
whose bytes a ``dequant`` of the chain reads)."""


def tables(p: Any) -> None:
    """Replaces each single-source glue chain ending in a ``quant`` of planner ``p`` by a
    ``lut8`` record (see above), in place."""
    from backplane.native.qcnn import FIELDS

    at = {name: FIELDS.index(name) for name in ("in", "in2", "out", "op", "x1", "moff", "boff")}
    ops = p.ops
    writer = {int(row[at["out"]]): i for i, row in enumerate(p.records) if ops[i] != "export"}
    reads = _reads(p, at)
    dropped: set[int] = set()
    for index in reversed(range(len(ops))):  # the last quant first: it takes those before it
        if ops[index] != "quant" or index in dropped:
            continue
        chain: set[int] = set()
        sources: set[tuple[int, int]] = set()  # (offset, signed)
        if not _walk(p, at, writer, int(p.records[index][at["in"]]), chain, sources) \
                or len(sources) != 1:
            continue
        inside = {int(p.records[i][at["out"]]) for i in chain}
        if any(reader not in chain and reader != index for value in inside
               for reader in reads.get(value, ())):
            continue  # a chain value read elsewhere: the chain stays
        count = _count(p.records[index])
        if any(_count(p.records[i]) != count for i in chain):
            continue
        (offset, signed), = sources
        table = _table(p, at, writer, index, offset, signed)
        row = p.records[index]
        row[at["op"]] = _op("lut8")
        row[at["in"]] = offset
        row[FIELDS.index("woff")] = p.param(table)
        ops[index] = "lut8"
        dropped |= chain
    keep = [i for i in range(len(ops)) if i not in dropped]
    p.records[:] = [p.records[i] for i in keep]
    p.ops[:] = [p.ops[i] for i in keep]
    p.names[:] = [p.names[i] for i in keep]


def sums(p: Any) -> None:
    """Replaces each ``quant`` of an ``add_f`` of two ``dequant`` records (a QDQ residual Add, a
    QLinearAdd) by one ``qadd8`` record of the two byte tensors, the same float32 operations in
    one pass (where neither float operand nor the sum is read elsewhere), in place: three float
    tensors of the activation's size each written and read once less (the full tier's MobileNet:
    0.49 of its 3.5 ms a run, 1 thread)."""
    from backplane.native.qcnn import FIELDS

    at = {name: FIELDS.index(name) for name in ("in", "in2", "out", "op", "x1", "moff", "woff",
                                                  "zx", "signed")}
    ops = p.ops
    writer = {int(row[at["out"]]): i for i, row in enumerate(p.records) if ops[i] != "export"}
    reads = _reads(p, at)
    dropped: set[int] = set()
    for index, op in enumerate(ops):
        if op != "quant":
            continue
        quant = p.records[index]
        add = writer.get(int(quant[at["in"]]))
        if add is None or ops[add] != "add_f":
            continue
        parts = [writer.get(int(p.records[add][at[f]])) for f in ("in", "in2")]
        if any(j is None or ops[j] != "dequant" or int(p.records[j][at["x1"]]) for j in parts):
            continue
        chain = {add, *parts}
        if any(reader not in chain and reader != index
               for value in (int(p.records[i][at["out"]]) for i in chain)
               for reader in reads.get(value, ())) or chain & dropped:
            continue
        a, b = (p.records[j] for j in parts)
        scales = np.array([_float(p, a[at["moff"]]), _float(p, b[at["moff"]]),
                           _float(p, quant[at["moff"]])], F32)
        zeros = np.array([a[at["zx"]], b[at["zx"]], a[at["signed"]], b[at["signed"]]], np.int32)
        quant[at["op"]] = _op("qadd8")
        quant[at["in"]], quant[at["in2"]] = a[at["in"]], b[at["in"]]
        quant[at["moff"]], quant[at["woff"]] = p.param(scales), p.param(zeros)
        ops[index] = "qadd8"
        dropped |= chain
    keep = [i for i in range(len(ops)) if i not in dropped]
    p.records[:] = [p.records[i] for i in keep]
    p.ops[:] = [p.ops[i] for i in keep]
    p.names[:] = [p.names[i] for i in keep]


def _float(p: Any, offset: int) -> np.float32:
    """The float32 parameter at byte ``offset``."""
    params = np.concatenate(p.params).view(np.uint8)
    return params[int(offset):int(offset) + 4].view(F32)[0]


def _op(name: str) -> int:
    from backplane.native.qcnn import OPS

    return OPS[name]


def _count(row: np.ndarray) -> int:
    from backplane.native.qcnn import FIELDS

    return int(np.prod([row[FIELDS.index(d)] for d in "nchw"]))


def _reads(p: Any, at: dict[str, int]) -> dict[int, list[int]]:
    """Each tensor's offset -> the records reading it (a grouped convolution reads from inside a
    tensor: its reads count for the tensor holding the offset)."""
    starts = sorted((v.offset, v.offset + max(v.bytes, 1)) for v in p.values.values())
    lefts = [s for s, _ in starts]
    found: dict[int, list[int]] = {}
    for i, row in enumerate(p.records):
        if p.ops[i] == "import":
            continue
        for field in ("in", "in2"):
            where = int(row[at[field]])
            if where < 0:
                continue
            k = int(np.searchsorted(lefts, where, side="right")) - 1
            if k >= 0 and where < starts[k][1]:
                found.setdefault(starts[k][0], []).append(i)
    return found


def _walk(p: Any, at: dict[str, int], writer: dict[int, int], value: int, chain: set[int],
          sources: set[tuple[int, int]]) -> bool:
    """Collects the chain computing float ``value`` (its records, its byte sources); False where
    a record in it is none of ``CHAIN``."""
    from backplane.native.qcnn import FIELDS

    i = writer.get(value)
    if i is None or p.ops[i] not in CHAIN:
        return False
    row = p.records[i]
    chain.add(i)
    op = p.ops[i]
    if op == "dequant":
        j = writer.get(int(row[at["in"]]))
        if j is not None and p.ops[j] == "quant":  # bytes of the chain's own: through them
            chain.add(j)
            return _walk(p, at, writer, int(p.records[j][at["in"]]), chain, sources)
        sources.add((int(row[at["in"]]), int(row[FIELDS.index("signed")])))
        return True
    if op == "addc_f" and int(row[at["x1"]]) != 1:
        return False  # a constant per channel: not a function of the byte alone
    if not _walk(p, at, writer, int(row[at["in"]]), chain, sources):
        return False
    return op not in ("mul_f", "add_f") or _walk(p, at, writer, int(row[at["in2"]]), chain,
                                                 sources)


def _table(p: Any, at: dict[str, int], writer: dict[int, int], index: int, source: int,
           signed: int) -> np.ndarray:
    """The 256 output bytes of the chain ending in ``quant`` record ``index``, by input byte."""
    from backplane.native.qcnn import FIELDS

    params = np.concatenate(p.params).view(np.uint8) if p.params else np.zeros(0, np.uint8)
    floats = lambda offset, n: params[offset:offset + 4 * n].view(F32)  # noqa: E731
    byte = np.arange(256, dtype=np.uint8)
    x = (byte.view(np.int8) if signed else byte).astype(np.int32)
    memo: dict[int, np.ndarray] = {}

    def value(offset: int) -> np.ndarray:
        i = writer[offset]
        if i in memo:
            return memo[i]
        row, op = p.records[i], p.ops[i]
        if op == "dequant":  # (x - zero) * scale, then the Relu where x1
            k = x if int(row[at["in"]]) == source else value(int(row[at["in"]]))
            v = (k - int(row[FIELDS.index("zx")])).astype(F32) * floats(int(row[at["moff"]]), 1)[0]
            if int(row[at["x1"]]):
                v = np.where(v < 0, F32(0), v)
        elif op == "hsig_f":  # alpha * x, + beta, min 1, max 0 (qcnn_float.h's order)
            alpha, beta = floats(int(row[at["moff"]]), 2)
            v = value(int(row[at["in"]])) * alpha
            v = v + beta
            v = np.where(v > 1, F32(1), v)
            v = np.where(v < 0, F32(0), v)
        elif op == "relu_f":
            a = value(int(row[at["in"]]))
            v = np.where(a < 0, F32(0), a)
        elif op == "addc_f":
            v = value(int(row[at["in"]])) + floats(int(row[at["boff"]]), 1)[0]
        elif op == "mul_f":
            v = value(int(row[at["in"]])) * value(int(row[at["in2"]]))
        elif op == "add_f":
            v = value(int(row[at["in"]])) + value(int(row[at["in2"]]))
        else:  # quant: the integers (the byte as its type reads it)
            memo[i] = quantized(i)
            return memo[i]
        memo[i] = v.astype(F32)
        return memo[i]

    def quantized(i: int) -> np.ndarray:
        """x / scale, clamped to the type's range less the zero point (a NaN to its low end),
        rounded half to even, plus the zero point: qcnn_bytes.h's quantize."""
        row = p.records[i]
        scale = floats(int(row[at["moff"]]), 1)[0]
        zero, lo, hi = (int(row[FIELDS.index(f)]) for f in ("zy", "lo", "hi"))
        with np.errstate(all="ignore"):
            v = value(int(row[at["in"]])) / scale
            v = np.where(v > F32(lo - zero), v, F32(lo - zero))
            v = np.where(v < F32(hi - zero), v, F32(hi - zero))
        return np.rint(v).astype(np.int32) + zero

    return (quantized(index) & 0xFF).astype(np.uint8)
