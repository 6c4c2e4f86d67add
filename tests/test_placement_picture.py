"""The picture of a placement: DOT text (always), drawn by Graphviz's dot into a self-contained page
where dot is installed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backplane import InferenceSession
from backplane import placement_picture as picture
from tests.conftest import small_cnn_model

MOBILENET = Path(__file__).parent / "data" / "tiny_mobilenet_v3.onnx"
needs_dot = pytest.mark.skipif(picture.dot_program() is None, reason="Graphviz's dot not installed")


def nodes(dot: str) -> dict[str, str]:
    """node id -> its attribute text."""
    return dict(re.findall(r"^\s+([A-Z]\d+) \[(.*)\];$", dot, re.M))


def edges(dot: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s+([A-Z]\d+) -> ([A-Z]\d+);$", dot, re.M))


@pytest.fixture
def split_session(partial_backends) -> InferenceSession:
    """small_cnn on TestPrivate (memory of its own: copies) and CpuRef: pool, flatten and softmax
    refused by TestPrivate."""
    return InferenceSession(small_cnn_model().SerializeToString(), ["TestPrivate", "CpuRef"])


def test_layers_are_coloured_by_backend_and_refusals_carry_their_reasons(split_session) -> None:
    dot = picture.dot_source(split_session.optimized, split_session.graph, "cnn")
    found = nodes(dot)
    by_name = {re.search(r'label="[^"\\]*\\n([^"\\]*)', attrs).group(1): attrs
               for attrs in found.values() if "class=\"layer" in attrs}
    assert set(by_name) == {"conv1", "relu1", "conv2", "skip", "relu2", "pool", "flatten", "fc",
                            "softmax"}
    private_fill, ref_fill = picture.FILLS[0], picture.FILLS[1]
    assert f'fillcolor="{private_fill}"' in by_name["conv1"]
    assert f'fillcolor="{ref_fill}"' in by_name["pool"]
    assert f'color="{picture.REFUSED}"' in by_name["pool"]
    assert "refused by TestPrivate:\\nGlobalAveragePool is not one of Conv" in by_name["pool"]
    assert picture.REFUSED not in by_name["conv1"] and "refused" not in by_name["conv1"]


def test_copies_are_nodes_with_their_bytes_on_the_edges_that_cross(split_session) -> None:
    dot = picture.dot_source(split_session.optimized, split_session.graph, "cnn")
    found = nodes(dot)
    copies = {i: a for i, a in found.items() if 'class="crossing copy"' in a}
    assert len(copies) == len(split_session.report.copies) == 4
    into = [i for i, a in copies.items() if "user → TestPrivate\\n768 B" in a]
    assert len(into) == 1  # the input, 1x3x8x8 float32, copied into TestPrivate's memory
    inputs = [i for i, a in found.items() if a.startswith('label="x\\n')]
    conv1 = [i for i, a in found.items() if "\\nconv1" in a]
    assert (inputs[0], into[0]) in edges(dot) and (into[0], conv1[0]) in edges(dot)
    assert (inputs[0], conv1[0]) not in edges(dot)  # the crossing goes through its copy


def test_partitions_are_clusters(split_session) -> None:
    dot = picture.dot_source(split_session.optimized, split_session.graph, "cnn")
    clusters = re.findall(r'subgraph cluster_\d+ \{\n\s+graph \[label="([^"]*)"', dot)
    assert len(clusters) == len([s for s in split_session.report.subgraphs
                                 if s.outcome != "failed"])
    assert any(label.startswith("TestPrivate: ") for label in clusters)
    assert any(label.startswith("CpuRef: ") for label in clusters)


def test_the_page_holds_no_script_and_the_tables_without_dot(split_session) -> None:
    page = picture.html_page(split_session.optimized, split_session.graph, "cnn", svg=False)
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "Graphviz's <code>dot</code> was not found" in page
    assert "GlobalAveragePool is not one of" in page and "768" in page
    assert "digraph placement" in page  # the DOT text, to draw elsewhere


@needs_dot
def test_a_real_model_drawn_into_one_page(tmp_path) -> None:
    pytest.importorskip("torch")
    session = InferenceSession(str(MOBILENET), backends=[
        ("CpuAcc", {"compile": "layers", "conv_route": "onednn", "linear_route": "mkl"}), "CpuRef"],
        pins={"HardSigmoid": "CpuRef"})
    path = tmp_path / "placement.html"
    assert picture.write_html(path, session.optimized, session.graph, "tiny_mobilenet_v3")
    page = path.read_text()
    assert page.count("<svg") == 1 and "<script" not in page
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page
    svg = page[page.index("<svg"):page.index("</svg>")]
    assert svg.count('class="node layer') == len(session.report.layers) == 119
    assert svg.count('class="node crossing import"') == len(session.report.copies) == 20
    assert svg.count('class="cluster"') == 19  # CpuAcc's and CpuRef's partitions, alternating
    assert "49,152 B" in svg and "CpuRef: 1 layer, not rewritten" in svg
