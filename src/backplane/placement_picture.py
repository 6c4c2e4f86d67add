"""A picture of the placement: the model's layers coloured by backend, its partitions outlined, the
copies and imports between backends marked with their bytes, each refused layer with its reasons.

The picture is Graphviz's: ``dot_source`` writes the placement as DOT text (always; any Graphviz
tool or viewer opens it), and ``render_svg`` lays it out with Graphviz's ``dot`` program where it is
installed (``apt-get install graphviz``, ``brew install graphviz``; backplane needs no Python package
for it). ``html_page`` makes one self-contained page: the drawing inline as SVG (hover a layer for
its full name, backend and refusals), a legend, and tables of the refusals, the copies and imports and
the partitions. The page loads nothing and runs no script; without ``dot`` it holds the tables and the
DOT text, to draw elsewhere. ``backplane inspect MODEL --html FILE`` writes it.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from backplane.ir.graph import Graph, Layer
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.optimizer.report import CopyRecord, LayerPlacement, PlacementReport

USER = "user"
FILLS = ("#a0cbe8", "#ffbe7d", "#8cd17d", "#f1ce63", "#d4a6c8", "#86bcb6", "#fabfd2", "#d7b5a6",
         "#bab0ac", "#9d7660")
"""Light fills, one per backend in the order of preference (Tableau 10's light shades)."""
LINES = ("#4e79a7", "#f28e2b", "#59a14f", "#b6992d", "#b07aa1", "#499894", "#d37295", "#9d7660",
         "#79706e", "#5f4b3b")
BUILTIN_FILL, BUILTIN_LINE = "#e8e8e8", "#7f7f7f"
REFUSED = "#c0392b"
COPY_FILL, IMPORT_FILL = "#fff1a8", "#f7f7f7"
LABEL_CHARS = 38
DOT_TIMEOUT_S = 120


@dataclass
class _Node:
    id: str
    attrs: dict[str, str]


@dataclass
class _Cluster:
    label: str
    backend: str
    members: list[str] = field(default_factory=list)  # node ids


@dataclass
class Placement:
    """What the picture shows, as data: nodes, clusters (partitions), edges."""

    title: str
    backends: list[str]
    nodes: dict[str, _Node] = field(default_factory=dict)
    clusters: list[_Cluster] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(default_factory=list)

    def colours(self, backend: str) -> tuple[str, str]:
        if backend in self.backends:
            index = self.backends.index(backend) % len(FILLS)
            return FILLS[index], LINES[index]
        return BUILTIN_FILL, BUILTIN_LINE


def backends_of(report: PlacementReport) -> list[str]:
    """The backends to colour, in order of preference, then any other a layer went to."""
    order = list(dict.fromkeys([*report.preferences,
                                *(p.backend for p in report.layers.values())]))
    return [b for b in order if b not in report.unavailable or b in report.counts()]


def placement(network: OptimizedNetwork, source: Graph, title: str = "") -> Placement:
    """The model's layers (``source``: the graph as imported) as ``network`` placed them."""
    report = network.report
    picture = Placement(title or source.name or "model", backends_of(report))
    drawn = {p.name: p for p in report.layers.values()}
    ids: dict[str, str] = {}
    for layer in _ordered(source, drawn):
        ids[layer] = f"L{len(ids)}"
        picture.nodes[ids[layer]] = _layer_node(ids[layer], drawn[layer], picture)
    for name in source.inputs:
        ids[f"in:{name}"] = f"I{len(picture.nodes)}"
        picture.nodes[ids[f"in:{name}"]] = _Node(ids[f"in:{name}"], {
            "label": f"{name}\n{source.info(name)}", "shape": "ellipse", "style": "filled",
            "fillcolor": "white", "tooltip": f"input {name}: {source.info(name)}"})
    for name in source.outputs:
        ids[f"out:{name}"] = f"O{len(picture.nodes)}"
        picture.nodes[ids[f"out:{name}"]] = _Node(ids[f"out:{name}"], {
            "label": f"{name}\n{source.info(name)}", "shape": "ellipse", "style": "filled",
            "fillcolor": "white", "tooltip": f"output {name}: {source.info(name)}"})
    _clusters(network, ids, picture)
    _edges(source, report, drawn, ids, picture)
    return picture


def _ordered(source: Graph, drawn: dict[str, LayerPlacement]) -> list[str]:
    """The placed layers in the model's order; those the model does not name (made by a pass) last."""
    order = [layer.name for layer in source.layers if layer.name in drawn]
    return order + [name for name in drawn if name not in set(order)]


def _short(text: str, chars: int = LABEL_CHARS) -> str:
    return text if len(text) <= chars else "…" + text[-(chars - 1):]


def _layer_node(node_id: str, p: LayerPlacement, picture: Placement) -> _Node:
    fill, line = picture.colours(p.backend)
    label = [p.op_type, _short(p.name)]
    tooltip = [f"{p.name} ({p.op_type}) on {p.backend}"]
    if p.substituted_by:
        tooltip.append(f"runs inside {p.substituted_by}")
    if p.pinned:
        label.append(f"pinned to {p.pinned}")
        tooltip.append(f"pinned to {p.pinned}")
    for backend, reason in p.refusals:
        label.append(f"refused by {backend}:")
        label += textwrap.wrap(reason, 2 * LABEL_CHARS, max_lines=3, placeholder=" …")
        tooltip.append(f"refused by {backend}: {reason}")
    attrs = {"label": "\n".join(label), "fillcolor": fill, "color": line,
             "tooltip": "\n".join(tooltip), "class": f"layer backend-{_css(p.backend)}"}
    if p.refusals:
        attrs.update({"color": REFUSED, "penwidth": "2.5", "class": attrs["class"] + " refused"})
    return _Node(node_id, attrs)


def _css(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def _clusters(network: OptimizedNetwork, ids: dict[str, str], picture: Placement) -> None:
    """A cluster per subgraph a backend was given (SubgraphRecord): what a substitution runs as one
    layer (OneDnnGraph, FusedConv, Specialized, a CUDA graph), or the layers it kept as they were."""
    report = network.report
    op_of = {layer.name: layer.op_type for layer in network.graph.layers}
    taken: set[str] = set()
    for record in report.subgraphs:
        if record.outcome == "substituted":
            replaced = set(record.layers)
            members = [p.name for p in report.layers.values() if p.substituted_by in replaced
                       or (p.name in replaced and p.substituted_by is None)]  # same name: a
            # layer rewritten in place (a Gemm become CpuAcc's Linear) is its own substitution
            kinds = sorted({op_of.get(name, "substitution") for name in record.layers})
            what = f"{' + '.join(kinds)} ({_n(len(members), 'model layer')})"
        elif record.outcome == "untouched":
            members = [n for n in record.layers if n in report.layers
                       and report.layers[n].substituted_by is None]
            what = f"{len(members)} layer{'s' if len(members) != 1 else ''}, not rewritten"
        else:
            continue
        members = [m for m in members if m in ids and m not in taken]
        if not members:
            continue
        taken.update(members)
        picture.clusters.append(_Cluster(f"{record.backend}: {what}", record.backend,
                                         [ids[m] for m in members]))


def _edges(source: Graph, report: PlacementReport, drawn: dict[str, LayerPlacement],
           ids: dict[str, str], picture: Placement) -> None:
    producers = source.producers()
    memo: dict[str, list[tuple[str, str]]] = {}

    def origins(tensor: str, seen: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """(drawn producer's key, the tensor it writes) behind ``tensor``: through layers that are
        not drawn (an Identity removed, a folded layer) to the layers or inputs before them."""
        if tensor in memo:
            return memo[tensor]
        if tensor in source.inputs:
            found = [(f"in:{tensor}", tensor)]
        elif tensor in source.constants or tensor not in producers or tensor in seen:
            found = []
        else:
            layer = producers[tensor]
            if layer.name in drawn:
                found = [(layer.name, tensor)]
            else:
                found = [o for name in layer.inputs if name
                         for o in origins(name, seen | {tensor})]
        memo[tensor] = found
        return found

    def backend(key: str) -> str:
        return USER if key.startswith(("in:", "out:")) else drawn[key].backend

    copy_nodes: dict[int, str] = {}
    edges: dict[tuple[str, str], None] = {}

    def connect(producer: str, tensor: str, consumer: str) -> None:
        record = _crossing(report.copies, tensor, backend(producer), backend(consumer))
        if record is None:
            edges[ids[producer], ids[consumer]] = None
            return
        node = _copy_node(record, copy_nodes, picture)
        edges[ids[producer], node] = None
        edges[node, ids[consumer]] = None

    for layer in source.layers:
        if layer.name not in drawn:
            continue
        for name in _reads(layer):
            for producer, tensor in origins(name):
                connect(producer, tensor, layer.name)
    for name in source.outputs:
        for producer, tensor in origins(name):
            connect(producer, tensor, f"out:{name}")
    for record in report.copies:  # copies the model's edges do not show (inside a body, say)
        if id(record) not in copy_nodes:
            node = _copy_node(record, copy_nodes, picture)
            for producer, _ in origins(record.tensor):
                edges[ids[producer], node] = None
    picture.edges = list(edges)


def _reads(layer: Layer) -> Iterable[str]:
    return dict.fromkeys(n for n in layer.inputs if n)


def _crossing(copies: Sequence[CopyRecord], tensor: str, source: str,
              target: str) -> CopyRecord | None:
    """The copy or import a tensor takes from ``source`` to ``target``: the one made for that
    target, else one made for another target with the same memory (shared, as the optimizer does)."""
    if source == target:
        return None
    mine = [c for c in copies if c.tensor == tensor and c.source == source]
    exact = [c for c in mine if c.target == target]
    return (exact or mine or [None])[0]


def _copy_node(record: CopyRecord, made: dict[int, str], picture: Placement) -> str:
    """The node of a copy or import (one per record, however many readers it has)."""
    if id(record) in made:
        return made[id(record)]
    node_id = f"C{len(picture.nodes)}"
    made[id(record)] = node_id
    size = "? bytes" if record.nbytes is None else f"{record.nbytes:,} B"
    kind = "import (zero-copy)" if record.strategy == "import" else record.strategy
    zero_copy = record.strategy == "import"
    if record.strategy == "fallback_import":  # through memory both import, written in place or not
        zero_copy = record.copied_bytes == 0
        kind = "fallback import" + (" (zero-copy)" if zero_copy else " (one copy)"
                                    if record.copied_bytes else "")
    picture.nodes[node_id] = _Node(node_id, {
        "label": f"{kind}\n{record.source} → {record.target}\n{size}",
        "shape": "box", "style": "rounded,filled" + (",dashed" if zero_copy else ",bold"),
        "fillcolor": IMPORT_FILL if zero_copy else COPY_FILL,
        "color": BUILTIN_LINE, "fontsize": "9",
        "tooltip": f"{record.layer}: {record.tensor}, {size}",
        "class": f"crossing {record.strategy}"})
    return node_id


# -- DOT ---------------------------------------------------------------------------------------------------
def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(attrs: dict[str, str]) -> str:
    return ", ".join(f"{key}={_quote(value)}" for key, value in attrs.items())


def dot_source(network: OptimizedNetwork, source: Graph, title: str = "") -> str:
    """The placement as Graphviz DOT text."""
    return to_dot(placement(network, source, title), network.report)


def _n(count: int, one: str, many: str | None = None) -> str:
    """``1 partition``, ``3 partitions``, ``0 copies``."""
    return f"{count} {one if count == 1 else many or one + 's'}"


def crossing_summary(report: PlacementReport) -> str:
    """``report.crossing_summary()``: the crossings in the report's words."""
    return report.crossing_summary()


def summary(report: PlacementReport) -> str:
    """The placement in one line: layers per backend, a run's partitions and its crossings
    (``crossing_summary``)."""
    counts = ", ".join(f"{b}: {n}" for b, n in report.counts().items())
    run = (f"a run: {_n(len(report.partitions), 'partition')}, " if report.partitions else "")
    return f"{_n(len(report.layers), 'layer')} ({counts}); {run}{crossing_summary(report)}"


def to_dot(picture: Placement, report: PlacementReport) -> str:
    label = f"{picture.title}: {summary(report)}"
    lines = ["digraph placement {",
             f"  graph [{_attrs({'rankdir': 'TB', 'fontname': 'Helvetica', 'fontsize': '14', 'labelloc': 't', 'label': label, 'nodesep': '0.25', 'ranksep': '0.3'})}];",
             f"  node [{_attrs({'shape': 'box', 'style': 'rounded,filled', 'fontname': 'Helvetica', 'fontsize': '10', 'penwidth': '1.2'})}];",
             f"  edge [{_attrs({'color': '#555555', 'arrowsize': '0.6'})}];"]
    clustered = set()
    for index, cluster in enumerate(picture.clusters):
        _, line = picture.colours(cluster.backend)
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f"    graph [{_attrs({'label': cluster.label, 'style': 'rounded,bold', 'color': line, 'fontcolor': line, 'fontsize': '11', 'penwidth': '2'})}];")
        for member in cluster.members:
            node = picture.nodes[member]
            lines.append(f"    {node.id} [{_attrs(node.attrs)}];")
            clustered.add(member)
        lines.append("  }")
    for node in picture.nodes.values():
        if node.id not in clustered:
            lines.append(f"  {node.id} [{_attrs(node.attrs)}];")
    for tail, head in picture.edges:
        lines.append(f"  {tail} -> {head};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_program() -> str | None:
    """Graphviz's dot, where it is installed."""
    return shutil.which("dot")


def render_svg(dot: str) -> str | None:
    """The DOT text laid out by Graphviz as SVG, or None where dot is not installed."""
    program = dot_program()
    if program is None:
        return None
    done = subprocess.run([program, "-Tsvg"], input=dot.encode(), capture_output=True,
                          timeout=DOT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"Graphviz's dot failed ({done.returncode}): "
                           f"{done.stderr.decode(errors='replace').strip()[:500]}")
    svg = done.stdout.decode()
    return svg[svg.index("<svg"):]  # the XML prolog and DOCTYPE do not belong inside HTML


# -- HTML --------------------------------------------------------------------------------------------------
STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
.summary { color: #444; margin-top: 0; }
.legend span { display: inline-block; margin: 0 1.2em 0.4em 0; }
.swatch { display: inline-block; width: 1.1em; height: 0.9em; vertical-align: middle;
          border: 2px solid; border-radius: 3px; margin-right: 0.35em; }
.drawing { overflow: auto; border: 1px solid #ddd; max-height: 85vh; background: white; }
.drawing svg { max-width: none; height: auto; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; }
td code, pre { font-size: 0.9em; } pre { background: #f7f7f7; padding: 0.8em; overflow: auto; }
.note { background: #fff6d6; border: 1px solid #e6d28c; padding: 0.6em 0.8em; }
"""


def html_page(network: OptimizedNetwork, source: Graph, title: str = "",
              svg: str | None | bool = True) -> str:
    """The page: ``svg`` True draws with Graphviz where it is installed; a str is a drawing made
    already; False or None leaves the drawing out (the tables and the DOT text remain)."""
    picture = placement(network, source, title)
    dot = to_dot(picture, network.report)
    drawing = render_svg(dot) if svg is True else (svg or None)
    return _page(picture, network.report, dot, drawing)


def write_html(path: str | os.PathLike, network: OptimizedNetwork, source: Graph,
               title: str = "") -> bool:
    """Write the page to ``path``; True where it holds the drawing (Graphviz's dot was found)."""
    page = html_page(network, source, title)
    with open(path, "w", encoding="utf-8") as out:
        out.write(page)
    return "<svg" in page


NAMED = 8
"""The layers a refusal's banner names; the table below the drawing has them all."""


def banners(report: PlacementReport) -> list[str]:
    """The page's notes, as HTML: each unavailable backend; each refusal, once per (backend,
    reason) with the layers it sent elsewhere named; then the report's other warnings. A layer's
    own fallback warning and a backend's unavailability are in the report's warnings too, in the
    optimizer's words: they are said once, here, by the layers and backends themselves."""
    e = html.escape
    notes = [f"backend {e(b)} unavailable: {e(reason)}" for b, reason in report.unavailable.items()]
    said = {f"backend {b} is not available: {reason}" for b, reason in report.unavailable.items()}
    refused: dict[tuple[str, str], list[LayerPlacement]] = {}
    for p in report.layers.values():
        for backend, reason in p.refusals:
            refused.setdefault((backend, reason), []).append(p)
            said.add(f"Layer of type {p.op_type} is not supported on requested backend {backend} "
                     f"(reason: {reason}), falling back to the next backend")
    for (backend, reason), layers in refused.items():
        names = ", ".join(f"<code>{e(p.name)}</code> ({e(p.op_type)}, on {e(p.backend)})"
                          for p in layers[:NAMED])
        more = f" and {len(layers) - NAMED} more" if len(layers) > NAMED else ""
        notes.append(f"{e(backend)} refused {_n(len(layers), 'layer')}: {names}{more}. "
                     f"Reason: {e(reason)}")
    notes += [e(warning) for warning in dict.fromkeys(report.warnings) if warning not in said]
    return notes


def _page(picture: Placement, report: PlacementReport, dot: str, svg: str | None) -> str:
    e = html.escape
    counts = report.counts()
    refused = [p for p in report.layers.values() if p.refusals]
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>placement: {e(picture.title)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{e(picture.title)}: placement on {e(', '.join(report.preferences))}</h1>",
             f'<p class="summary">{e(summary(report))}; '
             f"{_n(len(refused), 'layer')} refused by a backend</p>",
             '<div class="legend">']
    for backend in picture.backends:
        fill, line = picture.colours(backend)
        parts.append(f'<span><i class="swatch" style="background:{fill};border-color:{line}"></i>'
                     f"{e(backend)} ({counts.get(backend, 0)} layers)</span>")
    parts.append(f'<span><i class="swatch" style="background:white;border-color:{REFUSED}"></i>'
                 "red border: refused by a backend before it</span>")
    parts.append(f'<span><i class="swatch" style="background:{IMPORT_FILL};border-style:dashed;'
                 f'border-color:{BUILTIN_LINE}"></i>import (zero-copy)</span>')
    parts.append(f'<span><i class="swatch" style="background:{COPY_FILL};border-color:'
                 f'{BUILTIN_LINE}"></i>copy</span>')
    parts.append("<span>outlined: a partition (what one backend was given as one subgraph)</span>")
    parts.append("</div>")
    parts += [f'<p class="note">{note}</p>' for note in banners(report)]
    if svg is not None:
        parts.append(f'<div class="drawing">{svg}</div>')
    else:
        parts.append('<p class="note">Graphviz\'s <code>dot</code> was not found, so the graph is '
                     "not drawn here: install Graphviz (<code>apt-get install graphviz</code>) and "
                     "write the page again, or draw the DOT text below with any Graphviz tool.</p>")
    parts.append(f"<h2>Refused layers ({len(refused)})</h2>")
    if refused:
        parts.append("<table><tr><th>layer</th><th>op</th><th>runs on</th><th>refused by</th>"
                     "<th>reason</th></tr>")
        for p in refused:
            for backend, reason in p.refusals:
                parts.append(f"<tr><td><code>{e(p.name)}</code></td><td>{e(p.op_type)}</td>"
                             f"<td>{e(p.backend)}</td><td>{e(backend)}</td><td>{e(reason)}</td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>No backend refused a layer.</p>")
    parts.append(f"<h2>Tensors crossing memory ({len(report.copies)})</h2>")
    parts.append(f"<p>{e(crossing_summary(report))}</p>")
    if report.copies:
        parts.append("<table><tr><th>tensor</th><th>from</th><th>to</th><th>how</th>"
                     "<th>bytes</th></tr>")
        for c in report.copies:
            size = "?" if c.nbytes is None else f"{c.nbytes:,}"
            parts.append(f"<tr><td><code>{e(c.tensor)}</code></td><td>{e(c.source)}</td>"
                         f"<td>{e(c.target)}</td><td>{e(c.strategy)}</td>"
                         f'<td class="num">{size}</td></tr>')
        parts.append("</table>")
    parts.append(f"<h2>Partitions ({len(picture.clusters)})</h2><table><tr><th>#</th>"
                 "<th>partition</th><th>layers</th></tr>")
    for index, cluster in enumerate(picture.clusters):
        parts.append(f'<tr><td class="num">{index}</td><td>{e(cluster.label)}</td>'
                     f'<td class="num">{len(cluster.members)}</td></tr>')
    parts.append("</table>")
    parts.append(f"<details><summary>Graphviz DOT text</summary><pre>{e(dot)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
