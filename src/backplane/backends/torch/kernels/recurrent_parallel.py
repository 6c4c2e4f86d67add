"""A large bidirectional recurrent layer's two directions at once, on two threads.

Why: torch's fused kernels run a bidirectional layer's directions one after the other, and a
small recurrent product runs each on one thread (``recurrent_fused.ONE_THREAD_BELOW``: its steps'
parallel regions are too small to share). The two directions are independent: here the forward
one runs on the calling thread and the backward one, at the same time, on a worker thread, each on
one thread (ONNX Runtime likewise runs a bidirectional layer's directions at once). The full
tier's lstm_bi2_ts14 layer (100 steps, input 64, hidden 128), the handoff included, this project's
2-core AMD EPYC at load 5-7: the calling thread's CPU 1017-1030 -> 587-621 us a call.

Only where the partition runs on one thread held from two or more (``small.OneThread``,
``small.caller_threads``) and other processes leave this one two CPUs (``_busy``). Not where the
calling thread runs at two: after each parallel region its OpenMP team's other thread spins on the
other CPU (libgomp's default, milliseconds) and the worker waits for that CPU: that layer after a
2-thread convolution, load 5-6, median us, one call 1594-1623, at once 4773-5475 (with
GOMP_SPINCOUNT=0: 1473 / 1496, 1090 / 1257). How long: after a 2-thread convolution the other
thread of the team burned 3.6-5.4 ms of CPU while the caller slept 10 ms (1.0 of 1 ms, 3.1 of 3;
with GOMP_SPINCOUNT=10000: 0-0.3 ms); the variable is read when torch loads libgomp, and libgomp's
``omp_pause_resource_all`` (which does stop it) took 12 ms and left every later call of that
convolution at 85-125 ms (this AMD EPYC, load 6). Below ``PARALLEL_MACS`` the handoff (tens of us)
costs more than it saves.

A TorchScript trace keeps this as one op (``backplane::recurrent_directions``), whose body
decides at each run by the calling thread's counts and the load; the worker's ops are not traced.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from backplane.backends.torch.kernels import recurrent_packed
from backplane.backends.torch.kernels.recurrent_fused import on_one_thread_if

PARALLEL_MACS = 1 << 21
"""The least multiply-adds a direction (steps x gates * hidden x (input + hidden)) for the two
directions to run at once: crnn_paddle_ts12's small-tier LSTM (40 steps, input 64, hidden 32,
0.5 M) stays one call, the full tier's layers (6.9-19.7 M) run at once."""


def at_once(steps: int, batch: int, gate_rows: int, inputs: int, hidden: int) -> bool:
    """Whether a bidirectional layer of these sizes (W's gate rows and inputs) runs its directions
    at once: enough work a direction (``PARALLEL_MACS``), and no trace but TorchScript's (make_fx
    and torch.compile would not see the worker's ops, nor take this op without a fake kernel)."""
    return (steps * batch * gate_rows * (inputs + hidden) >= PARALLEL_MACS
            and not torch.compiler.is_compiling() and get_proxy_mode() is None)


def directions(name: str, x: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor],
               has_bias: bool, batch_first: bool) -> list[torch.Tensor]:
    """torch's bidirectional fused kernel ``name`` (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``)
    over ``x``: its outputs (Y with both directions' hidden side by side, the final states
    (2, batch, hidden)), each direction on one thread, at once where this thread is held to one
    from two or more and the machine is not busy (``_busy``). In a TorchScript trace, one op of
    the trace."""
    if torch.jit.is_tracing():
        return torch.ops.backplane.recurrent_directions(name, x, hx, params, has_bias,
                                                        batch_first)
    return _directions(name, x, hx, params, has_bias, batch_first)


def _directions(name, x, hx, params, has_bias, batch_first, alone=True):
    """Else one call, on one thread where ``alone`` (eager, as ``recurrent_fused.fused``), at the
    caller's count in a trace (as a trace of that call ran: ``fusion/traced.py`` keeps such a
    layer in a trace only on a machine not busy, where two threads ran it faster)."""
    from backplane.backends.torch.small import caller_threads

    # at once only where the partition runs on one thread held from more: at more, an OpenMP
    # thread of this one's team spins on the other CPU after each parallel region (libgomp's
    # default, milliseconds) and the worker waits for it
    if torch.get_num_threads() != 1 or caller_threads() < 2 or _busy():
        return list(on_one_thread_if(alone, _kernel(name), x, hx, params, has_bias, True,
                                     batch_first))
    per, axis = len(params) // 2, 1 if batch_first else 0  # (axis: time's)
    back = [s[1:] for s in hx]
    pending = _submit(_kernel(name), x.flip(axis), back, params[per:], has_bias, False,
                      batch_first)
    forward = _kernel(name)(x, [s[:1] for s in hx], params[:per], has_bias, False, batch_first)
    backward = pending()
    y = torch.cat([forward[0], backward[0].flip(axis)], 2)
    return [y] + [torch.cat([f, b]) for f, b in zip(forward[1:], backward[1:])]


def _kernel(name: str) -> Callable[..., Sequence[torch.Tensor]]:
    """torch's fused kernel ``name`` as ``kernel(x, hx, params, has_bias, bidirectional,
    batch_first)``: its outputs (Y, the final states); an LSTM on weights reordered for oneDNN
    once where it can (``recurrent_packed.py``)."""
    function = getattr(torch, name)

    def kernel(x, hx, params, has_bias, bidirectional, batch_first):
        if recurrent_packed.packable(name, x, params):
            return recurrent_packed.lstm(x, hx, params, has_bias, bidirectional, batch_first)
        state = hx if len(hx) > 1 else hx[0]
        return function(x, state, params, has_bias, 1, 0.0, False, bidirectional, batch_first)

    return kernel


BUSY_EVERY = 1.0
"""Seconds between two readings of the CPUs' use (``_busy``)."""
_reading: list[Any] = [None, False]  # the last reading (threads.Sample), busy since


def _busy() -> bool:
    """Whether other processes left this one fewer than two CPUs since the last reading (the
    thread governor's measure, ``threads.free_cpus``: the idle CPUs and this process's own use, so
    the worker's and OpenMP's threads do not count), read at most every ``BUSY_EVERY`` seconds;
    never where ``threads.CROWDED_CHECK`` is off (the tests)."""
    from backplane.backends.torch import threads

    if not threads.CROWDED_CHECK:
        return False
    last, busy = _reading
    if last is not None and time.perf_counter() - last.wall < BUSY_EVERY:
        return bool(busy)
    cpus = _cpus()
    now = threads.read_sample(cpus)
    if now is not None and last is not None:
        busy = threads.choose(threads.free_cpus(last, now, len(cpus)), 2) < 2
    _reading[:] = [now, busy]
    return bool(busy)


def _cpus() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                     else range(os.cpu_count() or 1))


# -- the worker thread -----------------------------------------------------------------------------
_JOBS: queue.SimpleQueue | None = None
_STARTING = threading.Lock()


def _submit(function: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``function(*args)`` on the worker thread, in this thread's grad mode, on one thread: a call
    that waits for its result (and raises what it raised). (With grad mode on, oneDNN's LSTM runs
    its training primitive, whose rounding differs from the inference one's on some CPUs: 1.5e-7
    on this project's AMD EPYC without AVX-512; the worker under no_grad gave the backward
    direction other values than the one call's.)"""
    done: queue.SimpleQueue = queue.SimpleQueue()
    _jobs().put((function, args, done, torch.is_grad_enabled()))

    def result() -> Any:
        ok, value = done.get()
        if not ok:
            raise value
        return value

    return result


def _jobs() -> queue.SimpleQueue:
    """The worker's queue, the worker started at the first call (and again in a forked child)."""
    global _JOBS
    if _JOBS is None:
        with _STARTING:
            if _JOBS is None:
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                ready = threading.Event()
                threading.Thread(target=_work, args=(jobs, ready), daemon=True,
                                 name="backplane-recurrent").start()
                ready.wait()  # (its set_num_threads(1) set torch's count for threads started
                # later too, as the caller's hold did: the hold puts the caller's back)
                _JOBS = jobs
    return _JOBS


def _work(jobs: queue.SimpleQueue, ready: threading.Event) -> None:
    torch.set_num_threads(1)
    ready.set()
    while True:
        function, args, done, grad = jobs.get()
        try:
            with torch.set_grad_enabled(grad):
                done.put((True, function(*args)))
        except Exception as exc:  # noqa: BLE001 - handed to the caller, raised there
            done.put((False, exc))


def _forget_worker() -> None:
    global _JOBS
    _JOBS = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)

_LIBRARY = torch.library.Library("backplane", "FRAGMENT")
_LIBRARY.define("recurrent_directions(str name, Tensor x, Tensor[] hx, Tensor[] params, "
                "bool has_bias, bool batch_first) -> Tensor[]")


def _traced(name: str, x: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor],
            has_bias: bool, batch_first: bool) -> list[torch.Tensor]:
    return _directions(name, x, hx, params, has_bias, batch_first, alone=False)


_LIBRARY.impl("recurrent_directions", _traced, "CPU")
