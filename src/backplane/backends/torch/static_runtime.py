"""A Traced layer's frozen graph run by TorchScript's Static Runtime instead of its interpreter.

Why: a Traced layer at batch 1 is hundreds of small ops, and the JIT interpreter's cost per op (its
stack of IValues, a dispatcher call with a fresh result each, the autograd-free checks) is 1-4 us,
as much as the kernels of the small transformers. Static Runtime
(``torch._C._jit_to_static_module``), torch's executor for frozen graphs, runs the same graph with
out-variant kernels writing into buffers its memory planner keeps from the last call and a cheaper
dispatch per op. On the corpus's small tier, every Traced layer (1 thread, thread CPU a call,
static / interpreter, both in one process, this 2-core AMD EPYC, load 3.6-4.5): gpt_sdpa 0.59,
gpt_causal 0.68, cond_nested 0.70, encoder_padmask 0.78-0.85, char_tagger 0.76, audio_conv1d 0.79,
gpt_fp16 0.82, gru_tm3 0.83, crnn 0.85, bytes_int32 0.89, gru_bi2 0.92, encoder4_plain 0.64-1.08,
gpt_dynquant 0.82-1.07, detect_nms_ts14 0.93-1.04 (the last three vary with the process's heap);
two threads, wall: gpt_causal 0.88, char_tagger 0.83, encoder_padmask 0.71, gru_tm3 0.83. The
outputs are the interpreter's bit for bit but on bytes_int32 (2.4e-7) and crnn (5.6e-9).

On larger tensors the gain goes (the full tier: ``MEAN_SIZE``). So it is a rule, not a measurement
at load (measured routes flip on a busy machine): where the trace's ops make small tensors
(``MEAN_SIZE``) and Static Runtime builds the graph and gives the trace's own checked outputs
(``traced.compile_traced``'s two samples, each compared as the trace was), the trace runs on it;
``CpuAcc.static_runtime`` "off" keeps the interpreter. The check is needed: torch 2.13's out variant
of ``sort`` leaves a view of its values the wrong size (detect_nms_dyn21's top-k: "start (0) +
length (64) exceeds dimension size (1)"), and such a graph keeps the interpreter.

A run's outputs stay the caller's: Static Runtime plans only the memory of values inside the graph
(its ``manage_output_tensors`` is off from Python) and hands its outputs over, so the next call
makes new ones; the check asserts that too (the first sample's outputs unchanged by the second
call). One Static Runtime holds one set of buffers and is no more thread-safe than they are: a
call that finds it busy (another thread's run of the same session) runs the interpreter, which
is.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from backplane.backends.api.backend import OptionError

log = logging.getLogger("backplane.torch")
OPTION = "CpuAcc.static_runtime"
MODES = ("auto", "off")
MEAN_SIZE = 4096
"""Static Runtime where the trace's ops make tensors of at most this many elements on the mean: its
saving is per op, and with larger tensors its copies (a reshape or permute it makes a copy, to plan
memory without aliases) and its planned buffers (one arena, no reuse of a just-freed, cached
block) cost as much. Mean elements an op and static / interpreter thread CPU at 1 thread, in one
process (load 3.6-5.3): below it, the small tier's 15 traces (8-3,882 values an op) 0.59-0.93
(but for detect_nms_ts14 0.93-1.04, gpt_dynquant 0.82-1.07, encoder4_plain 0.64-1.08 in different
processes) and the full tier's VAD (450) 0.88; above, crnn 0.85 (6,612), and the full tier's
gpt_causal 0.93 (23,285), encoder4_plain 1.17 (9,142), char_tagger 1.13 (12,166), bytes_int32 0.81
(71,297), crnn 1.07 (173,484), lstm_bi2 0.96 (8,634): no gain to count on."""


def mode(options: Any) -> str:
    """``CpuAcc.static_runtime`` of ``options``: "auto" (the default) or "off"; checked at the
    first load too (``CpuAcc.create_backend_context``), since most traces are made at a run."""
    chosen = str(options.get(OPTION, "auto")).strip().lower()
    if chosen not in MODES:
        raise OptionError(f"{OPTION} {chosen!r} is not one of {', '.join(MODES)}")
    return chosen


def forward(module: Any, checks: Sequence[tuple[Sequence[Any], Sequence[Any]]],
            packed: Sequence[Any], backend: Any, traced: Any) -> Callable[..., Any] | None:
    """The frozen ``module``'s call on Static Runtime, or None where the option is off, a value is
    not on the CPU, the ops of ``traced`` (the graph it was frozen from) make large tensors
    (``MEAN_SIZE``), it does not build, or its outputs on ``checks`` (inputs, the outputs wanted;
    the packed weights follow the inputs) are not the wanted ones."""
    import torch

    from backplane.backends.torch.fusion.compiled import _close

    if mode(backend.options) == "off":
        return None
    values = [value for inputs, _ in checks for value in inputs] + list(packed)
    if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values):
        return None  # its out variants are the CPU's
    try:
        with torch.no_grad():
            size = mean_size(traced)
            if size > MEAN_SIZE:
                log.debug("%s: the interpreter runs it (%.0f values an op, above %d)",
                          module.original_name, size, MEAN_SIZE)
                return None
            static = torch._C._jit_to_static_module(module._c)
            made = []
            for inputs, wanted in checks:
                got = _tuple(static(*inputs, *packed))
                if len(got) != len(wanted) or not all(map(_close, got, wanted)):
                    log.debug("Static Runtime computes %s otherwise: the interpreter runs it",
                              module.original_name)
                    return None
                made.append((got, [g.clone() for g in got]))
            if not all(_close(g, k) for got, kept in made for g, k in zip(got, kept)):
                log.debug("Static Runtime wrote over a returned output: the interpreter runs it")
                return None
    except Exception as exc:  # noqa: BLE001  # any failure to build or run: the interpreter
        log.debug("no Static Runtime (%s: %s)", type(exc).__name__, exc)
        return None
    method = module._c._get_method("forward")
    lock = threading.Lock()

    def call(*args: Any) -> Any:
        if lock.acquire(blocking=False):
            try:
                return static(*args)
            finally:
                lock.release()
        return method(*args)  # its one set of buffers is another thread's now

    call.static = static  # type: ignore[attr-defined]  # for tests and debugging
    return call


def mean_size(graph: Any) -> float:
    """The mean element count of the tensors the ops of a traced ``graph`` (the trace's, before
    freezing: ``torch.jit.trace`` records each value's shape) make; values without a recorded shape
    (constants, nodes a fold inserted) are not counted. Read from the graph, not counted at a run
    under a ``TorchDispatchMode``: entering one imports ``torch._dynamo`` (4 s on this AMD EPYC, at
    a session's first traced call)."""
    import torch

    sizes = []
    for node in graph.nodes():
        if node.kind() in _NOT_OPS:
            continue
        for value in node.outputs():
            kind = value.type()
            shape = kind.sizes() if isinstance(kind, torch._C.TensorType) else None
            if shape is not None:
                sizes.append(math.prod(shape))
    return sum(sizes) / max(len(sizes), 1)


_NOT_OPS = frozenset({"prim::Constant", "prim::GetAttr", "prim::ListConstruct",
                      "prim::TupleConstruct", "prim::ListUnpack", "prim::TupleUnpack"})


def _tuple(outputs: Any) -> tuple[Any, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)
