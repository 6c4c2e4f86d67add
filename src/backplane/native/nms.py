"""ONNX NonMaxSuppression in one C call (``nms.c``): a CpuAcc detector's selections, CpuRef's.

Why: in NumPy a detector's NMS is a dozen array calls (every pair's overlaps, their bit rows, a
sort per class) and a greedy walk in Python: 92-97 us of thread CPU on the corpus's detectors (32
and 64 boxes, 39-44 kept; this 2-core AMD EPYC, 1 thread), where ONNX Runtime's whole model takes
about 130. In C the walk compares a candidate with the boxes kept so far only, and the call is the
cost. Where: a HostChain's NonMaxSuppression (``fusion/host_chain.py``) of float32 boxes and scores
while ``CpuAcc.native`` is "auto" and the library builds here (``host_kernel``); any other
(float16, float64, no compiler, "off") runs ``kernels/nms.py``'s NumPy as before.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from backplane.native.arena import address
from backplane.native.build import NativeUnavailable, library, mode

VERSION = 2
"""``nms.c``'s ``backplane_nms_version``: the calls' signatures this module makes."""
_FUNCTIONS: list[Any] = []
_PACKED: list[Any] = []


def _function() -> Any:
    """The library's ``backplane_nms``, typed (raises ``NativeUnavailable``)."""
    if not _FUNCTIONS:
        lib = library("nms", VERSION)
        function = lib.backplane_nms
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 4,
                             ctypes.c_double, ctypes.c_int64, ctypes.c_double, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_int64]
        function.restype = ctypes.c_int64
        _FUNCTIONS.append(function)
    return _FUNCTIONS[0]


def _packed() -> Any:
    """The library's ``backplane_nms_packed`` (its arguments in two arrays), typed."""
    if not _PACKED:
        function = library("nms", VERSION).backplane_nms_packed
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        function.restype = ctypes.c_int64
        _PACKED.append(function)
    return _PACKED[0]


def built() -> bool:
    """Whether the library is here (built, loaded, of this module's ``VERSION``)."""
    try:
        _function()
    except NativeUnavailable:
        return False
    return True


def host_kernel(options: Any) -> Any:
    """The HostChain's NonMaxSuppression kernel under ``options`` (a CpuAcc's):
    ``non_max_suppression`` where ``CpuAcc.native`` is "auto" and the library is here, else None
    (NumPy's stays)."""
    return non_max_suppression if mode(options) == "auto" and built() else None


def bound(layer: Any, constants: dict[str, Any]) -> Any:
    """``non_max_suppression`` with ``layer``'s limit, IoU limit and score threshold read at
    load, where they are ``constants`` (a detector's: the chain's HostChain passes them at every
    run all the same): a call then checks the boxes' and scores' types and shapes, and makes one
    C call. None where one of them is computed."""
    names = list(layer.inputs[2:5]) + [""] * (5 - len(layer.inputs))
    if any(name and name not in constants for name in names):
        return None
    given = [constants[name] if name else None for name in names]
    limit = 0 if given[0] is None else max(int(_one(given[0])), 0)
    iou_limit = 0.0 if given[1] is None else float(_one(given[1]))
    has_threshold = given[2] is not None
    threshold = float(_one(given[2])) if has_threshold else 0.0
    call, f32, general = _packed(), np.dtype(np.float32), non_max_suppression
    ndarray, contiguous, empty, i64 = np.ndarray, np.ascontiguousarray, np.empty, np.int64
    # the call's arguments: ints' [2:5] and [8:10] written at each call, the rest here (a call
    # from a second thread at the same time writes arrays of its own: the lock is tried only)
    thresholded = 1 if has_threshold else 0
    ints = (ctypes.c_int64 * 10)(0, 0, 0, 0, 0, 0, thresholded, limit, 0, 0)
    reals = (ctypes.c_double * 2)(iou_limit, threshold)
    at_ints, at_reals, lock = ctypes.addressof(ints), ctypes.addressof(reals), threading.Lock()
    run_arrays = (ints, reals)  # alive while ``run`` is: the call reads them by address

    def run(boxes, scores, *_constants, center_point_box=0):
        if type(boxes) is not ndarray or type(scores) is not ndarray or boxes.dtype != f32 \
                or scores.dtype != f32 or boxes.ndim != 3 or scores.ndim != 3 \
                or boxes.shape != (scores.shape[0], scores.shape[2], 4):
            return general(boxes, scores, *given, center_point_box)
        batch, classes, count = scores.shape
        room = batch * classes * min(limit, count)
        if not room:
            return (np.zeros((0, 3), np.int64),)
        if not boxes.flags.c_contiguous:
            boxes = contiguous(boxes)
        if not scores.flags.c_contiguous:
            scores = contiguous(scores)
        rows = empty((room, 3), i64)
        values = (address(boxes), address(scores), batch, classes, count,
                  1 if center_point_box else 0, thresholded, limit, address(rows), room)
        if lock.acquire(blocking=False):
            try:
                ints[:] = values
                found = call(at_ints, at_reals)
            finally:
                lock.release()
        else:
            mine = (ctypes.c_int64 * 10)(*values)
            found = call(ctypes.addressof(mine), at_reals)
        if found < 0:
            raise MemoryError("NonMaxSuppression: no memory for its boxes' corners")
        return (rows[:found] if found * 4 >= room else rows[:found].copy(),)

    run.arrays = run_arrays  # type: ignore[attr-defined]
    run.lock = lock  # type: ignore[attr-defined]  # (tests hold it: a second thread's call)
    return run


def non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, center_point_box=0):
    """``kernels/nms.host_non_max_suppression`` (NumPy arrays in, the (K, 3) int64 rows out) in
    one C call where boxes and scores are float32; NumPy's for any other type."""
    if boxes.dtype != np.float32 or scores.dtype != np.float32 or boxes.ndim != 3 \
            or scores.ndim != 3 or boxes.shape != (scores.shape[0], scores.shape[2], 4):
        from backplane.backends.torch.kernels.nms import host_non_max_suppression

        return host_non_max_suppression(boxes, scores, max_output_boxes_per_class, iou_threshold,
                                        score_threshold, center_point_box)
    limit = 0 if max_output_boxes_per_class is None \
        else max(int(_one(max_output_boxes_per_class)), 0)
    batch, classes, count = scores.shape
    room = batch * classes * min(limit, count)
    if not room:
        return (np.zeros((0, 3), np.int64),)
    iou_limit = 0.0 if iou_threshold is None else float(_one(iou_threshold))
    threshold = 0.0 if score_threshold is None else float(_one(score_threshold))
    boxes = np.ascontiguousarray(boxes)
    scores = np.ascontiguousarray(scores)
    rows = np.empty((room, 3), np.int64)
    found = _function()(_address(boxes), _address(scores), batch, classes, count,
                        1 if center_point_box else 0, iou_limit, score_threshold is not None,
                        threshold, limit, _address(rows), room)
    if found < 0:
        raise MemoryError("NonMaxSuppression: no memory for its boxes' corners")
    return (rows[:found] if found * 4 >= room else rows[:found].copy(),)


def _address(array: np.ndarray) -> int:
    """A C-contiguous array's address: through its buffer (about 1 us), where ``.ctypes.data``
    makes an object of NumPy's ctypes helper (3-4 us here, three a call); a read-only array has
    no writable buffer to lend and goes that way."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except TypeError:
        return array.ctypes.data  # type: ignore[no-any-return]


def _one(value):
    """A one-element array's value (CpuRef's reading: its first element)."""
    if isinstance(value, np.ndarray):
        return value.item(0)
    return np.asarray(value).reshape(-1)[0].item()
