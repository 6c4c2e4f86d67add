"""What ``optimize_subgraph`` returns: substitutions, failed and untouched subgraphs (OptimizationViews)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backplane.ir.graph import Layer, SubgraphView


@dataclass
class Substitution:
    """Replace the layers of ``substitutable`` by ``replacement``: the same boundary tensors in and out."""

    substitutable: SubgraphView
    replacement: list[Layer]


@dataclass
class OptimizationViews:
    substitutions: list[Substitution] = field(default_factory=list)
    failed: list[SubgraphView] = field(default_factory=list)
    untouched: list[SubgraphView] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    """Layer name -> why it failed (the refusal the placement report shows for a failed layer)."""

    def validate(self, view: SubgraphView, backend_id: str) -> None:
        """Together the three lists must cover exactly the view's layers, each once."""
        parts = [s.substitutable for s in self.substitutions] + self.failed + self.untouched
        covered = [id(layer) for part in parts for layer in part.layers]
        expected = {id(layer) for layer in view.layers}
        duplicated = len(covered) != len(set(covered))
        if duplicated or set(covered) != expected:
            names = {id(lay): lay.name for part in parts for lay in part.layers}
            names.update({id(lay): lay.name for lay in view.layers})
            missing = sorted(names[i] for i in expected - set(covered))
            extra = sorted(names[i] for i in set(covered) - expected)
            raise ValueError(
                f"{backend_id}.optimize_subgraph returned views that do not cover its subgraph "
                f"exactly once: missing {missing}, foreign {extra}, duplicated={duplicated}")
        for sub in self.substitutions:
            produced = {o for layer in sub.replacement for o in layer.outputs}
            lost = [o for o in sub.substitutable.outputs if o not in produced]
            if lost:
                raise ValueError(f"{backend_id}.optimize_subgraph: the replacement does not produce "
                                 f"{lost}, which the rest of the graph reads")
