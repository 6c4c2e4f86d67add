"""The edge strategy is the Ethos-N design's rule (seed 003, "EdgeStrategy" and "capability"), over
every kind of memory, searching the consumer's factories in its order of preference.

``seed_rule`` below is that rule as the seed writes it, returning the seed's names (Undefined
included); every test compares ``optimizer.edges.choose`` with it. The deviations, each with its
reason, are the module docstring's of src/backplane/optimizer/edges.py and docs/architecture.md's
"Edges between backends": where the seed finds no strategy (Undefined) the edge is copied through
the factories' copy_out/copy_in; CUDA memory is imported only on its own device; a tensor that goes
to the user is never put in fallback memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession
from backplane.backends.api.memory import HOST_FACTORY, MemorySource, TensorHandleFactory
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from backplane.optimizer.edges import EdgeStrategy, choose

M = MemorySource
KINDS = (M.MALLOC, M.PINNED, M.DMA_BUF)  # the host-side kinds; CUDA has its own test below
SEED_NAMES = {EdgeStrategy.DIRECT_COMPATIBILITY: "DirectCompatibility",
              EdgeStrategy.EXPORT_TO_TARGET: "MemImport",
              EdgeStrategy.FALLBACK_IMPORT: "FallbackImport",
              EdgeStrategy.COPY_TO_TARGET: "MemCopy"}


def seed_rule(source: TensorHandleFactory, prefs: Sequence[TensorHandleFactory],
              ) -> tuple[str, str]:
    """The seed's strategy for an edge from ``source`` to a backend whose
    GetHandleFactoryPreferences() are ``prefs``, and the factory its compatibility layer's output
    uses ("" where there is none), written from 003's code, line by line."""
    for factory in prefs:  # Arm NN: "Search for direct match in prefs"
        if factory.id == source.id:
            return "DirectCompatibility", factory.id
    for factory in prefs:
        # "bool canExportImport = (factory->GetImportFlags() & srcFactory->GetExportFlags()) != 0;"
        if factory.import_flags & source.export_flags:
            # "if the srcFactory requires fallback import memory (by checking the
            # FallbackImportMemoryRequired Capability of srcFactory. Otherwise, ad MemImport layer"
            return ("FallbackImport" if source.fallback_import else "MemImport"), factory.id
    if source.supports_mapping:
        for factory in prefs:
            # "(strategy == EdgeStrategy::CopyToTarget && factory->SupportsMapUnmap())"
            if factory.supports_mapping:
                return "MemCopy", factory.id
    # "Undefined memory strategy found while adding copy layers for compatibility"
    return "Undefined", ""


def _flags(kinds: Sequence[MemorySource]) -> MemorySource:
    flags = M.UNDEFINED
    for kind in kinds:
        flags |= kind
    return flags


SUBSETS = [_flags(c) for n in range(len(KINDS) + 1) for c in itertools.combinations(KINDS, n)]
PLAIN = TensorHandleFactory("dst-plain", M.BACKEND)  # maps, imports nothing: a ClTensorHandle


def _name(flags: MemorySource) -> str:
    return "+".join(k.name or "" for k in KINDS if flags & k) or "none"


CASES = [pytest.param(e, i, sm, dm, fb, behind,
                      id=f"export={_name(e)}-import={_name(i)}-src_maps={sm}-dst_maps={dm}"
                         f"-fallback={fb}-{'second' if behind else 'only'}")
         for e, i, sm, dm, fb, behind in itertools.product(SUBSETS, SUBSETS, (True, False),
                                                           (True, False), (True, False),
                                                           (False, True))]


@pytest.mark.parametrize("export, import_, src_maps, dst_maps, fallback, behind_plain", CASES)
def test_every_combination_of_two_backends_capabilities_follows_the_seed(
        export: MemorySource, import_: MemorySource, src_maps: bool, dst_maps: bool,
        fallback: bool, behind_plain: bool) -> None:
    """8 export sets x 8 import sets x the two map flags x FallbackImportMemoryRequired, the
    consumer's factory alone or second in its preferences behind one that maps and imports nothing
    (1024 cases). The seed: "auto tensorHandleFactoryIds = backend->GetHandleFactoryPreferences();
    ... for (auto preference : tensorHandleFactoryIds)", a copy where
    "(strategy == EdgeStrategy::CopyToTarget && factory->SupportsMapUnmap())", and where it finds
    none, "Undefined memory strategy found while adding copy layers for" compatibility (here a copy
    through copy_out/copy_in)."""
    source = TensorHandleFactory("src", M.BACKEND, export_flags=export, supports_mapping=src_maps,
                                 fallback_import=fallback)
    target = TensorHandleFactory("dst", M.BACKEND, import_flags=import_, supports_mapping=dst_maps)
    prefs = (PLAIN, target) if behind_plain else (target,)
    want, want_factory = seed_rule(source, prefs)
    strategy, factory = choose(source, prefs)
    if want == "Undefined":  # the one deviation here: copied through copy_out/copy_in
        assert (strategy, factory.id) == (EdgeStrategy.COPY_TO_TARGET, prefs[0].id)
    else:
        assert (SEED_NAMES[strategy], factory.id) == (want, want_factory)


def test_the_combinations_cover_every_strategy() -> None:
    """The table above is not vacuous: each of the seed's outcomes occurs in it."""
    seen = set()
    for case in CASES:
        export, import_, src_maps, dst_maps, fallback, behind = case.values
        source = TensorHandleFactory("src", M.BACKEND, export_flags=export,
                                     supports_mapping=src_maps, fallback_import=fallback)
        target = TensorHandleFactory("dst", M.BACKEND, import_flags=import_,
                                     supports_mapping=dst_maps)
        seen.add(seed_rule(source, (PLAIN, target) if behind else (target,))[0])
    assert seen == {"FallbackImport", "MemImport", "MemCopy", "Undefined"}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_kind_of_memory_is_imported_not_only_malloc(kind: MemorySource) -> None:
    """"bool canExportImport = (factory->GetImportFlags() & srcFactory->GetExportFlags()) != 0;":
    DMA_BUF and PINNED as MALLOC, and whether either side maps does not enter into it."""
    source = TensorHandleFactory("src", M.BACKEND, export_flags=kind, supports_mapping=False)
    target = TensorHandleFactory("dst", M.BACKEND, import_flags=kind, supports_mapping=False)
    assert choose(source, target) == (EdgeStrategy.EXPORT_TO_TARGET, target)


def test_the_consumers_preferences_are_searched_in_order() -> None:
    """"for (auto preference : tensorHandleFactoryIds) ... found = true; break;": the first
    preferred factory that fits, not the backend's first factory only."""
    source = TensorHandleFactory("src", M.MALLOC, export_flags=M.MALLOC)
    first = TensorHandleFactory("imports-dma-buf", M.BACKEND, import_flags=M.DMA_BUF)
    second = TensorHandleFactory("imports-malloc", M.BACKEND, import_flags=M.MALLOC)
    third = TensorHandleFactory("imports-both", M.BACKEND, import_flags=M.MALLOC | M.DMA_BUF)
    assert choose(source, (first, second, third)) == (EdgeStrategy.EXPORT_TO_TARGET, second)
    assert choose(source, (first, third, second)) == (EdgeStrategy.EXPORT_TO_TARGET, third)
    assert choose(source, (first, source)) == (EdgeStrategy.DIRECT_COMPATIBILITY, source)
    unmapped = TensorHandleFactory("unmapped", M.BACKEND, supports_mapping=False)
    assert choose(TensorHandleFactory("private", M.BACKEND), (unmapped, first)) == \
        (EdgeStrategy.COPY_TO_TARGET, first)  # the first that maps


def test_fallback_import_memory_required_acts_where_import_is_possible() -> None:
    """"add the FallbackImport layer ... if the srcFactory requires fallback import memory (by
    checking the FallbackImportMemoryRequired Capability of srcFactory. Otherwise, ad MemImport
    layer as previously." Where nothing is imported the flag changes nothing."""
    target = TensorHandleFactory("dst", M.BACKEND, import_flags=M.MALLOC)
    plain = TensorHandleFactory("src", M.MALLOC, export_flags=M.MALLOC)
    asking = TensorHandleFactory("src", M.MALLOC, export_flags=M.MALLOC, fallback_import=True)
    assert choose(plain, target)[0] is EdgeStrategy.EXPORT_TO_TARGET
    assert choose(asking, target)[0] is EdgeStrategy.FALLBACK_IMPORT
    nothing_shared = TensorHandleFactory("src", M.MALLOC, export_flags=M.DMA_BUF,
                                         fallback_import=True)
    assert choose(nothing_shared, target)[0] is EdgeStrategy.COPY_TO_TARGET


def test_to_the_user_fallback_memory_is_never_used() -> None:
    """Deviation (no user edges in the seed): an output outlives the run, and the next run writes
    the fallback memory again; the flag says the producer's own memory cannot be handed over, so
    such an output is copied. Without the flag it is imported as any edge."""
    asking = TensorHandleFactory("src", M.MALLOC, export_flags=M.MALLOC, fallback_import=True)
    plain = TensorHandleFactory("src", M.MALLOC, export_flags=M.MALLOC)
    assert choose(asking, HOST_FACTORY, to_user=True)[0] is EdgeStrategy.COPY_TO_TARGET
    assert choose(plain, HOST_FACTORY, to_user=True)[0] is EdgeStrategy.EXPORT_TO_TARGET


def test_cuda_memory_is_imported_on_its_own_device_only() -> None:
    """Deviation (the seed has one device): CUDA memory of another device would reach the
    consumer as it is (DLPack does not move it), where its kernels cannot run on it; it is copied
    (neither side maps, the seed's Undefined, copied through copy_out/copy_in)."""
    def cuda(name: str, device: str) -> TensorHandleFactory:
        return TensorHandleFactory(name, M.CUDA, M.CUDA, M.CUDA, supports_mapping=False,
                                   device=device)

    assert choose(cuda("a", "cuda:0"), cuda("b", "cuda:0"))[0] is EdgeStrategy.EXPORT_TO_TARGET
    assert choose(cuda("a", "cuda:0"), cuda("b", "cuda:1"))[0] is EdgeStrategy.COPY_TO_TARGET
    assert choose(cuda("a", "cuda:0"), HOST_FACTORY)[0] is EdgeStrategy.COPY_TO_TARGET
    assert choose(HOST_FACTORY, cuda("b", "cuda:0"))[0] is EdgeStrategy.COPY_TO_TARGET


# -- the preference search in a network: a backend whose second factory is the one that fits -----
OWN = TensorHandleFactory("test-own", M.BACKEND)  # maps, imports nothing
IMPORTING = TensorHandleFactory("test-importing", M.BACKEND, M.MALLOC)


class TwoFactoryBackend(CpuRef):
    """CpuRef's kernels, preferring a factory that imports nothing to one that imports MALLOC."""

    id = "TestTwoFactories"

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (OWN, IMPORTING)


class HostSecondBackend(CpuRef):
    """CpuRef's kernels, with host memory second in its preferences."""

    id = "TestHostSecond"

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (OWN, HOST_FACTORY)


def _chain_model() -> bytes:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
             helper.make_node("Sigmoid", ["a"], ["b"], name="b"),
             helper.make_node("Tanh", ["b"], ["y"], name="y")]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "chain", [info("x", TensorProto.FLOAT, [2, 3])],
                              [info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("backend, strategy, factory", [
    (TwoFactoryBackend, "import", IMPORTING.id), (HostSecondBackend, "direct", None)])
def test_a_network_reads_through_the_consumers_second_factory(
        backend: type, strategy: str, factory: str | None) -> None:
    """CpuRef -> a backend whose first factory neither is host memory nor imports it: the edge is
    an import into (or direct through) its second factory, not the copy the first one needs.

    The seed: "compLayer->SetBackendId(dstLayer.GetBackendId()); ...
    compOutputSlot.SetTensorHandleFactory(preference);": the layer's output is in the consumer's
    chosen factory (``attrs["target"]``). Deviation: the layer itself stays on builtin, which makes
    every copy and import from the two factories' callables (the design's per-backend MemCopy
    workloads have no counterpart here), so glue never joins a backend's partition."""
    model, x = _chain_model(), np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    with registry.temporarily(backend.id, backend):
        session = InferenceSession(model, [backend.id, "CpuRef"], pins={"a": "CpuRef"})
        crossing = [c for c in session.report.copies if c.source == "CpuRef"]
        if strategy == "direct":
            assert crossing == []
        else:
            assert [c.strategy for c in crossing] == [strategy]
            layer = next(lay for lay in session.optimized.graph.layers
                         if lay.name == crossing[0].layer)
            assert layer.op_type == "MemImport" and layer.attrs["target"].id == factory
            assert layer.backend == "builtin"
        got = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, np.tanh(1 / (1 + np.exp(-np.maximum(x, 0)))), rtol=1e-6)
