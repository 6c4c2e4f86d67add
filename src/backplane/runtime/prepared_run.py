"""The common run of a loaded network, prepared at its load (``host_run``): one function of
straight code (``direct_run``) that checks the feeds in line (``prepared_check``'s check) and runs
the network; ``prepared_check`` itself for the rest.

A network that is one call (``steps.one_call``: CpuAcc's one partition or Specialized layer
between ``torch.from_numpy`` and ``.numpy()``) runs in that function: the handovers, the call and
the outputs' ownership in line; a network of steps as straight code (``steps.straight_run``:
CpuRef's, control flow's) has its steps' function called from it, its outputs made the caller's
there; any other its ``execute_owned`` (a builtin If's own run).

Why: on the small models a run is 0.05-0.8 ms, and between ``InferenceSession.run`` and the
partition's workload ran four Python frames of the runtime's (``Runtime.run``, the host run, its
prepared check, the one call) with loops over the inputs, the outputs and their handovers; each
frame's code is cold after the partition's kernels ran (a lone ``torch.from_numpy`` costs 1.8 us
of thread CPU in a tight loop, 9-12 between runs of resnet_basic_ts16, this 2-core AMD EPYC under
load). The session calls the function itself (``Runtime.host_run``). Its code is made from
positions only: the inputs' names, dtypes, shapes and the handovers are its globals, no text of
the model's.

It takes only what the prepared check takes (a dict of exactly the inputs, NumPy arrays of their
dtype and sizes) and no run under a stop; for anything else it returns None and the caller runs
the network as before (the full check names what is wrong). A workload's failure in the one call
runs the call again through the network's own (``steps.owning_call``), whose error names the
layer; a failing step of straight code is named as ``straight_run`` names it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.ir.graph import TensorInfo
from backplane.runtime.steps import STOP


def direct_run(specs: Sequence[tuple[str, TensorInfo]], loaded: Any) -> Callable[[Any], Any] | None:
    """The run of ``loaded`` (a LoadedNetwork whose inputs are ``specs``), its outputs the
    caller's: the feeds' check in line, then, for a network of one call (``steps.owning_call``'s
    ``handed``, with its ``parts``), that call in line (see above); for steps as straight code
    (``steps.straight_run``), their function called on the slots, its outputs made the caller's
    in line; else ``execute_owned`` on the checked values (a builtin If's own run). None where an
    input's type is not known (sequences, optionals: ``check_inputs`` takes them)."""
    from backplane.runtime.fresh_outputs import Made, fresh, made

    if any(info.dtype is None for _, info in specs):
        return None
    execute = loaded.execute_owned
    parts = getattr(execute, "parts", None)
    if parts is not None and not parts[2]:  # no outputs
        parts = None
    straight = getattr(loaded.execute, "straight", None)  # not where a wrapper took execute
    if "execute_owned" in vars(loaded) or not isinstance(straight, tuple):
        straight = None  # (the owned run is another than owned(execute(...)))
    namespace: dict[str, Any] = {"ndarray": np.ndarray, "STOP": STOP, "execute": execute,
                                 "Made": Made, "made": made, "fresh": fresh}
    lines = ["def run(feeds):", *_check(specs, namespace)]
    values = "[" + "".join(f"v{k}, " for k in range(len(specs))) + "]"
    if parts is not None:
        lines += _one_call(parts, values, namespace)
    elif straight is not None:
        lines += _straight(straight, loaded.held, values, namespace,
                           getattr(loaded.execute, "native", None))
    else:
        lines.append(f"    return execute({values})")
    exec(compile("\n".join(lines), "<backplane direct run>", "exec"), namespace)  # noqa: S102
    return namespace.pop("run")  # type: ignore[no-any-return]  # no cycle: freed at the unload


def _check(specs: Sequence[tuple[str, TensorInfo]], namespace: dict[str, Any]) -> list[str]:
    """``prepared_check``'s check as lines over ``feeds``, the values read into ``v<k>``; each
    input's name, dtype and shape in ``namespace``."""
    lines = [f"    if type(feeds) is not dict or len(feeds) != {len(specs)}:", "        return None"]
    free: dict[str, list[tuple[int, int]]] = {}
    for k, (name, info) in enumerate(specs):
        namespace[f"n{k}"], namespace[f"d{k}"] = name, info.dtype
        lines += [f"    v{k} = feeds.get(n{k})",
                  f"    if type(v{k}) is not ndarray or v{k}.dtype is not d{k}:", "        return None"]
        shape = None if info.shape is None else tuple(info.shape)
        if shape is None:
            continue
        if all(type(d) is int for d in shape):
            namespace[f"z{k}"] = shape
            lines += [f"    if v{k}.shape != z{k}:", "        return None"]
            continue
        checks = [f"len(s{k}) != {len(shape)}"]
        for axis, size in enumerate(shape):
            if isinstance(size, int):
                checks.append(f"s{k}[{axis}] != {int(size)}")
            elif isinstance(size, str):
                free.setdefault(size, []).append((k, axis))
        lines += [f"    s{k} = v{k}.shape", f"    if {' or '.join(checks)}:", "        return None"]
    for places in free.values():
        (first, axis), others = places[0], places[1:]
        for other, other_axis in others:
            lines += [f"    if v{other}.shape[{other_axis}] != v{first}.shape[{axis}]:",
                      "        return None"]
    return lines


def _one_call(parts: tuple[Any, ...], values: str, namespace: dict[str, Any]) -> list[str]:
    """The lines of ``steps.owning_call``'s ``handed`` of ``parts``, on the checked ``v<k>``."""
    reads, namespace["workload"], outs, namespace["owned"] = parts
    args = []
    for j, (index, convert, _, constant) in enumerate(reads):
        if index < 0:
            namespace[f"k{j}"] = constant
            args.append(f"k{j}")
        elif convert is None:
            args.append(f"v{index}")
        else:
            namespace[f"c{j}"] = convert
            args.append(f"c{j}(v{index})")
    for j, (_, convert, _) in enumerate(outs):
        namespace[f"x{j}"] = convert
    count = len(outs)
    call = f"workload({', '.join(args)})"
    keyed = getattr(namespace["workload"], "keyed", None)  # a Specialized layer's (specialize)
    if keyed is not None and all(index >= 0 and convert is not None
                                 for index, convert, _, _ in reads):
        namespace["keyed"] = keyed  # its signature by the NumPy shapes, read here once
        shapes = "".join(f"v{index}.shape, " for index, _, _, _ in reads)
        call = f"keyed(({shapes}), {', '.join(args)})"
    return ["    if STOP.get() is not None:", "        return None",
            *_hosted(reads, outs, values, namespace), "    try:",
            f"        results = {call}",
            "        own = made if type(results) is Made else fresh",
            *(f"        o{j} = results[{index}]" for j, (index, _, _) in enumerate(outs)),
            f"        mine = {' and '.join(f'own(o{j})' for j in range(count))}",
            f"        outputs = [{', '.join(f'x{j}(o{j})' for j in range(count))}]",
            "    except Exception:  # again through the steps: the error names the layer",
            f"        return execute({values})",
            "    if mine:", "        return outputs",
            f"    results = {' = '.join(f'o{j}' for j in range(count))} = None",
            f"    return owned(outputs, {values})"]


def _hosted(reads: Sequence[Any], outs: Sequence[Any], values: str,
            namespace: dict[str, Any]) -> list[str]:
    """Where the one call's workload holds ``host_route.Hosted`` runs (a Specialized layer's
    native plan, lent through a Delegate's call), the lines that run it on the checked ``v<k>``
    themselves where a run is kept for their shapes: its outputs are fresh NumPy arrays, the
    caller's (each network output a distinct one of them); the handovers, which are views, and
    the workload's frames are left out. None kept: the lines after, as before."""
    from backplane.runtime.host_route import hosted

    found = hosted(namespace["workload"])
    taken = [index for index, _, _ in outs]
    if found is None or any(index < 0 for index, _, _, _ in reads) or \
            len(set(taken)) != len(taken):
        return []
    namespace["hosted"] = found
    arrays = ", ".join(f"v{index}" for index, _, _, _ in reads)
    shapes = "".join(f"v{index}.shape, " for index, _, _, _ in reads)
    return [f"    h = hosted.get(({shapes}))", "    if h is not None:", "        try:",
            f"            r = h({arrays})",
            "        except Exception:  # again through the steps: the error names the layer",
            f"            return execute({values})",
            f"        return [{', '.join(f'r[{index}]' for index in taken)}]"]


def _native(native: Any, count: int, values: str, namespace: dict[str, Any]) -> list[str]:
    """Where the network runs whole as one native call (``steps.native_network``), the lines that
    run it on the checked ``v<k>``: the run kept for their shapes, made at their first call;
    its outputs fresh arrays, the caller's. None kept or made, or the call declined (None): the
    lines after, the steps."""
    if native is None:
        return []
    namespace.update(hosted=native.hosted, make=native.make)
    shapes = "".join(f"v{k}.shape, " for k in range(count))
    arrays = ", ".join(f"v{k}" for k in range(count))
    return [f"    k = ({shapes})", "    h = hosted.get(k)", "    if h is None:",
            f"        h = make(k, {values})", "    if h is not None:", f"        r = h({arrays})",
            "        if r is not None:", "            return r"]


def _straight(parts: tuple[Any, ...], held: Any, values: str, namespace: dict[str, Any],
              native: Any = None) -> list[str]:
    """The lines of ``steps.straight_run``'s run of ``parts`` on the checked ``v<k>`` (first its
    native call, where it has one: ``_native``), then ``LoadedNetwork.execute_owned``'s ``owned``
    of its outputs."""
    from backplane.runtime.ownership import owned
    from backplane.runtime.steps import StepFailure

    call, template, inputs_at, count, failure = parts
    namespace.update(call=call, template=template, failure=failure, held=held, owned=owned,
                     StepFailure=StepFailure, generic=np.generic, asarray=np.asarray)
    puts = [f"    env[{slot}] = v{k}" for k, slot in enumerate(inputs_at)]
    arrays = ", ".join(f"asarray(o[{j}]) if isinstance(o[{j}], generic) else o[{j}]"
                       for j in range(count))
    return ["    if STOP.get() is not None:", f"        return execute({values})",
            *_native(native, len(inputs_at), values, namespace),
            "    env = list(template)", *puts, "    try:", "        o = call(env)",
            "    except StepFailure as failed:",
            "        raise failure(failed.step, failed.error) from failed.error",
            "    env = None  # owned counts references: the outputs' are the list's alone",
            f"    results = [{arrays}]", "    o = None",
            f"    return owned(results, {values}, held)"]


def host_run(loaded: Any, specs: Sequence[tuple[str, TensorInfo]],
             ) -> Callable[[Any], list[Any] | None]:
    """The common run of ``loaded`` (a LoadedNetwork of inputs ``specs``), prepared at its load:
    NumPy arrays in a dict, exactly the model's inputs, each of the declared dtype and of sizes
    the declared dimensions take (a free dimension's name the same size wherever it appears), run
    on the host plan, the outputs made the caller's (``owned``). Returns None for anything else
    (another kind of feed, a wrong one): ``Runtime.run`` then checks it in full, which gives the
    value or the error (the check here only accepts what ``check_inputs`` accepts as it is). Where
    the inputs' types are known, ``direct_run`` above: the check in line."""
    direct = direct_run(specs, loaded)
    if direct is not None:
        return direct
    check, execute = prepared_check(specs), loaded.execute_owned

    def run(inputs: Any) -> list[Any] | None:
        values = check(inputs)
        if values is None:
            return None
        return execute(values)  # owned: LoadedNetwork.execute_owned

    return run


def prepared_check(specs: Sequence[tuple[str, TensorInfo]]) -> Callable[[Any], list[Any] | None]:
    """A check of a run's feeds made once for the inputs ``specs``: the feeds' values in the
    model's order where they are a dict holding exactly those names, each a NumPy array of its
    input's dtype, rank and fixed sizes, free dimensions of one name of one size; None otherwise
    (``check_inputs`` says what is wrong, or takes what this does not look at: sequences, other
    array types, a Mapping that is not a dict)."""
    if any(info.dtype is None for _, info in specs):  # sequences, optionals: the full check
        return lambda feeds: None
    entries = []
    free: dict[str, list[tuple[int, int]]] = {}  # a free dimension's name -> (input, axis)s
    for index, (name, info) in enumerate(specs):
        shape = None if info.shape is None else tuple(info.shape)
        static = shape if shape is not None and all(type(d) is int for d in shape) else None
        fixed = tuple((axis, size) for axis, size in enumerate(shape or ())
                      if isinstance(size, int))
        for axis, size in enumerate(shape or ()):
            if isinstance(size, str):
                free.setdefault(size, []).append((index, axis))
        entries.append((name, info.dtype, static, -1 if shape is None else len(shape), fixed))
    tied = [(places[0], places[1:]) for places in free.values() if len(places) > 1]
    count = len(entries)

    def check(feeds: Any) -> list[Any] | None:
        if type(feeds) is not dict or len(feeds) != count:
            return None
        values = []
        for name, dtype, static, rank, fixed in entries:
            value = feeds.get(name)
            if type(value) is not np.ndarray or value.dtype is not dtype:
                return None  # (a dtype equal but not the same object: the full check takes it)
            shape = value.shape
            if static is not None:
                if shape != static:
                    return None
            elif rank >= 0:
                if len(shape) != rank:
                    return None
                for axis, size in fixed:
                    if shape[axis] != size:
                        return None
            values.append(value)
        for (index, axis), others in tied:
            size = values[index].shape[axis]
            for other, other_axis in others:
                if values[other].shape[other_axis] != size:
                    return None
        return values

    return check
