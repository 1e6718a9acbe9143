"""The README and ``docs/`` link only to what exists, and code cites DESIGN.md sections that exist.

Every relative link of ``README.md`` and ``docs/*.md`` (inline links and images, outside code)
must name a file or directory of the repository, and a ``#fragment`` must name a heading of
the target, slugged as GitHub slugs it. Every ``DESIGN.md, "Section"`` a module of the package
cites must be a heading of ``docs/DESIGN.md``. Pure: reads text files, imports nothing of
plimsoll, starts nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure


def _repo() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / ".importlinter").is_file() and (parent / "README.md").is_file():
            return parent
    raise RuntimeError(f"no repository root above {here}")


REPO = _repo()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
_CITATION = re.compile(r"DESIGN\.md\)?[,:]?\s+(?:section\s+)?[\"“]([^\"”\n]+)[\"”]")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (links there are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (word
    characters, hyphens and spaces kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text(encoding="utf-8")))


def broken(page: Path) -> list[str]:
    """What is wrong with each relative link of ``page`` ([] when every one resolves)."""
    out = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif REPO not in dest.parents and dest != REPO:
            out.append(f"{target}: outside the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            out.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO)}")
    return out


def test_the_pages_exist():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/DESIGN.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_every_docs_page_is_reachable_from_the_readme_or_the_index():
    linked = set()
    for page in (REPO / "README.md", REPO / "docs" / "README.md"):
        for target in links(page):
            path = target.partition("#")[0]
            if path:
                linked.add((page.parent / path).resolve())
    orphans = [p.relative_to(REPO).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert orphans == []


def test_code_cites_only_design_sections_that_exist():
    headings = {slug(h) for _, h in _HEADING.findall(
        _FENCE.sub("", (REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8")))}
    missing = []
    for module in sorted((REPO / "python" / "plimsoll").rglob("*.py")):
        for section in _CITATION.findall(module.read_text(encoding="utf-8")):
            if slug(section) not in headings:
                missing.append(f"{module.relative_to(REPO)}: DESIGN.md, \"{section}\"")
    assert missing == []


def test_the_checker_catches_what_it_exists_for(tmp_path, monkeypatch):
    """A link to a missing file, a missing heading, and a link in code (ignored)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A page\n\n## The `u` band, again\n")
    page = docs / "b.md"
    page.write_text("[ok](a.md#the-u-band-again) [gone](nope.md) [bad](a.md#nowhere)\n"
                    "`[code](nope.md)`\n```\n[fenced](nope.md)\n```\n[web](https://x.invalid/y)\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert broken(page) == ["nope.md: no such file",
                            "a.md#nowhere: no heading #nowhere in docs/a.md"]
    assert slug("`plimsoll launch` and `plimsoll worker`: one model") == \
        "plimsoll-launch-and-plimsoll-worker-one-model"
