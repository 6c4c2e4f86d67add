"""builtin's ``DecidedIf``: a network whose If the model's small inputs decide, run as the version
the predicate picks (``optimizer/decided.py`` makes the versions, each the network with one
branch inlined and optimized whole).

A call reads the inputs the predicate is computed from (``sr``), looks their bytes up among the
values seen (the first call with a value computes the predicate with CpuRef's kernels, a few
microseconds), and runs the version's loaded network: for the VAD one compiled CpuAcc partition
between its handovers (``steps.one_call``), where the If cut it into three and a nested network;
on GpuAcc one CUDA graph with its copies in and out per input signature (the version's
network runs so: ``loaded_network.whole_run``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.kernels import bind_kernel
from backplane.ir.graph import Graph, Layer

KNOWN_VALUES = 256
"""The predicate's input values remembered (past this many, each new one is computed per call)."""


def host_predicate(graph: Graph) -> Callable[[Sequence[Any]], bool]:
    """``graph`` (the layers computing an If's predicate) as one function of its inputs' values,
    on CpuRef's kernels (NumPy: the inputs are small host arrays)."""
    from backplane.backends.registry import registry

    reference = registry.create("CpuRef")
    calls = []
    for layer in graph.layers:
        kernel = reference.kernel_for(layer)
        if kernel is None:  # the optimizer decides only what CpuRef computes
            raise NotImplementedError(f"no CpuRef kernel for {layer.describe()}, which computes "
                                      f"the predicate of '{graph.name}'")
        calls.append((bind_kernel(kernel, layer.attrs, len(layer.outputs)), layer.inputs,
                      layer.outputs))
    constants, inputs, (cond,) = dict(graph.constants), list(graph.inputs), graph.outputs

    def predicate(values: Sequence[Any]) -> bool:
        env: dict[str, Any] = {**constants, **dict(zip(inputs, values))}
        for call, reads, writes in calls:
            env.update(zip(writes, call(*[env.get(n) if n else None for n in reads])))
        return bool(np.asarray(env[cond]).reshape(-1)[0])

    return predicate


def make_decided(layer: Layer, nets: Mapping[str, Any]) -> Any:
    """The workload of ``layer`` (a DecidedIf) over its versions' loaded networks (``nets``, by
    branch: ``then_branch``, ``else_branch``)."""
    graph: Graph = layer.attrs["predicate"]
    positions = [layer.inputs.index(name) for name in graph.inputs]
    compute = host_predicate(graph)
    then_run, else_run = nets["then_branch"].execute, nets["else_branch"].execute
    then_owned, else_owned = nets["then_branch"].execute_owned, nets["else_branch"].execute_owned
    known: dict[Any, bool] = {}  # the predicate's inputs' bytes (a tuple of them) -> taken

    def taken(values: Sequence[Any]) -> bool:
        # the inputs were checked: each of its declared type and fixed sizes, so bytes tell them
        if len(positions) == 1:  # (a sample rate): no list, no tuple
            value = values[positions[0]]
            key: Any = value.tobytes() if type(value) is np.ndarray else _bytes(value)
        else:
            key = tuple([_bytes(values[p]) for p in positions])
        found = known.get(key)
        if found is None:
            found = compute([np.asarray(values[p]) for p in positions])
            if len(known) < KNOWN_VALUES:
                known[key] = found
        return found

    def decided_if(*values: Any) -> list[Any]:
        return (then_run if taken(values) else else_run)(values)

    if len(positions) == 1:  # (a sample rate): a value seen before looked up in line, no frame
        (position,) = positions  # of taken's (the VAD's run: the If is its one step before CpuAcc)

        def owned(values: Sequence[Any]) -> list[Any]:  # outputs the caller's (steps.owning_call)
            value = values[position]
            found = known.get(value.tobytes() if type(value) is np.ndarray else _bytes(value))
            if found is None:
                found = taken(values)
            return (then_owned if found else else_owned)(values)
    else:
        def owned(values: Sequence[Any]) -> list[Any]:
            return (then_owned if taken(values) else else_owned)(values)

    def profiled(*values: Any) -> tuple[list[Any], list[tuple[str, str, float]]]:
        start = time.perf_counter()
        branch = "then_branch" if taken(values) else "else_branch"
        spent = time.perf_counter() - start
        outputs, timings = nets[branch].execute_profiled(values)
        path = f"{layer.name}/{branch}/"
        return outputs, [(f"{layer.name} ({branch} taken)", "If", spent),
                         *((f"{path}{t.layer}", t.op_type, t.seconds) for t in timings)]

    decided_if.profiled = profiled  # type: ignore[attr-defined]
    decided_if.owned = owned  # type: ignore[attr-defined]
    decided_if.taken = taken  # type: ignore[attr-defined]  # for tests
    decided_if.runs = {b: getattr(n, "host_runs", None) or n.execute  # type: ignore[attr-defined]
                       for b, n in nets.items()}  # for tests: the whole runs where there are
    decided_if.versions = dict(nets)  # type: ignore[attr-defined]  # for tests: the networks
    return decided_if


def _bytes(value: Any) -> bytes:
    return value.tobytes() if type(value) is np.ndarray else np.asarray(value).tobytes()
