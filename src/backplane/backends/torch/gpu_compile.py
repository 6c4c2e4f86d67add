"""GpuAcc.compile: a captured subgraph's layers traced and compiled before their capture
(``COMPILERS``), the trace's uploads of host constants made once (``uploads_folded``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from backplane.backends.api.backend import OptionError

log = logging.getLogger("backplane.torch")


COMPILERS = ("none", "inductor")
"""``GpuAcc.compile``: "none" (the default) runs each captured subgraph's layers kernel by kernel
inside its CUDA graph; "inductor" traces the subgraph, for its static shapes, into one graph of
torch operations (``make_fx``: every Python decision of the kernels taken once, as the capture takes
it) and compiles that with TorchInductor (``torch.compile``): elementwise chains, normalizations and
activations fused into Triton kernels, matmuls and convolutions left to cuBLAS and cuDNN, attention
patterns onto scaled-dot-product attention. The compiled graph is then captured as before. It costs
seconds to tens of seconds per subgraph at load, which inductor's own on-disk cache (keyed by the
traced graph) shortens on the next load. A subgraph inductor cannot compile runs uncompiled, with a
warning that names it."""


def compiler_of(options: Any) -> str:
    """``GpuAcc.compile``'s value, or an error that lists the choices."""
    choice = options.get("GpuAcc.compile", "none")
    if choice not in COMPILERS:
        raise OptionError(f"GpuAcc.compile {choice!r} is not one of {', '.join(COMPILERS)}")
    return choice


def compiled(run_layers: Callable[..., list[Any]], static: Sequence[Any], compiler: str,
             name: str) -> Callable[..., list[Any]]:
    """``run_layers`` compiled by ``compiler`` for the shapes of ``static`` (``COMPILERS``), and run
    once on them; ``run_layers`` itself where the compiler is "none" or fails."""
    if compiler == "none":
        return run_layers
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        traced = uploads_folded(make_fx(run_layers, tracing_mode="real")(*static))
        function = torch.compile(traced, fullgraph=True, dynamic=False)
        function(*static)  # compiles now, at load, not in the first run
    except Exception as exc:  # noqa: BLE001  # any failure: the layers run uncompiled
        log.warning("%s: %s could not compile it (%s: %s); it runs uncompiled", name, compiler,
                    type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
        return run_layers
    return lambda *values: list(function(*values))


def uploads_folded(traced: Any) -> Any:
    """``traced`` (make_fx's module) with each host constant it copies to a device at every call
    made that device's constant once. A kernel that uploads a NumPy array the first time it runs
    (``torch.from_numpy(b).to(device)``, kept for later calls: gpu_int8's MatMulInteger) is traced
    in that first run, as a host constant and its copy. Compiled so, gpt_dynquant_ort15 (nine
    MatMulIntegers) made 10 copies from pageable memory a run and no graph launch: its capture
    failed and it ran uncaptured, 1.37 ms a run against 0.16 uncompiled (H100 machine). A copy
    that an op writes into (in place, or through a view) stays: made once, it would carry one
    call's writes into the next."""
    import torch

    aten = torch.ops.aten
    graph, folded = traced.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten._to_copy.default \
                or _on_host(node) or len(node.args) != 1:
            continue
        chain, source = [], node.args[0]  # host-side copies and conversions of the constant
        while getattr(source, "op", "") == "call_function" and len(source.args) == 1 and (
                source.target is aten.lift_fresh_copy.default
                or (source.target is aten._to_copy.default and _on_host(source))):
            chain.append(source)
            source = source.args[0]
        value = getattr(traced, source.target, None) if getattr(source, "op", "") == "get_attr" \
            else None
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or _written(node):
            continue
        for step in (*reversed(chain), node):
            value = step.target(value, **step.kwargs)
        name = f"_uploaded_{folded}"
        traced.register_buffer(name, value, persistent=False)
        with graph.inserting_before(node):
            node.replace_all_uses_with(graph.get_attr(name))
        graph.erase_node(node)
        for left in (*chain, source):  # the host copies and the constant, where unread now
            if left.users:
                break
            graph.erase_node(left)
        if not any(n.op == "get_attr" and n.target == source.target for n in graph.nodes):
            delattr(traced, source.target)
        folded += 1
    if folded:
        traced.recompile()
    return traced


def _on_host(node: Any) -> bool:
    """Whether a traced ``_to_copy`` stays on the host (no device named, or the CPU)."""
    import torch

    device = node.kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


def _written(node: Any) -> bool:
    """Whether a traced op writes into ``node``'s tensor: an argument its schema marks written
    (in place, ``out=``) is it or a view of it (an op whose result aliases its input, followed);
    an op without a schema, or the graph's output (its reader's to write), is taken as writing."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if user.op != "call_function" or schema is None:
            return True
        passed = [(a, v) for a, v in zip(schema.arguments, user.args)] + \
            [(a, user.kwargs[a.name]) for a in schema.arguments if a.name in user.kwargs]
        for argument, value in passed:
            if value is node and argument.alias_info is not None:
                if argument.alias_info.is_write:
                    return True
                if _written(user):  # a view of it: written through that view?
                    return True
    return False
