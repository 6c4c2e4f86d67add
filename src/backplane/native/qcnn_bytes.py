"""A quantized convolution's weights packed for ``qcnn_bytes.h`` (the record ``qconv8``): the input
kept as unsigned bytes, the weight centred as signed bytes, four u8 x s8 products an int32 lane.

Why: on a CPU with AVX-512 VNNI (this session's AMD EPYC family 26) ``vpdpbusd`` adds 64 exact
byte products an instruction into 16 int32 sums, where ``qconv``'s int16 pairs (the AVX2 design,
for ``_mm256_madd_epi16``) take 16; ONNX Runtime's MLAS takes its VNNI kernels there too. The sums
are the same integers: sum (x - zx) * w = sum x * w - zx * sum w, the pads hold zx, so the
correction is a constant of the output channel, folded into the int32 bias here.

Where: a dense (or grouped, group by group) convolution or product whose centred weights are all
signed bytes and whose sums stay within int32 (``pack`` answers None otherwise and the int16 record
is planned), when the built library multiplies bytes with VNNI (``available``); elsewhere its
scalar path would be slower than the int16 pairs' AVX2, so the plan keeps those.
"""

from __future__ import annotations

import functools

import numpy as np

from backplane.native.qcnn import OCB

LIMIT = 2**31 - 1
"""A partial sum's bound (vpdpbusd's lanes are int32)."""


def available() -> bool:
    """Whether this machine's qcnn library multiplies bytes with VNNI (``backplane_qcnn_bytes``)."""
    return _built()


@functools.cache
def _built() -> bool:
    from backplane.native.build import NativeUnavailable, library

    try:
        return bool(library("qcnn").backplane_qcnn_bytes())
    except (NativeUnavailable, AttributeError):
        return False


def pack(centred: np.ndarray, bias: np.ndarray, zx: int, signed: bool, dw: int
         ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(packed weights, the bias less zx * each channel's weight sum, the scratch's channels
    icp) of ``centred`` (oc, c, kh, kw) int32, or None where a weight is no signed byte or a sum
    could leave int32. ``zx``: the input's zero point (a signed input's plus 128: its top bit is
    flipped). The layout: dw 1, [blocks][kh][ceil(kw * c / 4)][OCB][4], a kernel row's values one
    run (zero past its end), icp = c; else [blocks][kh][kw][icp / 4][OCB][4], icp = c rounded up
    to 4."""
    oc, c, kh, kw = centred.shape
    zero = int(zx) + (128 if signed else 0)
    bias = np.asarray(bias, np.int64).reshape(-1)
    sums = centred.reshape(oc, -1).astype(np.int64).sum(1)
    folded = bias - zero * sums
    bound = 255 * 128 * c * kh * kw  # the largest |sum x * w| over a window
    if centred.min(initial=0) < -128 or centred.max(initial=0) > 127 or \
            bound + int(np.abs(folded).max(initial=0)) > LIMIT or \
            bound + int(np.abs(bias).max(initial=0)) > LIMIT:
        return None
    blocks = -(-oc // OCB)
    if dw == 1:
        quads = -(-kw * c // 4)
        packed = np.zeros((blocks * OCB, kh, 4 * quads), np.int8)
        packed[:oc, :, :kw * c] = centred.transpose(0, 2, 3, 1).reshape(oc, kh, kw * c)
        packed = packed.reshape(blocks, OCB, kh, quads, 4).transpose(0, 2, 3, 1, 4)
        icp = c
    else:
        icp = -(-c // 4) * 4
        packed = np.zeros((blocks * OCB, icp, kh, kw), np.int8)
        packed[:oc, :c] = centred
        packed = packed.reshape(blocks, OCB, icp // 4, 4, kh, kw).transpose(0, 4, 5, 2, 1, 3)
    return np.ascontiguousarray(packed), folded, icp


DW_GROUP = 64
"""Channels a ``qdw8`` weight group: four 512-bit vectors of 16 channels' four taps each."""


def pack_depthwise(centred: np.ndarray, bias: np.ndarray, zx: int, signed: bool
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """(packed weights, the bias less zx * each channel's weight sum) of a depthwise convolution's
    ``centred`` (c, 1, kh, kw) int32 weights for ``qcnn_dw8.h``'s record ``qdw8``, or None where
    a weight is no signed byte. The layout: [groups of 64 channels][quads of 4 taps][4][64]
    bytes, vector r of a quad holding in its 128-bit lane L channel 16 L + 4 r + j's four taps at
    bytes 16 L + 4 j (the order ``vpunpck*`` gives 64 channels' bytes of four taps); taps past
    kh * kw and channels past c weigh 0."""
    c = centred.shape[0]
    taps = centred.reshape(c, -1)
    if taps.min(initial=0) < -128 or taps.max(initial=0) > 127:
        return None
    zero = int(zx) + (128 if signed else 0)
    folded = np.asarray(bias, np.int64).reshape(-1) - zero * taps.astype(np.int64).sum(1)
    groups, quads = -(-c // DW_GROUP), -(-taps.shape[1] // 4)
    full = np.zeros((groups * DW_GROUP, quads * 4), np.int8)
    full[:c, :taps.shape[1]] = taps
    # channel 64 g + 16 L + 4 r + j, tap 4 q + i -> [g][q][r][L][j][i]
    packed = full.reshape(groups, 4, 4, 4, quads, 4).transpose(0, 4, 2, 1, 3, 5)
    return np.ascontiguousarray(packed), folded
