"""Layers run one after the other over named values (``sequence_workload``): a OneDnnGraph's or a
Reduced layer's layers uncompiled (``onednn_graph.layers_run``), a HostChain's steps, an artifact's
partition; importable from ``onednn_graph`` as before."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from backplane.ir.graph import Layer


def sequence_workload(layers: Sequence[Layer], steps: Sequence[Any], template: dict[str, Any],
                      names_in: Sequence[str], names_out: Sequence[str],
                      convert: Callable[[Any], Any] | None = None) -> Any:
    """``steps`` (workload, names read, names written) one after the other over named values, with
    ``template``'s constants, each value dropped after its last reader, and each result passed
    through ``convert`` where given; its ``profiled`` times each of ``layers`` (the step's layer) for
    the profiler (see ``Workload``)."""
    from backplane.backends.torch.cuda import frees  # torch's: not at this module's import

    names_in, names_out = list(names_in), list(names_out)
    dead = frees(steps, set(names_out) | set(template))
    if convert is not None:
        steps = [(_converted(workload, convert), reads, writes) for workload, reads, writes in steps]

    def run(*values: Any) -> tuple[Any, ...]:
        env = dict(template)
        env.update(zip(names_in, values))
        for (workload, reads, writes), drop in zip(steps, dead):
            env.update(zip(writes, workload(*[env[n] if n else None for n in reads])))
            for name in drop:
                del env[name]
        return tuple(env[n] for n in names_out)

    def profiled(*values: Any) -> tuple[tuple[Any, ...], list[tuple[str, str, float, int]]]:
        env, spent = dict(template), []
        env.update(zip(names_in, values))
        for lay, (workload, reads, writes), drop in zip(layers, steps, dead):
            start = time.perf_counter()
            results = workload(*[env[n] if n else None for n in reads])
            seconds = time.perf_counter() - start
            env.update(zip(writes, results))
            spent.append((lay.name, lay.op_type, seconds,
                          sum(int(getattr(r, "nbytes", 0) or 0) for r in results)))
            for name in drop:
                del env[name]
        return tuple(env[n] for n in names_out), spent

    run.profiled = profiled  # type: ignore[attr-defined]
    if len(steps) == 1 and convert is None and list(steps[0][1]) == names_in \
            and list(steps[0][2]) == names_out:  # one step, on the inputs, making the outputs
        from backplane.runtime import host_route

        host_route.forward(run, steps[0][0])  # its native NumPy runs (a Specialized layer's)
    return run


def _converted(workload: Callable[..., Any], convert: Callable[[Any], Any]) -> Callable[..., Any]:
    return lambda *values: tuple(map(convert, workload(*values)))
