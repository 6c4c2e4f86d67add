"""The placement report: where each layer went, who refused it and why, which copies were inserted."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table
from rich.text import Text


@dataclass
class LayerPlacement:
    name: str
    op_type: str
    backend: str
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (backend id, reason)
    pinned: str | None = None
    substituted_by: str | None = None  # the layer of a backend's substitution that now runs it


@dataclass
class CopyRecord:
    tensor: str
    source: str  # backend ids
    target: str
    strategy: str
    nbytes: int | None
    layer: str  # the inserted layer's name


@dataclass
class SubgraphRecord:
    backend: str
    layers: list[str]
    outcome: str  # "untouched", "substituted", "failed"


@dataclass
class PlacementReport:
    """Every decision the optimizer made, as data: tests assert on it, the CLI prints it."""

    preferences: list[str]
    layers: dict[str, LayerPlacement] = field(default_factory=dict)
    copies: list[CopyRecord] = field(default_factory=list)
    subgraphs: list[SubgraphRecord] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # backend id -> reason
    warnings: list[str] = field(default_factory=list)

    def backend_of(self, layer_name: str) -> str:
        return self.layers[layer_name].backend

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for placement in self.layers.values():
            counts[placement.backend] = counts.get(placement.backend, 0) + 1
        return counts

    def table(self) -> Table:
        table = Table(title="Placement", show_lines=False)
        for column in ("layer", "op", "backend", "refused by (reason)"):
            table.add_column(column, overflow="fold")
        for p in self.layers.values():
            refused = "; ".join(f"{b}: {r}" for b, r in p.refusals)
            backend = p.backend + (f" (in {p.substituted_by})" if p.substituted_by else "")
            table.add_row(*map(Text, (p.name, p.op_type, backend, refused)))
        return table

    def copies_table(self) -> Table:
        table = Table(title="Tensors crossing backends")
        for column in ("tensor", "from", "to", "strategy", "bytes"):
            table.add_column(column)
        for c in self.copies:
            size = "?" if c.nbytes is None else f"{c.nbytes:,}"
            table.add_row(*map(Text, (c.tensor, c.source, c.target, c.strategy, size)))
        return table

    def render(self, console: Console) -> None:
        console.print(self.table())
        if self.copies:
            console.print(self.copies_table())
        for backend, reason in self.unavailable.items():
            console.print(Text(f"backend {backend} unavailable: {reason}"))
        counts = ", ".join(f"{b}: {n}" for b, n in self.counts().items())
        console.print(f"{len(self.layers)} layers ({counts}); {len(self.copies)} copies; "
                      f"{len(self.subgraphs)} subgraphs")

    def __str__(self) -> str:
        buffer = io.StringIO()
        self.render(Console(file=buffer, width=160, color_system=None))
        return buffer.getvalue()
