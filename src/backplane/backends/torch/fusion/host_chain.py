"""The small layers after a NonMaxSuppression, as one CpuAcc ``HostChain`` layer run in NumPy.

Why: a detector's post-process gathers boxes, scores and labels by the selected indices: a dozen
layers (Gather, Mul, Add, Reshape, Slice, GatherND ...) whose sizes come from the data, so no
trace holds them (``traced``), each a torch call of a few microseconds on a few dozen values. In a
run they ran one by one, each a step of the network (its Python call, the thread governor's
tick, torch's dispatch): on the corpus's detect_nms_ts14, 15 layers, 110 us of a 0.6 ms run
(1 thread, this 2-core AMD EPYC at load 9). As one layer they run CpuRef's NumPy kernels (the
executable specification: the values are CpuRef's) one after the other on NumPy views of the
tensors (``Tensor.numpy()``, no copy), one step of the network: one function of straight code made
at load (a line a layer, no loop over steps or dictionary of values), and where a layer's indices,
shape or axes are constants, its kernel fixed at load too (``fixed_kernel``: a Gather of one column
or a Slice is a NumPy view, a Reshape one call), where CpuRef's kernel reads and checks them at
every run.

The NonMaxSuppression itself is the chain's first step where its inputs are of NumPy's types
(``nms.host_non_max_suppression``: its boxes' and scores' NumPy views, its selections NumPy's), so
that the chain crosses from torch to NumPy once, at its inputs.

Only where the chain stays small: it starts at a NonMaxSuppression's selected indices (at most
its scores' size), every other tensor it reads is a constant or a static tensor of at most
``MOST`` values made before the NonMaxSuppression, and its layers are ``LIGHT`` ops (indexing,
shapes, elementwise arithmetic: no product, no expansion of a size read from data).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.kernels import bind_kernel, select_kernel
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo
from backplane.runtime import host_route

from backplane.backends.torch.fusion import host_network

STARTS = frozenset({"NonMaxSuppression"})
"""The layers whose outputs start a chain: sizes from data, bounded by their inputs'."""
LIGHT = frozenset({"Gather", "GatherElements", "GatherND", "Add", "Sub", "Mul", "Div", "Neg",
                   "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Transpose", "Concat",
                   "Cast", "Identity", "Equal", "Less", "Greater", "Not", "And", "Or", "Where"})
MOST = 1 << 16
"""The most values a static tensor a chain reads may hold (a detector's boxes: 32 x 4)."""
MIN_LAYERS = 2  # one layer: the same one step as before
PLAIN = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int16,
                                        np.int32, np.int64, np.uint8, np.bool_))
"""The types a chain's tensors may have (NumPy's own: no bfloat16)."""


def chained(view: SubgraphView, views: OptimizationViews) -> OptimizationViews:
    """``views`` with each chain of its untouched layers after a NonMaxSuppression (see above) as
    one HostChain layer; as it is where there is none."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    untouched = [lay for part in views.untouched for lay in part.layers]
    found = []
    for start in untouched:
        if start.op_type in STARTS and not start.domain:
            chain = _chain(start, untouched, graph)
            if chain and _hosted(start, graph):  # the start's inputs' NumPy views: one crossing
                chain = [start, *chain]
            if len(chain) >= MIN_LAYERS:
                found.append(chain)
    if not found:
        return views
    taken = {id(lay) for chain in found for lay in chain}
    result = OptimizationViews(substitutions=list(views.substitutions), failed=list(views.failed),
                               reasons=dict(views.reasons))
    for chain in found:
        part = SubgraphView.of(graph, chain)
        result.substitutions.append(Substitution(part, [_layer(part, graph)]))
    rest = [lay for lay in untouched if id(lay) not in taken]
    if rest:
        result.untouched.append(SubgraphView.of(graph, rest))
    return result


def _chain(start: Layer, layers: Sequence[Layer], graph: Graph) -> list[Layer]:
    """The layers after ``start`` (``layers`` in order) that read what it or the chain made, and
    else only constants and small static tensors that do not depend on ``start`` (so nothing
    outside the chain reads its values and feeds it again)."""
    position = next(k for k, lay in enumerate(layers) if lay is start)
    made = {n for n in start.outputs if n}
    after = _downstream(start, graph)
    chain: list[Layer] = []
    for lay in layers[position + 1:]:
        reads = [n for n in lay.inputs if n]
        if lay.domain or lay.op_type not in LIGHT or not any(n in made for n in reads) \
                or _ref_kernel(lay) is None \
                or not all(_plain(n, graph) for n in (*reads, *lay.outputs) if n):
            continue
        if all(n in made or n in graph.constants or (n not in after and _small(n, graph))
               for n in reads):
            chain.append(lay)
            made.update(n for n in lay.outputs if n)
    return _with_feeders(chain, layers[position + 1:], after, graph) if chain else chain


def _with_feeders(chain: list[Layer], later: Sequence[Layer], after: set[str],
                  graph: Graph) -> list[Layer]:
    """``chain`` with the light layers after its start that read only constants and small static
    tensors not computed from the start and are read by the chain alone (a Reshape of the boxes
    a trace made before the NonMaxSuppression: its own step else), all in ``later``'s order."""
    inside = set(map(id, chain))
    consumers = graph.consumers()
    feeders = {id(lay) for lay in later if id(lay) not in inside and not lay.domain
               and lay.op_type in LIGHT and _ref_kernel(lay) is not None
               and all(n in graph.constants or (n not in after and _small(n, graph)
                                                and _plain(n, graph)) for n in lay.inputs if n)
               and all(n and n not in graph.outputs and consumers.get(n)
                       and all(id(c) in inside for c in consumers[n]) for n in lay.outputs)}
    return [lay for lay in later if id(lay) in inside or id(lay) in feeders]


def _hosted(start: Layer, graph: Graph) -> bool:
    """Whether the chain's first step can be ``start`` itself, in NumPy on its inputs' views
    (``HOST_KERNELS``): where they are all of NumPy's types (a bfloat16 model's boxes: torch's)."""
    return _ref_kernel(start) is not None \
        and all(_plain(n, graph) for n in (*start.inputs, *start.outputs) if n)


def _downstream(start: Layer, graph: Graph) -> set[str]:
    """Every tensor computed from ``start``'s outputs."""
    consumers = graph.consumers()
    found: set[str] = set()
    pending = [n for n in start.outputs if n]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        pending += [n for lay in consumers.get(name, []) for n in lay.outputs if n]
    return found


def _small(name: str, graph: Graph) -> bool:
    shape = graph.info(name).shape
    return shape is not None and all(isinstance(d, int) for d in shape) \
        and math.prod(shape) <= MOST  # type: ignore[arg-type]


def _plain(name: str, graph: Graph) -> bool:
    dtype = graph.info(name).dtype
    return dtype is not None and np.dtype(dtype) in PLAIN


def _layer(part: SubgraphView, graph: Graph) -> Layer:
    constants = {n: graph.constants[n] for lay in part.layers for n in lay.inputs
                 if n in graph.constants}
    ranks = {n: len(graph.info(n).shape) for lay in part.layers for n in lay.inputs  # type: ignore[arg-type]
             if n and graph.info(n).shape is not None}
    attrs = {"layers": list(part.layers), "constants": constants, "inputs": list(part.inputs),
             "outputs": list(part.outputs), "ranks": ranks}
    first, last = part.layers[0].name, part.layers[-1].name
    name = f"HostChain[{first}..{last}]({len(part.layers)} layers)"
    return Layer(name, "HostChain", list(part.inputs), list(part.outputs), attrs, FUSED_DOMAIN, 1)


def _gather(data, indices, axis=0):
    # np.take counts negative indices from the end itself (CpuRef's Gather first makes a copy
    # with them wrapped: 4.5 against 1.2 us on a detector's 44 selected rows)
    return (np.take(data, indices, axis=axis),)


def _gather_nd(data, indices, batch_dims=0):
    # one fancy index of the index columns (NumPy counts negative ones from the end itself);
    # CpuRef's flattens and wraps each column first: 7.5-10 against 2.6-4.7 us on 20 rows
    last = indices.shape[-1]
    if batch_dims or not last:
        from backplane.backends.reference.kernels.indexing import gather_nd

        return gather_nd(data, indices, batch_dims)
    if last == 1:  # a detector's rows by one index each: no tuple made by a generator's frame
        return (data[indices[..., 0]],)
    return (data[tuple(indices[..., j] for j in range(last))],)


HOST_KERNELS: dict[str, dict[int, Any]] = {"Gather": {1: _gather}, "GatherND": {11: _gather_nd}}
"""Kernels of the chain in place of CpuRef's where they cost less (the same values); with
NonMaxSuppression's (``nms.host_non_max_suppression``, torch's module) from the first chain that
has one: CpuAcc's fusions import no torch of their own (``backplane.torch_free``)."""


def _ref_kernel(layer: Layer) -> Any:
    """The chain's kernel of ``layer``: ``HOST_KERNELS``' where it has one, else CpuRef's."""
    from backplane.backends.reference.kernels import KERNELS

    if layer.op_type == "NonMaxSuppression" and layer.op_type not in HOST_KERNELS:
        from backplane.backends.torch.kernels.nms import host_non_max_suppression

        HOST_KERNELS[layer.op_type] = {10: host_non_max_suppression}
    return select_kernel(HOST_KERNELS, layer.op_type, layer.opset) \
        or select_kernel(KERNELS, layer.op_type, layer.opset)


def _native(layers: Sequence[Layer], backend: Any, constants: dict[str, Any]) -> dict[int, Any]:
    """By layer index, the native kernels of the chain's layers under ``backend``'s options: a
    NonMaxSuppression in one C call (``native/nms.py``) where ``CpuAcc.native`` is "auto" and the
    library builds here, its limits read at load where they are constants (``nms.bound``); none
    else."""
    if not any(lay.op_type == "NonMaxSuppression" for lay in layers):
        return {}
    from backplane.native import nms

    kernel = nms.host_kernel(getattr(backend, "options", None) or {})
    return {} if kernel is None else {k: nms.bound(lay, constants) or kernel
                                      for k, lay in enumerate(layers)
                                      if lay.op_type == "NonMaxSuppression" and not lay.domain}


def host_chain_workload(layer: Layer, backend: Any, inputs: Sequence[TensorInfo] = (),
                        kernels: dict[int, Any] | None = None) -> Workload:
    """CpuRef's kernels of the layers one after the other on NumPy views of the inputs, as straight
    code (``straight``); the outputs as torch tensors again (a copy only where a kernel's result is
    read-only or not C-contiguous: ``torch.from_numpy`` takes neither). ``kernels``: by a layer's
    index, a kernel in place of its own (GpuAcc's NonMaxSuppression on overlaps its whole run's
    graph computed: ``gpu_nms``), bound to the layer's attributes as its own would be."""
    from backplane.backends.torch.fusion.onednn_graph import sequence_workload

    inner: list[Layer] = layer.attrs["layers"]
    constants = {n: np.asarray(v) for n, v in layer.attrs["constants"].items()}
    ranks = layer.attrs.get("ranks", {})
    outputs = set(layer.attrs["outputs"])
    given = kernels or _native(inner, backend, constants)
    steps = [(bind_kernel(given[k], lay.attrs, len(lay.outputs)) if k in given
              else fixed_kernel(lay, constants, ranks, outputs)
              or bind_kernel(_ref_kernel(lay), lay.attrs, len(lay.outputs)), lay.inputs, lay.outputs)
             for k, lay in enumerate(inner)]
    run = straight(steps, layer.attrs["inputs"], layer.attrs["outputs"], constants)
    fresh = _fresh_outputs(inner, layer.attrs["inputs"], layer.attrs["outputs"], constants, ranks,
                           given)
    host = straight(steps, layer.attrs["inputs"], layer.attrs["outputs"], constants, fresh)
    sequence = sequence_workload(inner, steps, constants, layer.attrs["inputs"],
                                 layer.attrs["outputs"])

    def profiled(*values: Any) -> tuple[tuple[Any, ...], list[tuple[str, str, float, int]]]:
        from backplane.backends.torch.backend import _numpy_to_torch

        outputs, spent = sequence.profiled(*[v.numpy() for v in values])
        return tuple(map(_numpy_to_torch, outputs)), spent

    run.profiled = profiled  # type: ignore[attr-defined]
    host_route.offer(run, host)  # on NumPy arrays, fresh NumPy outputs (runtime/host_route.py)
    run.plans_network = host_network.planner  # type: ignore[attr-defined]  # steps.native_network
    return run


FRESH = frozenset({"NonMaxSuppression", "Gather", "GatherElements", "GatherND", "Add", "Sub", "Mul",
                   "Div", "Neg", "Concat", "Equal", "Less", "Greater", "Not", "And", "Or", "Where"})
"""The ops whose kernels here return an array of their own each call (NumPy's ufuncs, ``take``,
fancy indexing, ``concatenate``, ``where``; the NMS's rows): a chain's output made by one of them
is handed over as it is; any other (a view: Reshape, Slice, Squeeze, a fixed Gather of one column;
Cast or Identity, which may give their input back) is copied."""


def _fresh_outputs(layers: Sequence[Layer], names_in: Sequence[str], names_out: Sequence[str],
                   constants: dict[str, Any], ranks: dict[str, int],
                   given: dict[int, Any]) -> list[bool]:
    """For each of the chain's outputs, whether its value is memory of its own, the caller's
    alone as it is (``FRESH``'s op made it by CpuRef's, this module's or ``given``'s kernel, not
    a fixed view, and no output before it is the same value); else the NumPy run copies it."""
    maker = {n: (k, lay) for k, lay in enumerate(layers) for n in lay.outputs if n}
    found, seen = [], set()
    for name in names_out:
        k, lay = maker.get(name, (-1, None))
        found.append(lay is not None and name not in seen and name not in constants
                     and name not in names_in and lay.op_type in FRESH and not lay.domain
                     and (k in given or fixed_kernel(lay, constants, ranks, set(names_out)) is None))
        seen.add(name)
    return found


def straight(steps: Sequence[tuple[Any, Sequence[str], Sequence[str]]], names_in: Sequence[str],
             names_out: Sequence[str], constants: dict[str, Any],
             fresh: Sequence[bool] | None = None) -> Any:
    """The chain as one function of straight code over local variables (the runtime's
    ``steps.compiled`` for named values): its torch inputs' NumPy views, a line per kernel, its
    outputs as torch tensors. Made from tensor positions only (v0, v1 ...: nothing of the model's
    names in the code); the kernels and constants are the function's globals. With ``fresh``
    (``_fresh_outputs``) the NumPy run instead: NumPy arrays in, a list of NumPy arrays out, each
    the caller's alone (a copy where ``fresh`` says not; a NumPy scalar a ufunc gave for a 0-d
    result an array)."""
    from backplane.backends.torch.backend import _numpy_to_torch

    namespace: dict[str, Any] = {"_torch": _numpy_to_torch, "_ndarray": np.ndarray,
                                 "_asarray": np.asarray, "_copy": _copy}
    local: dict[str, str] = {}

    def read(name: str) -> str:
        if not name:
            return "None"
        if name not in local:  # a constant (the chain reads nothing else it does not make)
            local[name] = f"c{len(local)}"
            namespace[local[name]] = constants[name]
        return local[name]

    def made(name: str) -> str:
        if not name:
            return "_"
        local[name] = f"v{len(local)}"
        return local[name]

    arguments = [made(name) for name in names_in]
    lines = [f"def run({', '.join(arguments)}):"]
    if fresh is None:
        lines += [f"    {v} = {v}.numpy()" for v in arguments]
    for index, (kernel, reads, writes) in enumerate(steps):
        namespace[f"k{index}"] = kernel
        call = f"k{index}({', '.join(map(read, reads))})"
        outputs = [made(name) for name in writes]
        lines.append(f"    {outputs[0]} = {call}[0]" if len(outputs) == 1
                     else f"    {', '.join(outputs)} = {call}[:{len(outputs)}]")
    if fresh is None:
        lines.append(f"    return ({''.join(f'_torch({read(n)}), ' for n in names_out)})")
    else:
        given = [read(n) for n in names_out]
        lines.append("    return [" + ", ".join(
            f"{v} if type({v}) is _ndarray else _asarray({v})" if mine else f"_copy({v})"
            for v, mine in zip(given, fresh)) + "]")
    exec(compile("\n".join(lines), "<host chain>", "exec"), namespace)  # noqa: S102  # positions only
    return namespace["run"]


def _copy(value: Any) -> np.ndarray:
    return np.array(value, order="C")  # a copy, C-contiguous, writable: the caller's alone


def fixed_kernel(layer: Layer, constants: dict[str, Any], ranks: dict[str, int],
                 outputs: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
    """``layer``'s kernel with its constant indices, shape or axes read at load (the same values
    as CpuRef's kernel, which reads them at each run): a Gather by one constant index and a Slice
    (steps above 0) are NumPy basic indexing (a view), an Unsqueeze a view with new axes, a
    Reshape to a constant shape without 0 one ``reshape``; None for any other layer, and for a
    Gather whose result leaves the chain (``outputs``: CpuRef's is a copy, a view would be the
    input's memory)."""
    op, reads = layer.op_type, layer.inputs
    if layer.domain or not reads or reads[0] in constants \
            or any(n and n not in constants for n in reads[1:]):
        return None
    given = [constants[n] if n else None for n in reads[1:]]
    rank = ranks.get(reads[0])
    if op == "Gather" and given[0].ndim == 0 and rank and layer.outputs[0] not in outputs:
        axis = int(layer.attrs.get("axis", 0)) % rank
        return _indexing((slice(None),) * axis + (int(given[0]),))
    if op == "Reshape" and len(given) == 1 and 0 not in given[0].tolist():
        shape = tuple(given[0].tolist())
        return lambda data, _shape: (data.reshape(shape),)
    if op == "Unsqueeze" and rank is not None and layer.opset >= 13 and len(given) == 1:
        axes = {int(a) % (rank + given[0].size) for a in given[0].reshape(-1).tolist()}
        if len(axes) != given[0].size:
            return None  # an axis named twice: CpuRef's error
        return _indexing(tuple(None if a in axes else slice(None) for a in range(rank + len(axes))))
    if op == "Slice" and rank is not None and layer.opset >= 10 and len(given) >= 2:
        return _slicing(given, rank)
    return None


def _indexing(key: tuple[Any, ...]) -> Any:
    return lambda data, *constants: (data[key],)  # the constants read at load


def _slicing(given: list[Any], rank: int) -> Any:
    """A Slice by constant starts, ends, axes and steps (above 0) as one basic index: Python's
    slices clamp a start or end past either side as ONNX does for steps above 0; None where a
    step is not above 0 or an axis is named twice."""
    starts, ends = given[0].reshape(-1).tolist(), given[1].reshape(-1).tolist()
    axes = given[2].reshape(-1).tolist() if len(given) > 2 and given[2] is not None \
        else list(range(len(starts)))
    steps = given[3].reshape(-1).tolist() if len(given) > 3 and given[3] is not None \
        else [1] * len(starts)
    axes = [int(a) % rank for a in axes]
    if len(set(axes)) != len(axes) or any(step <= 0 for step in steps):
        return None
    key = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        key[axis] = slice(int(start), int(end), int(step))
    return _indexing(tuple(key))
