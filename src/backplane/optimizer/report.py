"""The placement report: where each layer went, who refused it and why, which copies were inserted."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from backplane.backends.api.backend import CompileSpec
from backplane.optimizer.partition import DelegationSpec

if TYPE_CHECKING:  # rich at the first rendering: a session's load renders nothing (import cost)
    from rich.console import Console
    from rich.table import Table


@dataclass
class LayerPlacement:
    name: str
    op_type: str
    backend: str
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (backend id, reason)
    pinned: str | None = None
    substituted_by: str | None = None  # the layer of a backend's substitution that now runs it
    tag: str | None = None
    """The delegation tag of the partition that runs it (``PlacementReport.delegations``); None
    for builtin's layers, which stay with the runtime."""
    note: str = ""
    """How builtin runs it, where it chose (an If decided by the model's inputs, ``decided.py``)."""


@dataclass
class CopyRecord:
    tensor: str
    source: str  # backend ids
    target: str
    strategy: str  # "copy", "import", "fallback_import"
    nbytes: int | None
    layer: str  # the inserted layer's name
    copied_bytes: int | None = None
    """The bytes a run copies on this edge: a copy's tensor, nothing for an import; for a fallback
    import, set at load: nothing where the producer writes its output in place, the tensor's where
    it cannot. None until known (and in reports written before it was kept)."""


@dataclass
class SubgraphRecord:
    backend: str
    layers: list[str]
    outcome: str  # "untouched", "substituted", "failed"


@dataclass
class MeasurementRecord:
    """One backend timed on one partition under measured placement (``optimizer/measured.py``)."""

    partition: str  # "first..last" layer
    backend: str
    ms: float | None  # None: not timed (``note`` says why)
    edge_ms: float | None  # the copies and imports to its neighbours' backends
    chosen: bool
    note: str = ""


@dataclass
class PlacementReport:
    """Every decision the optimizer made, as data: tests assert on it, the CLI prints it."""

    preferences: list[str]
    layers: dict[str, LayerPlacement] = field(default_factory=dict)
    copies: list[CopyRecord] = field(default_factory=list)
    subgraphs: list[SubgraphRecord] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # backend id -> reason
    warnings: list[str] = field(default_factory=list)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    """Per backend, the most bytes its intermediate tensors take at once in a run, as planned at
    load (each tensor dropped after its last reader; a copy's result counted in its target's
    memory, an import's not at all); tensors whose size is known only at run time are left out."""
    constant_bytes: dict[str, int] = field(default_factory=dict)
    """Per backend, the bytes of the constants it reads (a copy per kind of memory)."""
    partitions: list[str] = field(default_factory=list)
    """The backend of each partition a run goes through, in order (a partition: consecutive layers
    of one backend; copy and import layers between them do not count), set at load."""
    measurements: list[MeasurementRecord] = field(default_factory=list)
    """Under measured placement, each partition's time on each backend that takes it whole."""
    fallback_bytes: int = 0
    """The bytes of fallback memory the network holds (FallbackImport layers' buffers, allocated
    once at load and reused by every run), set at load."""
    versions: dict[str, PlacementReport] = field(default_factory=dict)
    """A network decided by its inputs (``optimizer/decided.py``): each version's own report, by
    its path ("/If/then_branch"); a run goes through the partitions of the one its predicate picks."""
    delegations: dict[str, DelegationSpec] = field(default_factory=dict)
    """Each delegation tag's backend and compile specs (ExecuTorch's partition_tags): a tag is one
    partition, the unit a backend's ``preprocess`` compiles (``optimizer/partition.py``)."""

    def crossings(self) -> dict[str, int]:
        """Tensors a run hands from one backend to another, by strategy ("copy", "import")."""
        found: dict[str, int] = {}
        for c in self.copies:
            if "user" not in (c.source, c.target):
                found[c.strategy] = found.get(c.strategy, 0) + 1
        return found

    def crossing_summary(self) -> str:
        """The tensors a run hands across memory, said the same way wherever the report is shown
        (``render``, ``backplane.placement_picture``'s page and drawing): those between backends
        by strategy, with the bytes copied, then the caller's inputs and outputs ("0 tensors
        copied and 18 imported between backends (0 bytes copied); to and from the caller: 2
        imported")."""
        between = self.crossings()
        fallback = between.get("fallback_import", 0)
        through = f" and {fallback} through fallback memory" if fallback else ""
        text = (f"{between.get('copy', 0)} tensors copied and {between.get('import', 0)} imported"
                f"{through} between backends ({self.bytes_copied():,} bytes copied)")
        caller: dict[str, int] = {}
        for c in self.copies:
            if "user" in (c.source, c.target):
                caller[c.strategy] = caller.get(c.strategy, 0) + 1
        words = {"copy": "copied", "import": "imported", "fallback_import": "through fallback memory"}
        if caller:
            text += "; to and from the caller: " + " and ".join(
                f"{n} {words.get(strategy, strategy)}" for strategy, n in caller.items())
        return text

    def bytes_copied(self) -> int:
        """The bytes a run copies from one backend to another (the user's tensors aside)."""
        total = 0
        for c in self.copies:
            if "user" not in (c.source, c.target):
                copied = c.copied_bytes
                if copied is None:
                    copied = (c.nbytes or 0) if c.strategy == "copy" else 0
                total += copied
        return total

    def fallbacks(self) -> dict[tuple[str, str, str], int]:
        """(op type, refusing backend, reason) -> how many layers it sent to a later backend."""
        found: dict[tuple[str, str, str], int] = {}
        for p in self.layers.values():
            for backend, reason in p.refusals:
                key = (p.op_type, backend, reason)
                found[key] = found.get(key, 0) + 1
        return found

    def fallback_summary(self) -> list[str]:
        """One line per (op type, backend, reason) with its count: what the log shows of the
        fallbacks (each layer's is in ``layers`` and ``warnings``)."""
        return [f"{count} layer{'s' if count > 1 else ''} of type {op_type} not supported on "
                f"{backend} (reason: {reason}), fell back to the next backend"
                for (op_type, backend, reason), count in self.fallbacks().items()]

    def backend_of(self, layer_name: str) -> str:
        return self.layers[layer_name].backend

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for placement in self.layers.values():
            counts[placement.backend] = counts.get(placement.backend, 0) + 1
        return counts

    def table(self) -> Table:
        """Layer names (paths, often) are never folded: the reasons fold instead."""
        rows = []
        for p in self.layers.values():
            refused = "; ".join(f"{b}: {r}" for b, r in p.refusals)
            backend = p.backend + (f" (in {p.substituted_by})" if p.substituted_by else "") \
                + (f": {p.note}" if p.note else "")
            rows.append((p.name, p.op_type, backend, p.tag or "", refused))
        return unfolded_table("Placement", ("layer", "op", "backend", "tag", "refused by (reason)"),
                              rows, folding=("backend", "refused by (reason)"))

    def copies_table(self) -> Table:
        def size(nbytes: int | None) -> str:
            return "?" if nbytes is None else f"{nbytes:,}"

        columns = ("tensor", "from", "to", "strategy", "bytes", "copied")
        rows = [(c.tensor, c.source, c.target, c.strategy, size(c.nbytes), size(c.copied_bytes))
                for c in self.copies]
        if any(c.strategy == "fallback_import" for c in self.copies):  # name the layer that does it
            columns += ("layer",)
            rows = [(*row, c.layer if c.strategy == "fallback_import" else "")
                    for row, c in zip(rows, self.copies)]
        return unfolded_table("Tensors crossing backends", columns, rows, folding=("layer",),
                              right=("bytes", "copied"))

    def measurements_table(self) -> Table:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        rows = [(m.partition, m.backend, ms(m.ms), ms(m.edge_ms), "yes" if m.chosen else "",
                 m.note) for m in self.measurements]
        return unfolded_table("Measured placement", ("partition", "backend", "ms", "edge ms",
                                                     "chosen", "note"), rows,
                              folding=("note",), right=("ms", "edge ms"))

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``backplane inspect --json``)."""
        return {"preferences": list(self.preferences),
                "counts": self.counts(),
                "layers": [{"name": p.name, "op_type": p.op_type, "backend": p.backend,
                            "refusals": [{"backend": b, "reason": r} for b, r in p.refusals],
                            "pinned": p.pinned, "substituted_by": p.substituted_by, "tag": p.tag,
                            "note": p.note}
                           for p in self.layers.values()],
                "delegations": {tag: {"backend_id": d.backend_id, "compile_specs":
                                      [[c.key, _plain(c.value)] for c in d.compile_specs]}
                                for tag, d in self.delegations.items()},
                "copies": [asdict(c) for c in self.copies],
                "subgraphs": [asdict(s) for s in self.subgraphs],
                "unavailable": dict(self.unavailable),
                "warnings": list(self.warnings),
                "peak_bytes": dict(self.peak_bytes), "constant_bytes": dict(self.constant_bytes),
                "partitions": list(self.partitions), "crossings": self.crossings(),
                "bytes_copied": self.bytes_copied(), "fallback_bytes": self.fallback_bytes,
                "measurements": [asdict(m) for m in self.measurements]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlacementReport:
        """The report ``to_dict`` wrote (an artifact keeps its network's report this way)."""
        report = cls(list(data["preferences"]), unavailable=dict(data["unavailable"]),
                     warnings=list(data["warnings"]))
        for p in data["layers"]:
            report.layers[p["name"]] = LayerPlacement(
                p["name"], p["op_type"], p["backend"],
                [(r["backend"], r["reason"]) for r in p["refusals"]], p["pinned"],
                p["substituted_by"], p.get("tag"), p.get("note", ""))
        report.copies = [CopyRecord(**c) for c in data["copies"]]
        report.subgraphs = [SubgraphRecord(**s) for s in data["subgraphs"]]
        report.peak_bytes = dict(data.get("peak_bytes", {}))
        report.constant_bytes = dict(data.get("constant_bytes", {}))
        report.partitions = list(data.get("partitions", []))
        report.fallback_bytes = int(data.get("fallback_bytes", 0))
        report.measurements = [MeasurementRecord(**m) for m in data.get("measurements", [])]
        report.delegations = {tag: DelegationSpec(d["backend_id"], tuple(
            CompileSpec(key, value) for key, value in d["compile_specs"]))
            for tag, d in data.get("delegations", {}).items()}
        return report

    def render(self, console: Console) -> None:
        """The tables, never cropped: a line wider than the console wraps at the terminal."""
        from rich.text import Text

        print_table(console, self.table())
        if self.copies:
            print_table(console, self.copies_table())
        if self.measurements:
            print_table(console, self.measurements_table())
        for backend, reason in self.unavailable.items():
            console.print(Text(f"backend {backend} unavailable: {reason}"))
        counts = ", ".join(f"{b}: {n}" for b, n in self.counts().items())
        console.print(f"{len(self.layers)} layers ({counts}); "
                      f"{len(self.subgraphs)} subgraphs; {len(self.delegations)} delegation tags")
        console.print(Text(self._run_line() + self.crossing_summary()))
        if self.peak_bytes:
            memory = ", ".join(f"{b}: {_mib(n)} peak + {_mib(self.constant_bytes.get(b, 0))} "
                               f"constants" for b, n in self.peak_bytes.items())
            fallback = f"; fallback memory {_mib(self.fallback_bytes)}" if self.fallback_bytes else ""
            console.print(f"memory planned ({memory}{fallback})")

    def _run_line(self) -> str:
        """"a run: 3 partitions (CpuAcc -> builtin -> CpuAcc), "; for a decided network, those of
        each version."""
        if self.versions:
            return "a run: one version's, " + "; ".join(
                f"{path}: {report._run_line()[len('a run: '):].rstrip(', ')}"
                for path, report in self.versions.items()) + "; "
        if not self.partitions:
            return ""
        return f"a run: {len(self.partitions)} partitions ({' -> '.join(_runs(self.partitions))}), "

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        self.render(Console(file=buffer, width=160, color_system=None))
        return buffer.getvalue()


def _plain(value: Any) -> Any:
    """An option's value as JSON holds it: its repr where JSON has no such type (the report
    describes; the artifact keeps the options themselves)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _runs(partitions: list[str], shown: int = 8) -> list[str]:
    """The partitions' backends, the middle elided past ``shown``."""
    if len(partitions) <= shown:
        return list(partitions)
    return [*partitions[:shown // 2], f"... {len(partitions) - shown} more ...",
            *partitions[-(shown // 2):]]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def unfolded_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]],
                   folding: tuple[str, ...] = (), right: tuple[str, ...] = ()) -> Table:
    """A table whose cells are plain text (no markup) and whose columns, but those in ``folding``,
    are never folded or cut: each is as wide as its widest cell, and a narrow console folds the
    ``folding`` columns instead (a path or a layer name stays whole, to copy and paste)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for index, column in enumerate(columns):
        widest = max([len(column), *(len(line) for row in rows for line in row[index].split("\n"))])
        justify = "right" if column in right else "left"
        if column in folding:
            table.add_column(column, overflow="fold", justify=justify)
        else:
            table.add_column(column, no_wrap=True, min_width=widest, justify=justify)
    for row in rows:
        table.add_row(*map(Text, row))
    return table


FOLDED_MIN = 16
"""The least width a folding column gets when a table needs more than the console has."""


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with its unfolded columns whole: where they need more than the console's
    width, the table is laid out wider (its lines wrap at the terminal, never inside a cell)."""
    need = 1 + 3 * len(table.columns)  # borders and padding
    for column in table.columns:
        need += (column.min_width or 0) if column.no_wrap else FOLDED_MIN
    if need <= console.width:
        console.print(table)
        return
    before = console._width  # print(width=...) cannot pass the console's width: widen it meanwhile
    console.width = need
    try:
        console.print(table, crop=False)
    finally:
        console._width = before
