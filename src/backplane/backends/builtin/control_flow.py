"""If, Loop, Scan and SequenceMap: builtin's workloads that run optimized sub-networks (onert's builtin kernels).

Each body was placed by the optimizer like any graph and is loaded here as a LoadedNetwork of its own.
A body's inputs are its formal inputs followed by the tensors it reads from the enclosing scope
("captured"); the optimizer appended those to the layer's inputs, so they arrive as the last
``n_captured`` inputs of the workload. A body run many times in a call (Loop, Scan, SequenceMap)
runs as an ``IteratedBody`` (bodies.py): prepared at load, its slots kept over the iterations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from backplane.backends.builtin import sequence
from backplane.ir.graph import TensorInfo

if TYPE_CHECKING:
    from backplane.backends.builtin.bodies import IteratedBody

CONTROL_FLOW_OPS = {"If": ("then_branch", "else_branch"), "Loop": ("body",), "Scan": ("body",),
                    "SequenceMap": ("body",)}


def _bool(value: Any) -> bool:
    """A predicate or condition read on the host: one ``.item()`` (a NumPy array, or a tensor of a
    backend's memory that a body hands over as it is: ``flat.direct_predicates``)."""
    if type(value) is np.ndarray and value.size == 1:
        return bool(value.item())
    try:
        return bool(value.item())
    except (AttributeError, ValueError, RuntimeError):  # not one element: the first, as before
        return bool(np.asarray(value).reshape(-1)[0])


def make_if(then_net: Any, else_net: Any, n_captured: int) -> Any:
    """ONNX If over its two loaded branches; a flat branch (flat.FlatBody) called through its
    ``direct`` code where no stop is asked (one frame, no slot list copied)."""
    from backplane.runtime.loaded_network import STOP, StepFailure

    def if_(cond: Any, *captured: Any) -> tuple[Any, ...]:
        # NumPy's bool or a one-element array read in line (no frame of _bool's: an If in a body
        # runs per iteration, its predicate often a scalar that a kernel of 0-d arrays gave)
        if type(cond) is np.bool_:
            taken = cond
        elif type(cond) is np.ndarray and cond.size == 1:
            taken = cond.item()
        else:
            taken = _bool(cond)
        net = then_net if taken else else_net
        direct = getattr(net, "direct", None)
        if direct is not None and STOP.get() is None:
            try:
                return direct(captured)  # type: ignore[no-any-return]
            except StepFailure as failure:
                raise net.failure(failure) from failure.error
        return tuple(net.execute(captured))

    return if_


def make_loop(body: IteratedBody, n_carried: int, scan_infos: Sequence[TensorInfo],
              native: str = "off") -> Any:
    """ONNX Loop: run ``body`` while the trip count allows and its condition holds. ``body``'s
    formal inputs: the iteration number, the condition, the carried values; its outputs: the
    condition, the carried values, the scan outputs. ``native``: ``builtin.native``, whether a
    body of small float32 layers runs as one C call (``native_loop.py``)."""
    from backplane.backends.builtin.looped import looped
    from backplane.backends.builtin.native_loop import planner
    from backplane.runtime.loaded_network import STOP, StepFailure

    reads_i, reads_cond = body.reads(0), body.reads(1)
    whole = None if body.plain or body.renew else looped(body, reads_i, reads_cond)
    in_c = planner(body, n_carried, native)

    def loop(trip_count: Any, cond: Any, *rest: Any) -> tuple[Any, ...]:
        max_trips = None if trip_count is None else int(np.asarray(trip_count).reshape(-1)[0])
        keep_going = True if cond is None else _bool(cond)
        if in_c is not None and STOP.get() is None:
            try:
                done = in_c(max_trips, keep_going, rest)
            except StepFailure as failure:  # a hoisted step's
                raise body.failure(failure) from failure.error
            if done is not None:
                return done
        if whole is not None and STOP.get() is None:  # the whole Loop as straight code (looped.py)
            try:
                count, values, scans = whole(body.slots(rest[:n_carried], rest[n_carried:]),
                                             max_trips, keep_going)
            except StepFailure as failure:
                raise body.failure(failure) from failure.error
            carried = body.finished(values) if count else list(rest[:n_carried])
            return (*carried, *(_stack(values, info) for values, info in zip(scans, scan_infos)))
        scans = [[] for _ in scan_infos]
        i = 0
        with body.start(rest[:n_carried], rest[n_carried:]) as iterations:
            while keep_going and (max_trips is None or i < max_trips):
                watched = iterations.run((np.array(i, np.int64) if reads_i else None,
                                          np.array(keep_going) if reads_cond else None))
                done = watched[0]  # the condition, read in line as the If reads its predicate
                if type(done) is np.bool_:
                    keep_going = bool(done)
                elif type(done) is np.ndarray and done.size == 1:
                    keep_going = bool(done.item())
                else:
                    keep_going = _bool(done)
                for collected, value in zip(scans, watched[1:]):
                    collected.append(value)
                i += 1
            carried = iterations.carried()
        return (*carried, *(_stack(values, info) for values, info in zip(scans, scan_infos)))

    loop.iterated = body  # type: ignore[attr-defined]  # how it iterates, for the tests
    loop.whole = whole  # type: ignore[attr-defined]  # the whole Loop's code, where it has one
    loop.native = in_c  # type: ignore[attr-defined]  # its C form, where it has one
    return loop


def _stack(values: list[Any], info: TensorInfo, axis: int = 0) -> np.ndarray:
    if values:
        return sequence.stacked(values, axis)  # one concatenation, not np.stack's views
    dims = info.shape or ()
    element = tuple(d if isinstance(d, int) else 0 for d in dims)
    dtype = info.dtype if info.dtype is not None else np.dtype(np.float32)
    return np.zeros((0, *element), dtype=dtype)  # zero iterations: an empty stack


def make_scan(body: IteratedBody, n_state: int, n_scan_in: int, input_axes: Sequence[int],
              input_directions: Sequence[int], output_axes: Sequence[int],
              output_directions: Sequence[int], scan_out_infos: Sequence[TensorInfo]) -> Any:
    """ONNX Scan (opset 9 on): iterate ``body`` over slices of the scan inputs, carrying state;
    where no stop is asked, the whole Scan as straight code (looped.scanned), made per the scan
    inputs' axes (known at a call: an axis may count from the end)."""
    from backplane.backends.builtin.looped import scanned
    from backplane.runtime.loaded_network import STOP, StepFailure

    straight = not body.plain and not body.renew
    wholes: dict[tuple[int, ...], Any] = {}

    def scan(*inputs: Any) -> tuple[Any, ...]:
        scan_in = [np.asarray(x) for x in inputs[n_state:n_state + n_scan_in]]
        axes = [a % x.ndim for a, x in zip(input_axes, scan_in)]
        length = scan_in[0].shape[axes[0]] if scan_in else 0
        if straight and STOP.get() is None:
            key = tuple(axes)
            whole = wholes.get(key)
            if whole is None:
                whole = wholes[key] = scanned(body, axes, [bool(r) for r in input_directions])
            try:
                count, values, collected = whole(
                    body.slots(inputs[:n_state], inputs[n_state + n_scan_in:]), scan_in, length)
            except StepFailure as failure:
                raise body.failure(failure) from failure.error
            state = body.finished(values) if count else list(inputs[:n_state])
        else:
            collected = [[] for _ in scan_out_infos]
            with body.start(inputs[:n_state], inputs[n_state + n_scan_in:]) as iterations:
                for t in range(length):
                    slices = [_row(x, length - 1 - t if rev else t, ax)
                              for x, ax, rev in zip(scan_in, axes, input_directions)]
                    for values, value in zip(collected, iterations.run(slices)):
                        values.append(value)
                state = iterations.carried()
        results = []
        for values, info, axis, rev in zip(collected, scan_out_infos, output_axes, output_directions):
            stacked = _stack(values[::-1] if rev else values, info)
            results.append(np.moveaxis(stacked, 0, axis % stacked.ndim))
        return (*state, *results)

    scan.wholes = wholes  # type: ignore[attr-defined]  # the code made per axes, for the tests
    return scan


def _row(x: np.ndarray, index: int, axis: int) -> np.ndarray:
    """Slice ``index`` of ``x`` along ``axis``: a view along the first axis (C-contiguous where
    ``x`` is, so a backend imports it without a copy), a copy along another."""
    return x[index, ...] if axis == 0 else np.take(x, index, axis=axis)  # [i, ...]: 0-d arrays too


def make_batched_scan(scan: Any, n_state: int, n_scan_in: int) -> Any:
    """ONNX Scan-8: ``scan`` (opset 9's) per batch item (axis 0 of every state and scan input; the
    scan axis is 1), over its first ``sequence_lens[b]`` steps when given; scan outputs of shorter
    items are padded with zeros to the longest."""

    def batched(sequence_lens: Any, *inputs: Any) -> tuple[Any, ...]:
        states, scans = inputs[:n_state], inputs[n_state:n_state + n_scan_in]
        captured = inputs[n_state + n_scan_in:]
        batch = (states or scans)[0].shape[0]
        items = []
        for b in range(batch):
            length = scans[0].shape[1] if sequence_lens is None else int(sequence_lens[b])
            items.append(scan(*[s[b] for s in states], *[x[b, :length] for x in scans], *captured))
        outputs = []
        for index in range(len(items[0]) if items else 0):
            values = [np.asarray(item[index]) for item in items]
            if index >= n_state:  # scan outputs: (steps, ...) per item, padded to the longest
                steps = max(v.shape[0] for v in values)
                values = [np.pad(v, [(0, steps - v.shape[0])] + [(0, 0)] * (v.ndim - 1))
                          for v in values]
            outputs.append(np.stack(values))
        return tuple(outputs)

    return batched


def make_sequence_map(body: IteratedBody, n_captured: int, n_outputs: int) -> Any:
    """ONNX SequenceMap: run ``body`` on the i-th element of every sequence input (tensor inputs
    whole), collecting each body output into a sequence."""

    def sequence_map(*inputs: Any) -> tuple[Any, ...]:
        formal, captured = inputs[:len(inputs) - n_captured], inputs[len(inputs) - n_captured:]
        collected: list[list[Any]] = [[] for _ in range(n_outputs)]
        with body.start((), captured) as iterations:
            for i in range(len(formal[0])):
                args = [x[i] if isinstance(x, list) else x for x in formal]
                for values, value in zip(collected, iterations.run(args)):
                    values.append(value)
        return tuple(collected)

    return sequence_map
