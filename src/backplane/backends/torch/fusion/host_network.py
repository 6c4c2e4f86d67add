"""A CpuAcc network whose every step runs on NumPy arrays (a native plan, then a HostChain), run as
one straight function over its steps' NumPy runs: no torch tensor between them.

Why: a detector's build for its input shapes is two steps, the native plan of its backbone, head
and box decode (``native_cnn``) and the HostChain of its NonMaxSuppression and the gathers after
(``host_chain``). Between them each value crossed torch: the plan's five outputs made by
``torch.empty`` and read by ``data_ptr``, then each taken back by ``.numpy()`` in the chain, and
the network's steps around both (its slots, each step's tuple of results). Both steps offer a run
on NumPy arrays (``runtime/host_route.py``); here the network calls those one after the other,
crossing from torch once at its inputs and back once at its outputs. detect_nms_dyn21, 1 thread,
thread CPU of ``session.run`` (see ``HostNetwork``'s figures in docs/torch-backends.md).

A static detector's session runs the same way on the caller's arrays: its network is those
two steps between MemImports (the caller's arrays handed to CpuAcc's tensors and back, views
both ways), which are here the same arrays, and the session's direct run calls the NumPy run
(``prepared_run._native``).

How: the HostChain's workload offers ``plans_network`` (this module's ``planner``), which the
runtime's straight run of a network asks at load (``steps.native_network``, as builtin's If
offers its native network). It takes a network whose steps all offer a NumPy run (or are such
MemImports, at all its inputs and outputs) and read only the network's inputs, earlier steps'
outputs and constants, and whose outputs are distinct values its steps made (each step's NumPy
outputs are fresh arrays, so each is the caller's alone). A call on anything but torch CPU tensors, under a stop, or one
whose NumPy run raises (a shape the plan was not made for, an index out of range) gives None:
the steps run as before, and name the failing layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.runtime import host_route
from backplane.runtime.host_route import Hosted


def planner(steps: Sequence[Any], layers: Sequence[Any], template: Sequence[Any],
            input_slots: Sequence[int], output_slots: Sequence[int]) -> HostNetwork | None:
    """The network of ``steps`` as one NumPy run (see above), or None where it is not one. A
    network with MemImports (a static model's, whole: the caller's arrays handed to CpuAcc's
    tensors and back, views either way) runs on the caller's arrays, each handover the same
    array; one without, inside a Specialized layer, on the backend's tensors."""
    if not input_slots or not output_slots or len(set(output_slots)) != len(output_slots):
        return None
    hosts: list[Any] = []  # each step's NumPy run, None for a handover
    same: dict[int, int] = {}  # a handover's output -> the slot whose value it hands over
    for k, step in enumerate(steps):
        if step.convert is not None:
            layer = layers[k] if k < len(layers) else None
            if getattr(layer, "op_type", None) != "MemImport" or len(step.inputs) != 1 \
                    or len(step.outputs) != 1:
                return None
            same[step.outputs[0]] = same.get(step.inputs[0], step.inputs[0])
            hosts.append(None)
            continue
        host = host_route.of(step.workload)
        if host is None:
            return None
        hosts.append(host)
    if sum(host is not None for host in hosts) < 2:
        return None
    on_host = bool(same)
    inputs = set(input_slots)
    made: set[int] = set(inputs)
    constants: dict[int, np.ndarray] = {}
    for step, host in zip(steps, hosts):
        for slot in step.inputs if host is not None else ():
            if on_host and slot in inputs:
                return None  # a step on the caller's array as it is: the edges are mixed
            if slot in made or slot in constants or same.get(slot, slot) in made:
                continue
            array = _host_array(template[slot] if slot < len(template) else None)
            if array is None:
                return None  # a value of no step before it and not a constant: not a straight net
            constants[slot] = array
        made.update(step.outputs)
    produced = {slot for step, host in zip(steps, hosts) if host is not None for slot in step.outputs}
    roots = [same.get(slot, slot) for slot in output_slots]
    if len(set(roots)) != len(roots) or any(root not in produced for root in roots) \
            or any((slot in same) != on_host for slot in output_slots):
        return None  # an output given twice, not made by a step, or handed back in part only
    return HostNetwork(_code(steps, hosts, constants, input_slots, output_slots), on_host)


def _host_array(value: Any) -> np.ndarray | None:
    """A constant's NumPy form (a torch CPU tensor's view), None for anything else."""
    if type(value) is np.ndarray:
        return value
    if value is None or type(value).__name__ != "Tensor" or value.device.type != "cpu" \
            or value.requires_grad:
        return None
    try:
        return value.numpy()  # type: ignore[no-any-return]
    except (TypeError, RuntimeError):  # bfloat16, a tensor of no NumPy type
        return None


def _code(steps: Sequence[Any], hosts: Sequence[Any], constants: dict[int, np.ndarray],
          input_slots: Sequence[int], output_slots: Sequence[int]) -> Callable[..., list[Any]]:
    """One function of straight code: each step's NumPy run on its slots' variables (``v<slot>``),
    the outputs as a list. Slot numbers only in the code; runs and constants its globals."""
    namespace: dict[str, Any] = {}
    lines = [f"def run({', '.join(f'v{slot}' for slot in input_slots)}):"]
    for k, (step, host) in enumerate(zip(steps, hosts)):
        if host is None:  # a handover: the same array
            lines.append(f"    v{step.outputs[0]} = v{step.inputs[0]}")
            continue
        namespace[f"h{k}"] = host
        for slot in step.inputs:
            if slot in constants:
                namespace[f"v{slot}"] = constants[slot]  # a global of that name: read as one
        outs = ", ".join(f"v{slot}" if slot else "_" for slot in step.outputs)
        call = f"h{k}({', '.join(f'v{slot}' if slot else 'None' for slot in step.inputs)})"
        lines.append(f"    {outs}, = {call}" if len(step.outputs) == 1 else f"    {outs} = {call}")
    lines.append(f"    return [{', '.join(f'v{slot}' for slot in output_slots)}]")
    exec(compile("\n".join(lines), "<host network>", "exec"), namespace)  # noqa: S102  # slots only
    return namespace["run"]  # type: ignore[no-any-return]


class HostNetwork:
    """``steps.native_network``'s object: called on a run's inputs (torch CPU tensors, the
    backend's memory; NumPy arrays ``on_host``) it returns the outputs as torch tensors over
    fresh NumPy arrays (the arrays ``on_host``), or None (the steps run); ``hosted`` and ``make`` give the NumPy run itself to a direct run that calls
    it on the caller's arrays (``prepared_run._native``)."""

    def __init__(self, host: Callable[..., list[Any]], on_host: bool = False) -> None:
        import torch

        from backplane.backends.torch.backend import _numpy_to_torch

        self.host, self.on_host = host, on_host
        self.hosted = Hosted()
        host_route.offer(self, host)  # a Specialized build of this network lends it (specialize)
        self._tensor, self._torch = torch.Tensor, _numpy_to_torch

    def __call__(self, values: Sequence[Any]) -> list[Any] | None:
        # plain loops, no comprehension: each is a Python frame of its own a call (3.11)
        if self.on_host:  # the caller's arrays in, fresh arrays out
            for value in values:
                if type(value) is not np.ndarray:
                    return None
            try:
                return self.host(*values)
            except Exception:  # noqa: BLE001  # again through the steps: the error names the layer
                return None
        tensor, arrays = self._tensor, []
        for value in values:
            if type(value) is not tensor or value.requires_grad or not value.is_cpu:
                return None
            arrays.append(value.numpy())
        try:
            made = self.host(*arrays)
        except Exception:  # noqa: BLE001  # again through the steps: the error names the layer
            return None
        to_torch, outputs = self._torch, []
        for array in made:
            outputs.append(to_torch(array))
        return outputs

    def make(self, key: tuple[Any, ...], values: Sequence[Any]) -> Callable[..., Any] | None:
        """The NumPy run, for any shapes (each step checks its own), kept under ``key``: None
        where it raises (the steps run then, and name the layer)."""
        del values
        host = self.host

        def guarded(*arrays: Any) -> list[Any] | None:
            try:
                return host(*arrays)
            except Exception:  # noqa: BLE001
                return None

        self.hosted[key] = guarded
        return guarded
