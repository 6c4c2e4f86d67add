"""A whole Loop or Scan as one function of straight code, made at load: iterations at kernel cost.

``IteratedBody`` (bodies.py) makes an iteration one function (its steps, the carried values'
handover, the watched outputs), and the Loop's driver (control_flow.make_loop) calls it through
``Iterations.run`` once an iteration, which writes the iteration number into the slot list, reads
the outputs back out of a list it returns and hands the carried values over through the slot list.
On a body of small host kernels that machinery was much of an iteration: loop_scripted_ts16's RNN
step (a Gather, three Gemms on (1, 16), an Add, a Tanh, a SequenceInsert) cost about 21 us on
CpuRef, the same NumPy calls written by hand 8.5; its run entered 199 Python functions, 169 now.

Here the driver and both iterations' steps are one function: the first iteration's steps, then a
``while`` over the others' (``IteratedBody.first`` and ``rest``: what is invariant runs once), each
step one line over local variables, the carried values handed over by assignment, the condition
read in line, the scan outputs appended to lists (a Scan's rows taken in line: ``scanned``, made
per its inputs' axes). Nothing of the model is in the code: slot numbers only (as
``steps.compiled``). Where a run asks a stop (``STOP``), or the body iterates
the plain way or renews its carried values (``IteratedBody.plain``, ``renew``), it runs as before
(python bench/control_flow.py, 1 thread, load 5-7: a Loop iteration of one Add 2.75 -> 1.17 us, a
Scan row 2.77 -> 0.87).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from backplane.backends.builtin.control_flow import _bool
from backplane.runtime.loaded_network import NONE_SLOT, StepFailure
from backplane.runtime.steps import RunTerminated, SlotReader, Step, _outputs, _step_at, step_line

if TYPE_CHECKING:
    from backplane.backends.builtin.bodies import IteratedBody

FILE = "<backplane steps>"  # steps.compiled's: ``_step_at`` finds a failed step's line by it


def looped(body: IteratedBody, reads_i: bool, reads_cond: bool,
           ) -> Callable[[list[Any], int | None, bool], tuple[int, list[Any], list[list[Any]]]]:
    """``body``'s Loop (formal inputs: the iteration number, the condition, the carried values;
    watched outputs: the condition, then the scan outputs) as ``run(env, max_trips, keep_going)``:
    ``env`` a call's slots (``IteratedBody.slots``), the iterations while the condition holds and
    ``max_trips`` (None: no count) allows; the iterations' count, the carried values after the
    last (its body's, as ``Iterations.values``) and each scan output's values. A failed step
    raises ``StepFailure`` naming it."""
    i_slot, cond_slot = body.varying_slots[:2]
    given = [(i_slot, "_array(i, _int64)")] if reads_i else []
    given += [(cond_slot, "_array(keep_going)")] if reads_cond else []
    return _generate(body, "env, max_trips, keep_going", given, condition=True,
                     more="keep_going and (max_trips is None or i < max_trips)",
                     none="not keep_going or (max_trips is not None and max_trips <= 0)")


def scanned(body: IteratedBody, axes: Sequence[int], reverse: Sequence[bool],
            ) -> Callable[[list[Any], Sequence[Any], int], tuple[int, list[Any], list[list[Any]]]]:
    """``body``'s Scan (formal inputs: the state, then one row of each scan input; watched
    outputs: the scan outputs) as ``run(env, xs, length)``: ``xs`` the scan inputs, row ``i`` of
    each (counted from the end where ``reverse``) along its axis of ``axes`` (non-negative) given
    at iteration ``i`` of ``length``; returns as ``looped``'s."""
    rows = []
    for k, (slot, axis, back) in enumerate(zip(body.varying_slots, axes, reverse)):
        at = "length - 1 - i" if back else "i"
        rows.append((slot, f"x{k}[{at}, ...]" if axis == 0 else f"_take(x{k}, {at}, axis={axis})"))
    unpack = "".join(f"x{k}, " for k in range(len(rows)))
    return _generate(body, "env, xs, length", rows, condition=False, more="i < length",
                     none="length <= 0", prologue=[f"    {unpack}= xs"] if rows else [])


def _generate(body: IteratedBody, parameters: str, given: Sequence[tuple[int, str]],
              condition: bool, more: str, none: str, prologue: Sequence[str] = ()) -> Any:
    """The code of ``looped`` and ``scanned``: ``given`` (slot, expression) written before each
    iteration's steps; with a ``condition``, the first watched output decides the next (the rest
    are scan outputs); ``more``: whether another iteration runs; ``none``: whether none does."""
    namespace: dict[str, Any] = {"StepFailure": StepFailure, "RunTerminated": RunTerminated,
                                 "_outputs": _outputs, "_array": np.array, "_int64": np.int64,
                                 "_bool_": np.bool_, "_ndarray": np.ndarray, "_truth": _bool,
                                 "_take": np.take}
    read = SlotReader("env", (slot for slot, _ in given))
    loads, made = read.loads, read.made
    steps_at: dict[int, Step] = {}

    lines: list[str] = []

    def iteration(steps: Sequence[Step], section: str, indent: str) -> None:
        lines.extend(f"{indent}v{slot} = {expression}" for slot, expression in given)
        for index, step in enumerate(steps):
            steps_at[len(lines)] = step
            lines.append(indent + step_line(step, f"{section}{index}", read, namespace))
            made.update(slot for slot in step.outputs if slot != NONE_SLOT)
            lines.extend(f"{indent}v{slot} = None" for slot in step.frees if slot in made)
        watched = [read(slot) for slot in body.watched_slots]  # before the carried values move
        if condition:
            lines.extend([f"{indent}done = {watched.pop(0)}",
                          f"{indent}if type(done) is _bool_:",
                          f"{indent}    keep_going = bool(done)",
                          f"{indent}elif type(done) is _ndarray and done.size == 1:",
                          f"{indent}    keep_going = bool(done.item())",
                          f"{indent}else:",
                          f"{indent}    keep_going = _truth(done)"])
        lines.extend(f"{indent}s{k}.append({value})" for k, value in enumerate(watched))
        sources = [read(c.source) for c in body.state]  # all read before any is written
        lines.extend(f"{indent}m{k} = {source}" for k, source in enumerate(sources))
        for k, carried in enumerate(body.state):
            for target in carried.targets:
                made.add(target)
                lines.append(f"{indent}v{target} = m{k}")
        lines.append(f"{indent}i += 1")

    iteration(body.first, "f", "        ")
    lines.append(f"        while {more}:")
    iteration(body.rest, "r", "            ")
    scans = ", ".join(f"s{k}" for k in range(len(body.watched_slots) - condition))
    header = [f"def run({parameters}):", *prologue, *loads.values(),
              *(f"    s{k} = []" for k in range(len(body.watched_slots) - condition)),
              "    i = 0", "    try:", f"        if {none}:",
              f"            return 0, None, [{scans}]"]
    # the carried values after the last iteration: the moves' values (m<k>), read where they are
    values = ", ".join(f"m{k}" for k in range(len(body.state)))
    footer = ["    except RunTerminated:", "        raise",
              "    except Exception as exc:",
              "        raise StepFailure(_failed_step(exc), exc) from exc",
              f"    return i, [{values}], [{scans}]"]
    source = "\n".join([*header, *lines, *footer])
    first = len(header) + 1  # the line number of the first line of ``lines``
    at = {first + offset: step for offset, step in steps_at.items()}
    namespace["_failed_step"] = lambda exc: _step_at(exc, at)
    exec(compile(source, FILE, "exec"), namespace)  # noqa: S102  # slot numbers only
    run = namespace.pop("run")  # no cycle through its globals: its workloads go at the unload
    run.source = source  # type: ignore[attr-defined]  # for tests and debugging
    return run
