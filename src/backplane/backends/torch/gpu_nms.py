"""A detector's NonMaxSuppression overlaps on the GPU, inside its whole run's graph (issue 28).

Why: a free detector's whole run (``cuda_host.HostTail``) downloads the boxes and runs the
NonMaxSuppression and the layers after it in NumPy. There the overlaps of every two boxes
(``kernels/nms._suppressing``: about twenty NumPy calls on (B, 2, N, N) arrays) and their packing
into bit rows (``_bit_rows``) were most of the host's part: on detect_nms_dyn21's 64 boxes
60-65 us and 8-10 us of thread CPU time of a 140-170 us NMS (this project's 2-core AMD EPYC), in
a 0.29 ms run whose kernels took 79 us. Here the graph computes them itself, after the layers that
make the boxes: one elementwise kernel decides every pair (torch's jiterator: the box corners of
both, eight tensors broadcast (B, N, 1) against (B, 1, N)), three more make each box's row of
pairs one int64 word (bit j: box j), and the words go to the host with the graph's other outputs.
The host keeps the greedy walk (``kernels/nms.selected_by_rows``: one ``|`` per kept box), which
is sequential.

The decision is CpuRef's, box for box: the same operations in the same order in float32, each
product, sum and quotient rounded on its own (``__fmul_rn``, ``__fadd_rn``, ``__fsub_rn``,
``__fdiv_rn``: no fused multiply-add), NaN carried through every minimum and maximum as NumPy
does (a pair with a NaN coordinate does not overlap: 0 against the limit). Only where the boxes
are float32 of at most ``ONE_WORD`` a batch item, made by the graph, and the IoU limit is a
constant (absent: 0) that is not NaN: the kernel's scalar is written into the captured graph.
Where jiterator cannot run (no NVRTC; off CUDA: the tests here) the same decision is torch's
kernels (``_suppressing`` on torch tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.torch import gpu_jit
from backplane.backends.torch.kernels import nms
from backplane.ir.graph import Graph, Layer

ONE_WORD = nms.ONE_WORD

OVERLAPS = """template <typename T> T backplane_overlaps(T a0, T a1, T a2, T a3, T b0, T b1, T b2,
                                                       T b3, T limit, T centre) {
    auto least = [](T x, T y) { return (x != x || y != y) ? __fadd_rn(x, y) : (x < y ? x : y); };
    auto most = [](T x, T y) { return (x != x || y != y) ? __fadd_rn(x, y) : (x > y ? x : y); };
    T al0, al1, ah0, ah1, bl0, bl1, bh0, bh1;
    if (centre != 0.0f) {
        T ha0 = __fdiv_rn(a2, 2.0f), ha1 = __fdiv_rn(a3, 2.0f);
        T hb0 = __fdiv_rn(b2, 2.0f), hb1 = __fdiv_rn(b3, 2.0f);
        al0 = __fsub_rn(a0, ha0); al1 = __fsub_rn(a1, ha1);
        ah0 = __fadd_rn(a0, ha0); ah1 = __fadd_rn(a1, ha1);
        bl0 = __fsub_rn(b0, hb0); bl1 = __fsub_rn(b1, hb1);
        bh0 = __fadd_rn(b0, hb0); bh1 = __fadd_rn(b1, hb1);
    } else {
        al0 = least(a0, a2); al1 = least(a1, a3); ah0 = most(a0, a2); ah1 = most(a1, a3);
        bl0 = least(b0, b2); bl1 = least(b1, b3); bh0 = most(b0, b2); bh1 = most(b1, b3);
    }
    T s0 = __fsub_rn(least(ah0, bh0), most(al0, bl0));
    T s1 = __fsub_rn(least(ah1, bh1), most(al1, bl1));
    T area_a = __fmul_rn(__fsub_rn(ah0, al0), __fsub_rn(ah1, al1));
    T area_b = __fmul_rn(__fsub_rn(bh0, bl0), __fsub_rn(bh1, bl1));
    T inter = __fmul_rn(s0, s1);
    T uni = __fsub_rn(__fadd_rn(area_a, area_b), inter);
    bool over = least(s0, s1) > 0.0f && uni > 0.0f;
    T ratio = over ? __fdiv_rn(inter, uni) : 0.0f;
    return ratio > limit ? 1.0f : 0.0f;
}"""
"""Whether box a's IoU with box b is above ``limit``, as ``kernels/nms._suppressing`` computes it
in NumPy (float32, one rounding an operation; ``centre``: center_point_box): 1 or 0."""


def device_rows(boxes: Any, center_point_box: int, limit: float) -> Any:
    """(B, N) int64: bit j of box i's word set where boxes i and j overlap above ``limit``, for
    float32 ``boxes`` (B, N, 4), N at most ``ONE_WORD``, on the boxes' device."""
    import torch

    count = boxes.shape[-2]
    corners = [boxes[..., k] for k in range(4)]
    over = gpu_jit.call(OVERLAPS, *[c[..., :, None] for c in corners],
                        *[c[..., None, :] for c in corners],
                        limit=float(limit), centre=float(bool(center_point_box))) \
        if boxes.is_cuda else None  # a refusal is kept per type: never ask with CPU tensors
    over = over > 0 if over is not None else nms._suppressing(boxes, center_point_box, limit, torch)
    return (over.to(torch.int64) * _weights(count, boxes.device)).sum(-1)


_WEIGHTS: dict[tuple[int, str], Any] = {}


def _weights(count: int, device: Any) -> Any:
    """Box j's bit as an int64 (bit 63 the type's least value): the words are sums of distinct
    bits, exact in int64."""
    import torch

    key = (count, str(device))
    if key not in _WEIGHTS:
        bits = [1 << j if j < 63 else -(1 << 63) for j in range(count)]
        _WEIGHTS[key] = torch.tensor(bits, dtype=torch.int64, device=device)
    return _WEIGHTS[key]


def planned(tail: Layer, made: Sequence[str], graph: Graph) -> tuple[int, int, float] | None:
    """For a HostChain ``tail`` whose first layer is a NonMaxSuppression reading boxes the graph
    makes (``made``: the CudaGraph layer's outputs): (the boxes' index in ``made``,
    center_point_box, the IoU limit); None where the overlaps stay the host's (see above)."""
    first = tail.attrs["layers"][0]
    if first.op_type != "NonMaxSuppression" or first.domain or not first.inputs \
            or first.inputs[0] not in made:
        return None
    info = graph.info(first.inputs[0])
    shape = info.shape
    if info.dtype is None or np.dtype(info.dtype) != np.float32 or shape is None \
            or len(shape) != 3 or not all(isinstance(d, int) for d in shape) \
            or not 0 < shape[1] <= ONE_WORD or shape[2] != 4:
        return None
    name = first.inputs[3] if len(first.inputs) > 3 else ""
    constants = tail.attrs["constants"]
    if name and name not in constants:
        return None  # made at run time: the captured kernel's scalar cannot follow it
    limit = float(np.asarray(constants[name]).reshape(-1)[0]) if name else 0.0
    if limit != limit:
        return None
    centre = int(first.attrs.get("center_point_box", 0))
    return made.index(first.inputs[0]), centre, limit


def rows_kernel(words: Callable[[], np.ndarray]) -> Callable[..., tuple[np.ndarray]]:
    """The chain's NonMaxSuppression on the words the graph computed (``words()``: their host
    buffer, written by the replay before the chain runs): the selections of
    ``host_non_max_suppression``, box for box, without the overlaps."""

    def non_max_suppression(boxes: Any, scores: np.ndarray, max_output_boxes_per_class: Any = None,
                            iou_threshold: Any = None, score_threshold: Any = None,
                            center_point_box: int = 0) -> tuple[np.ndarray]:
        limit = 0 if max_output_boxes_per_class is None \
            else max(int(nms._host_one(max_output_boxes_per_class)), 0)
        threshold = None if score_threshold is None else float(nms._host_one(score_threshold))
        if not limit or not scores.size:
            return (np.zeros((0, 3), np.int64),)
        return (nms.selected_by_rows(words().tolist(), scores, limit, threshold),)

    return non_max_suppression
