"""``backplane.partition`` and the placement report's delegation tags (seed 004's partitioner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import backplane
from backplane.backends.api.backend import Backend, CompileSpec, OptionError
from backplane.backends.torch.backend import CpuAcc
from backplane.frontends.onnx import import_onnx
from backplane.ir.graph import Graph, topological_order
from backplane.optimizer.optimize import OptimizationError
from backplane.optimizer.partition import DelegationSpec
from backplane.optimizer.partitioner import PartitionResult, partition
from backplane.optimizer.report import PlacementReport

MODEL = Path(__file__).parents[1] / "data" / "tiny_mobilenet_v3.onnx"
PINS = {"HardSwish": "CpuRef"}  # CpuAcc, CpuRef, CpuAcc, ...: many partitions
OPTIONS = {"CpuAcc.compile": "layers", "OpenVINO.threads": 1}


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_onnx(MODEL)


def _tag_graph_is_acyclic(result: PartitionResult) -> None:
    """Each tag as one node, an edge per tensor from one tag to another: a cycle would be a path
    that leaves a tag and comes back into it (the tag not fully contained)."""
    producers = {out: layer for layer in result.graph.layers for out in layer.outputs}
    edges: dict[str, set[str]] = {tag: set() for tag in result.partition_tags}
    for layer in result.graph.layers:
        for name in layer.inputs:
            source = producers.get(name)
            if source is not None and result.tags.get(source.name) != result.tags.get(layer.name):
                edges[result.tags[source.name]].add(result.tags[layer.name])
    done: set[str] = set()
    for start in edges:  # depth-first, a tag met again on the current path is a cycle
        stack, path = [(start, iter(edges[start]))], {start}
        while stack:
            node, rest = stack[-1]
            following = next(rest, None)
            if following is None:
                stack.pop()
                path.discard(node)
                done.add(node)
            elif following not in done:
                assert following not in path, f"tag {following} is left and entered again"
                stack.append((following, iter(edges[following])))
                path.add(following)


def test_partition_tags_every_layer_without_making_a_backend(
        graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 004: "The nodes that intend to be delegated must be tagged (by setting
    node.meta["delegation_tag"]) and this tag must be provided in the partition_tags dictionary
    mapping to an instance of DelegationSpec(backend_id, method_compilation_spec)." and "Each tag
    must represent a distinct submodule that we intend on lowering and should be fully
    contained"."""
    made = []
    original = CpuAcc.__init__

    def counted(self: Backend) -> None:
        made.append(self)
        original(self)

    monkeypatch.setattr(CpuAcc, "__init__", counted)
    result = backplane.partition(MODEL, ["CpuAcc", "CpuRef"], pins=PINS, backend_options=OPTIONS)
    assert made == []  # the support registry answered, no backend was made
    assert set(result.tags) == {layer.name for layer in result.graph.layers}
    assert len(result.partition_tags) > 10
    for tag, spec in result.partition_tags.items():
        layers = [lay for lay in result.graph.layers if result.tags[lay.name] == tag]
        assert layers and {lay.backend for lay in layers} == {spec.backend_id}
        assert result.layers_of(tag) == [lay.name for lay in layers]
    assert result.partition_tags["CpuAcc_0"] == DelegationSpec(
        "CpuAcc", (CompileSpec("CpuAcc.compile", "layers"),))
    assert result.partition_tags["CpuRef_1"] == DelegationSpec("CpuRef", ())
    hardswish = [lay for lay in result.graph.layers if lay.op_type == "HardSwish"]
    assert hardswish and all(result.tags[lay.name].startswith("CpuRef_") for lay in hardswish)
    _tag_graph_is_acyclic(result)
    assert len(graph.layers) == len(result.graph.layers) and graph.layers[0].backend is None


def test_the_report_carries_the_same_tags(graph: Graph) -> None:
    """The optimizer's report tags each layer with the partition that runs it (a fused layer's
    tag for the layers in it); with no layer moved by optimize_subgraph, partition's tags."""
    result = partition(graph, ["CpuAcc", "CpuRef"], pins=PINS, backend_options=OPTIONS)
    network = backplane.optimize(graph, ["CpuAcc", "CpuRef"], pins=PINS, backend_options=OPTIONS)
    report = network.report
    assert {p.name: p.tag for p in report.layers.values()} == result.tags
    assert report.delegations == result.partition_tags
    assert any(p.substituted_by for p in report.layers.values())  # fused layers are tagged too
    text = str(report)
    assert "tag" in text and "CpuRef_1" in text
    assert f"{len(report.delegations)} delegation tags" in text
    again = PlacementReport.from_dict(report.to_dict())
    assert again.delegations == report.delegations
    assert [p.tag for p in again.layers.values()] == [p.tag for p in report.layers.values()]


def test_control_flow_stays_untagged_and_bodies_are_tagged_under_their_path() -> None:
    model = Path(__file__).parents[1] / "data" / "corpus" / "cond_nested_dyn18.onnx"
    result = partition(model, ["CpuRef"])
    builtin = [lay for lay in result.graph.layers if lay.backend == "builtin"]
    assert builtin and all(lay.name not in result.tags for lay in builtin)
    network = backplane.optimize(import_onnx(model), ["CpuRef"])
    inner = [p for p in network.report.layers.values() if "/" in p.name and p.tag]
    assert inner and all(p.tag.rsplit("/", 1)[0] == p.name.rsplit("/", 1)[0] for p in inner)
    assert all(p.tag in network.report.delegations for p in network.report.layers.values()
               if p.tag)


def test_an_unknown_backend_or_option_is_named_with_the_known_ones(graph: Graph) -> None:
    with pytest.raises(OptimizationError, match="unknown backend 'CpuAc'.*did you mean 'CpuAcc'"):
        partition(graph, ["CpuAc"])
    with pytest.raises(OptionError, match="'CpuAcc.compyle': not an option of CpuAcc; its "
                                          "options are: CpuAcc.threads"):
        partition(graph, ["CpuAcc"], backend_options={"CpuAcc.compyle": "layers"})


def test_an_unavailable_backend_refuses_with_its_reason(graph: Graph) -> None:
    result = partition(graph, ["GpuAcc", "CpuRef"]) if not _cuda() else None
    if result is None:
        pytest.skip("a CUDA device is here: GpuAcc takes the layers")
    assert {spec.backend_id for spec in result.partition_tags.values()} == {"CpuRef"}
    first = next(iter(result.report.layers.values()))
    assert first.refusals and first.refusals[0][0] == "GpuAcc" and "CUDA" in first.refusals[0][1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_one_backend_is_one_tag_in_the_models_order() -> None:
    """The tagged graph keeps the model's topological order (the order tags are numbered in)."""
    result = partition(MODEL, ["CpuRef"])
    producers = {out: lay for lay in result.graph.layers for out in lay.outputs}
    assert topological_order(result.graph.layers, producers) == result.graph.layers
    assert list(result.partition_tags) == ["CpuRef_0"]


def test_the_reports_data_holds_any_option_value_as_json() -> None:
    """An option's value JSON has no type for is kept by its repr (an artifact stores the report
    as JSON; the options themselves are kept apart, as they are)."""
    report = PlacementReport(["CpuAcc"])
    report.delegations["CpuAcc_0"] = DelegationSpec("CpuAcc", (
        CompileSpec("CpuAcc.threads", 2), CompileSpec("CpuAcc.odd", {1, 2}),
        CompileSpec("CpuAcc.pair", (1, "a"))))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["delegations"]["CpuAcc_0"]["compile_specs"] == [
        ["CpuAcc.threads", 2], ["CpuAcc.odd", "{1, 2}"], ["CpuAcc.pair", [1, "a"]]]
