"""docs/architecture.md's table of the seeds' rules: every test it names exists and quotes the
seed's sentence in its docstring; where the seed documents are at hand, the sentence is theirs."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "architecture.md"
SEEDS = ROOT.parent / "shared" / "seeds"
HEADING = "## The seeds' rules"
STATUSES = ("done", "deviation: ", "not done: ")


@dataclass(frozen=True)
class Rule:
    seed: str
    rule: str
    quote: str
    status: str
    test: str  # "path::function", or "" where none checks it (not done)


def rules() -> list[Rule]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(HEADING)
    section = text[start:text.find("\n## ", start + 1)]
    found = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 5 or cells[0] in ("seed", "---"):
            continue
        seed, rule, quote, status, test = cells
        assert quote.startswith('"') and quote.endswith('"'), f"unquoted sentence: {line}"
        found.append(Rule(seed, rule, quote[1:-1], status, test.strip("`").replace("—", "")))
    return found


def pieces(quote: str) -> list[str]:
    """The quote's pieces ("..." joins pieces of one passage), without any whitespace: line breaks
    fall anywhere in a docstring or a seed."""
    return [re.sub(r"\s+", "", piece) for piece in quote.split("...") if piece.strip()]


def docstring(test: str) -> str:
    path, _, name = test.partition("::")
    file = ROOT / path
    assert file.is_file(), f"{path} (named by the rules table) does not exist"
    tree = ast.parse(file.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_docstring(node) or ""
    raise AssertionError(f"{path} has no test {name} (named by the rules table)")


def test_the_table_lists_the_issues_rules_each_with_a_status() -> None:
    table = rules()
    assert len(table) >= 25
    assert {r.seed for r in table} == {"000", "001", "002", "003", "004"}
    for rule in table:
        assert rule.status.startswith(STATUSES), f"{rule.rule}: status {rule.status!r}"
        assert rule.test or rule.status.startswith("not done: "), f"{rule.rule}: no test"


@pytest.mark.parametrize("rule", [r for r in rules() if r.test], ids=lambda r: r.test)
def test_every_test_the_table_names_exists_and_quotes_the_seed(rule: Rule) -> None:
    text = re.sub(r"\s+", "", docstring(rule.test))
    missing = [p for p in pieces(rule.quote) if p not in text]
    assert not missing, f"{rule.test}'s docstring does not quote the seed: {rule.quote!r}"


def test_every_quote_is_the_seeds() -> None:
    if not SEEDS.is_dir():
        pytest.skip(f"the seed documents are not at {SEEDS}")
    seeds = {}
    for path in SEEDS.glob("0*.txt"):  # 000 numbers its lines: their numbers are not the text
        text = re.sub(r"(?m)^\d+", "", path.read_text(encoding="utf-8"))
        seeds[path.name[:3]] = re.sub(r"\s+", "", text)
    for rule in rules():
        missing = [p for p in pieces(rule.quote) if p not in seeds[rule.seed]]
        assert not missing, f"seed {rule.seed} has no {rule.quote!r}"
