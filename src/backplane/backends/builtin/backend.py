"""builtin: always registered; owns control flow (If, Loop, Scan), sequence and optional plumbing,
and the glue between backends (MemCopy, MemImport).

Like onert's builtin backend, its kernels are never taken from other backends: the optimizer gives it
its layers directly, whatever the preferences, and places the layers of the bodies like any others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from backplane.backends.api.backend import (
    SUPPORTED,
    Backend,
    Support,
    Workload,
    WorkloadFactory,
    unsupported,
)
from backplane.backends.api.memory import HOST_FACTORY, TensorHandleFactory
from backplane.backends.api.optimization import OptimizationViews
from backplane.backends.builtin import sequence
from backplane.backends.builtin.control_flow import (
    CONTROL_FLOW_OPS,
    make_batched_scan,
    make_if,
    make_loop,
    make_scan,
    make_sequence_map,
)
from backplane.backends.builtin.device import DEVICE_OUTPUTS, mark_device_outputs, on_device
from backplane.ir.graph import Layer, SubgraphView, TensorInfo

if TYPE_CHECKING:
    from backplane.backends.builtin.flat import FlatBody
    from backplane.optimizer.optimize import OptimizedNetwork
    from backplane.runtime.loaded_network import LoadedNetwork

DECIDED_IF = "DecidedIf"
"""A network whose If its small inputs decide, as its versions (``decided.py``)."""
BUILTIN_OPS = ("MemCopy", "MemImport", *CONTROL_FLOW_OPS, DECIDED_IF, *sequence.KERNELS)
OWNED_OPS = frozenset((*CONTROL_FLOW_OPS, DECIDED_IF, *sequence.KERNELS))
"""Ops the optimizer gives to builtin whatever the preferences (onert: kernels never taken elsewhere)."""


def make_mem_copy(source: TensorHandleFactory, target: TensorHandleFactory) -> Workload:
    """Copy a tensor out of ``source`` memory into ``target`` memory: one copy. Where one side holds
    plain host arrays (the user, CpuRef), the other side's copy alone moves it (``copy_in`` reads a
    host array, ``copy_out`` makes one); between two other memories it is staged through the host."""
    if source.id == HOST_FACTORY.id:
        return lambda x: (target.copy_in(x),)
    if target.id == HOST_FACTORY.id:
        return lambda x: (source.copy_out(x),)
    copy_out, copy_in = source.copy_out, target.copy_in

    def mem_copy(x: Any) -> tuple[Any]:
        return (copy_in(copy_out(x)),)

    return mem_copy


def make_mem_import(source: TensorHandleFactory, target: TensorHandleFactory) -> Workload:
    """Hand a tensor of ``source`` memory to ``target`` without a copy (both map host memory)."""
    export, import_ = source.export, target.import_

    def mem_import(x: Any) -> tuple[Any]:
        return (import_(export(x)),)

    return mem_import


class BuiltinWorkloadFactory(WorkloadFactory):
    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        if layer.op_type == "MemCopy":
            return make_mem_copy(layer.attrs["source"], layer.attrs["target"])
        if layer.op_type == "MemImport":
            return make_mem_import(layer.attrs["source"], layer.attrs["target"])
        if layer.op_type == DECIDED_IF:
            return _decided(layer, self.network_id)
        if layer.op_type in CONTROL_FLOW_OPS:
            bodies = [_loaded_body(layer, name, self._folded(layer, layer.attrs[name]),
                                   self.network_id) for name in CONTROL_FLOW_OPS[layer.op_type]]
            from backplane.backends.builtin.flat import flatten  # imports the runtime

            runs = [flatten(body) for body in bodies]
            if layer.attrs.get(DEVICE_OUTPUTS):  # its readers take GPU tensors as they are
                runs = [on_device(run) for run in runs]
            native = str(self.backend.options.get(NATIVE, "auto")).strip().lower()
            workload = _control_flow(layer, runs, native)
            if layer.op_type == "If" and native == "auto":  # the network around it in C, where
                from backplane.backends.builtin.native_net import planner  # all its layers are
                workload.plans_network = planner  # type: ignore[attr-defined]  # (steps.py)
            workload.exclusive = any(body.exclusive for body in bodies)  # type: ignore[attr-defined]
            workload.bodies = bodies  # type: ignore[attr-defined]  # closed with the network
            workload.runs = runs  # type: ignore[attr-defined]  # what runs: flat where it can be
            return workload
        return super().create_workload(layer, inputs, outputs)

    def _folded(self, layer: Layer, body: OptimizedNetwork) -> OptimizedNetwork:
        """``body`` with the outer constants it reads (captured inputs that are constants of the
        network being loaded: the runtime sets ``constants`` while it loads) made its own."""
        from backplane.backends.builtin.bodies import fold_outer_constants

        constants = getattr(self, "constants", None) or {}
        captured = layer.attrs["captured"]
        outer = layer.inputs[len(layer.inputs) - captured:]
        inner = body.input_names[len(body.input_names) - captured:]
        known = {name: constants[given] for name, given in zip(inner, outer) if given in constants}
        return fold_outer_constants(body, known)


def _loaded_body(layer: Layer, name: str, body: OptimizedNetwork, network_id: int) -> LoadedNetwork:
    """``layer``'s body ``name`` loaded. Where a backend cannot create the workload of one of its
    layers, the error says where that layer is (``body_path``, "loop/body/", as the report names a
    body's layers) and in which network (``body_network``): the runtime then makes the whole
    network again without that backend for it (``runtime._without``), as for any other layer."""
    from backplane.runtime.loaded_network import LoadedNetwork, WorkloadError

    try:
        return LoadedNetwork(body, network_id)
    except WorkloadError as exc:
        failed = exc  # a body inside this one failed: its layer's error, under its own path
        while failed.backend == "builtin" and isinstance(failed.__cause__, WorkloadError) \
                and hasattr(failed.__cause__, "body_path"):
            failed = failed.__cause__
        if not hasattr(failed, "body_path"):
            failed.body_path, failed.body_network = "", body  # type: ignore[attr-defined]
        failed.body_path = f"{layer.name}/{name}/{failed.body_path}"  # type: ignore[attr-defined]
        raise


def _decided(layer: Layer, network_id: int) -> Workload:
    """A DecidedIf's workload over its versions, loaded (``decided.py``)."""
    from backplane.backends.builtin.decided import make_decided

    nets = {name: _loaded_body(layer, name, layer.attrs[name], network_id)
            for name in ("then_branch", "else_branch")}
    workload = make_decided(layer, nets)
    workload.exclusive = any(net.exclusive for net in nets.values())
    workload.bodies = list(nets.values())  # closed with the network
    return workload  # type: ignore[no-any-return]


def _control_flow(layer: Layer, bodies: list[LoadedNetwork | FlatBody], native: str) -> Workload:
    """The workload of a control-flow layer over its bodies, loaded and flattened (then and else
    for If); ``native``: ``builtin.native`` (a Loop's C form)."""
    from backplane.backends.builtin.bodies import IteratedBody  # imports the runtime

    attrs, captured = layer.attrs, layer.attrs["captured"]
    if layer.op_type == "If":
        return make_if(bodies[0], bodies[1], captured)
    body = attrs["body"]
    graph = body.graph
    n_outputs = len(graph.outputs)
    if layer.op_type == "SequenceMap":
        n_formal = len(layer.inputs) - captured
        return make_sequence_map(IteratedBody(bodies[0], n_formal, [], range(n_outputs)),
                                 captured, n_outputs)
    if layer.op_type == "Loop":
        n_carried = len(layer.inputs) - 2 - captured
        scan_infos = [graph.info(name) for name in graph.outputs[1 + n_carried:]]
        iterated = IteratedBody(bodies[0], 2 + n_carried,
                                [(2 + k, 1 + k) for k in range(n_carried)],
                                [0, *range(1 + n_carried, n_outputs)])
        return make_loop(iterated, n_carried, scan_infos, native)
    n_scan_in = attrs["num_scan_inputs"]
    batched = layer.opset < 9  # Scan-8: a leading sequence_lens input, batch axis 0, scan axis 1
    n_state = len(layer.inputs) - n_scan_in - captured - batched
    n_scan_out = n_outputs - n_state
    iterated = IteratedBody(bodies[0], n_state + n_scan_in, [(k, k) for k in range(n_state)],
                            range(n_state, n_outputs))
    scan = make_scan(
        iterated, n_state, n_scan_in,
        attrs.get("scan_input_axes") or [0] * n_scan_in,
        attrs.get("scan_input_directions") or attrs.get("directions") or [0] * n_scan_in,
        attrs.get("scan_output_axes") or [0] * n_scan_out,
        attrs.get("scan_output_directions") or [0] * n_scan_out,
        [graph.info(name) for name in graph.outputs[n_state:]])
    return make_batched_scan(scan, n_state, n_scan_in) if batched else scan


NATIVE = "builtin.native"


class Builtin(Backend):
    id = "builtin"
    version = "1.0.0"
    KERNELS = sequence.KERNELS
    OPTIONS = {NATIVE: "auto (default): a Loop of small float32 layers runs as one C call where a "
                       "C compiler is here (native_loop.py), and so does a network of such layers "
                       "around an If (native_net.py); off: their kernels, as before"}

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        if layer.domain or layer.op_type not in OWNED_OPS:
            return unsupported(f"builtin runs only {', '.join(BUILTIN_OPS)}")
        if layer.op_type in CONTROL_FLOW_OPS or layer.op_type == DECIDED_IF:
            return SUPPORTED
        return super().is_layer_supported(layer, inputs, outputs)

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return BuiltinWorkloadFactory(self, memory_manager)

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        """Each If whose outputs only GpuAcc reads marked to hand them over in GPU memory
        (``device.py``); the other layers untouched."""
        return mark_device_outputs(view)
