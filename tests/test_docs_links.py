"""The documentation's links hold: every relative link of README.md and docs/*.md names a file
that exists, every `#anchor` names a heading of its page (GitHub's heading-slug rule), no page
under docs/ links to a file outside the repository, and the docs index, docs/README.md, links
every page under docs/."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
"""The pages whose links must resolve: the README and the reference pages."""
ALL_DOCS = sorted(DOCS.rglob("*.md"))
"""Every Markdown page under docs/, run summaries included."""

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(path: Path) -> str:
    """The page without its fenced code blocks and code spans, where `](...)` is no link."""
    return CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))


def links(path: Path) -> list[str]:
    """The targets of the page's inline links and images, web addresses left out."""
    return [target for target in LINK.findall(prose(path)) if not SCHEME.match(target)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (links reduced to their text,
    emphasis and code marks dropped), lowercased, every character but letters, marks, digits,
    `_`, `-` and spaces removed, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = "".join(char for char in text if char in " -_" or unicodedata.category(char)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets `-1`, `-2`, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def resolve(page: Path, target: str) -> tuple[Path, str]:
    """The file a link points to (the page itself for `#anchor`) and its anchor, if any."""
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


def test_slug_follows_github():
    assert slug("Two commands (fresh Debian machine, as root)") == (
        "two-commands-fresh-debian-machine-as-root"
    )
    assert slug("10. The decode step: static shapes, one graph") == (
        "10-the-decode-step-static-shapes-one-graph"
    )
    assert slug("Replicas on Ray Serve (`serve --replicas N`)") == (
        "replicas-on-ray-serve-serve---replicas-n"
    )
    assert slug("The [engine](python.md) — batches") == "the-engine--batches"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, anchor = resolve(page, target)
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert broken == []


@pytest.mark.parametrize("page", ALL_DOCS, ids=lambda page: str(page.relative_to(ROOT)))
def test_docs_never_link_outside_the_repository(page):
    outside = [
        target for target in links(page) if not resolve(page, target)[0].is_relative_to(ROOT)
    ]
    assert outside == []


def test_the_index_links_every_page_of_docs():
    indexed = {resolve(INDEX, target)[0] for target in links(INDEX)}
    missing = [
        str(page.relative_to(DOCS)) for page in ALL_DOCS if page != INDEX and page not in indexed
    ]
    assert missing == []
