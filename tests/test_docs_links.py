"""The repository stands alone: every link in README.md and docs/*.md resolves inside it (a file or
folder of the repository, and the heading an anchor names); none leads outside."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INLINE = re.compile(r"(?<!\\)!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HTML = re.compile(r"<(?:a|img)\s[^>]*(?:href|src)=\"([^\"]+)\"", re.I)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def links(text: str) -> list[str]:
    prose = FENCE.sub("", text)  # code blocks hold code, not links
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return INLINE.findall(prose) + REFERENCE.findall(prose) + HTML.findall(prose)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for a Markdown file's headings."""
    found: set[str] = set()
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in found:
            slug, n = f"{base}-{n}", n + 1
        found.add(slug)
    return found


def problem(document: Path, target: str) -> str | None:
    """Why ``target``, linked from ``document``, does not resolve inside the repository."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
        return "leads outside the repository"
    path_part, _, anchor = target.partition("#")
    resolved = (document.parent / path_part).resolve() if path_part else document
    if resolved != ROOT and ROOT not in resolved.parents:
        return "leads outside the repository"
    if not resolved.exists():
        return "no such file or folder"
    if anchor and resolved.suffix == ".md" and anchor.lower() not in anchors(resolved):
        return f"no heading for #{anchor} in {resolved.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(document: Path) -> None:
    found = links(document.read_text(encoding="utf-8"))
    dead = [f"{target}: {why}" for target in found if (why := problem(document, target))]
    assert not dead, f"{document.relative_to(ROOT)}: {dead}"


def test_the_checker_finds_dead_and_outside_links() -> None:
    readme = ROOT / "README.md"
    text = ("[ok](docs/architecture.md) [gone](docs/nowhere.md) [up](../elsewhere.md) "
            "[web](https://example.org/x) [heading](docs/using.md#profiles) "
            "[no heading](docs/using.md#nothing-here) `[code](not/a/link.md)`\n"
            "```\n[fenced](not/a/link.md)\n```\n[ref]: docs/missing.md\n")
    found = links(text)
    assert found == ["docs/architecture.md", "docs/nowhere.md", "../elsewhere.md",
                     "https://example.org/x", "docs/using.md#profiles",
                     "docs/using.md#nothing-here", "docs/missing.md"]
    why = {target: problem(readme, target) for target in found}
    assert why["docs/architecture.md"] is None and why["docs/using.md#profiles"] is None
    assert why["docs/nowhere.md"] == why["docs/missing.md"] == "no such file or folder"
    assert why["../elsewhere.md"] == why["https://example.org/x"] == "leads outside the repository"
    assert why["docs/using.md#nothing-here"] == "no heading for #nothing-here in docs/using.md"


def test_the_documents_link_each_other() -> None:
    """README reaches every page of docs/ (a page no one links is a page no one reads)."""
    reached = {(ROOT / target.partition("#")[0]).resolve()
               for target in links((ROOT / "README.md").read_text(encoding="utf-8"))}
    for document in DOCUMENTS[1:]:
        reached |= {(document.parent / t.partition("#")[0]).resolve()
                    for t in links(document.read_text(encoding="utf-8")) if t.partition("#")[0]}
    assert set(DOCUMENTS[1:]) <= reached
