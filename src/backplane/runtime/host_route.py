"""A run on NumPy arrays that a workload offers beside its run on its backend's tensors.

Why: on this machine a small CNN that CpuAcc plans whole for backplane's C runs its C in 17.6 us
(resnet_basic_ts16, 1 thread), and ``session.run`` took 27: the rest was the way down to that one
call and back (the direct run's ``torch.from_numpy`` and ``.numpy()`` handovers and the check that
each output is fresh, a Delegate's call, its sequence of one step, the Specialized layer's
lookup, ``torch.empty`` and ``data_ptr`` of each edge). Where the network is that one call, the
session's direct run (``prepared_run``) calls the plan on the caller's NumPy arrays itself
(``native/arena.ArenaExecutor.host``): fresh NumPy outputs, nothing between; so does the one
call of a DecidedIf's version (``steps.owning_call``: the VAD, a CNN then a recurrent plan,
``chained``). resnet_basic_ts16 then: 15.2 us a ``session.run`` around 12.9 of C (thread CPU,
1 thread, this 2-vCPU EPYC at load 9); the VAD 21 -> 11 us.

Two attributes, set at load, carry it:

- ``offer(workload, host)``: ``workload`` may be run as ``host(*arrays)`` on NumPy arrays of the
  dtypes and shapes it was made for, which returns its outputs as fresh NumPy arrays (the caller's
  alone), in its order. ``of(workload)`` reads it back only from the workload that offered it:
  an attribute a wrapper copied (``reduced.at_edges`` copies its run's ``__dict__``: float16 at
  its edges) or forwards (``wrapped.Wrapper``: a Trial, a swapped-in build) is not the offer of
  what it wraps, and gives None.
- ``Hosted`` (a dict, input shapes -> ``host``): a workload whose run depends on its inputs'
  shapes (a Specialized layer) keeps the runs its builds offer, by the inputs' shapes, and
  ``forward(outer, inner)`` lends it to a workload that calls ``inner`` on its own inputs and
  returns its outputs as they are (a Delegate's call, a sequence of that one step). The direct
  run reads it by the NumPy shapes its check has read (the dtypes are the model's, checked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Host = Callable[..., list[Any]]


class Hosted(dict):  # type: ignore[type-arg]
    """Input shapes (a tuple of each input's shape) -> the NumPy run of the build for them.
    Filled and cleared by its owner (``specialize``); read by the direct run."""

    __slots__ = ()


def offer(workload: Any, host: Host) -> None:
    """``workload`` runs as ``host`` on NumPy arrays (see above)."""
    workload.host_route = (id(workload), host)


def of(workload: Any) -> Host | None:
    """The NumPy run ``workload`` itself offered, or None (none, or one a wrapper copied or
    forwards: the id is the offering workload's, alive while anything holds its attribute)."""
    found = getattr(workload, "host_route", None)
    if type(found) is not tuple or found[0] != id(workload):
        return None
    return found[1]  # type: ignore[no-any-return]


def forward(outer: Any, inner: Any) -> None:
    """``outer`` (which calls ``inner`` on its inputs as given and returns ``inner``'s outputs as
    they are) lends ``inner``'s ``Hosted`` runs, where ``inner`` holds them itself."""
    found = getattr(inner, "__dict__", {}).get("hosted")
    if type(found) is Hosted:
        outer.hosted = found


def hosted(workload: Any) -> Hosted | None:
    """The ``Hosted`` runs ``workload`` holds or was lent, read once (at load): also through a
    ``wrapped.Wrapper``, which forwards ``__dict__`` (CpuAcc's ``threads.Governed``, whose tick
    sets torch's threads, which a native plan does not use)."""
    found = getattr(workload, "__dict__", {}).get("hosted")
    return found if type(found) is Hosted else None


def chained(head: Any, after: Any, take: Sequence[int], where: Sequence[tuple[str, int]],
            back: Sequence[tuple[str, int]]) -> Host | None:
    """The NumPy run of two workloads one after the other, as native_cnn's ``_then`` calls them:
    ``head`` on the inputs at ``take``; ``after`` (None: nothing after) on ``where``'s values,
    each ("made", i) ``head``'s i-th output or ("input", i) the i-th input; the outputs
    ``back``'s, ("made", i) or ("rest", i) ``after``'s. None where either offers no NumPy run or
    an output would be given twice (each must be the caller's alone)."""
    first = of(head)
    second = of(after) if after is not None else None
    if first is None or (after is not None and second is None) or len(set(back)) != len(back):
        return None

    def host(*values: Any) -> list[Any]:
        # plain loops, no comprehension: each is a Python frame of its own a call (3.11)
        given = []
        for i in take:
            given.append(values[i])
        made = first(*given)
        rest: Sequence[Any] = ()
        if second is not None:
            given = []
            for kind, i in where:
                given.append(made[i] if kind == "made" else values[i])
            rest = second(*given)
        outputs = []
        for kind, i in back:
            outputs.append(made[i] if kind == "made" else rest[i])
        return outputs

    return host
