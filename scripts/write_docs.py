"""Write the docs that are rendered from the code, or check that they are current:
`docs/layout.md` (`scripts.layout_page`) and the policy table of `docs/policies.md`
(`agent_kv.kv.policies.table`, between its two markers).

    .venv/bin/python -m scripts.write_docs           # write both pages
    .venv/bin/python -m scripts.write_docs --check   # exit 1, naming them, when one is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent_kv.kv.policies.table import policy_table
from scripts.layout_page import layout_page

ROOT = Path(__file__).resolve().parent.parent
TABLE_START = "<!-- policy-table:start -->\n"
TABLE_END = "<!-- policy-table:end -->"


def with_policy_table(text: str) -> str:
    """`text` (docs/policies.md) with what lies between its table markers replaced by the
    rendered policy table.

    Raises:
        ValueError: the markers are not there once each, in order.
    """
    if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
        raise ValueError(f"docs/policies.md needs {TABLE_START.strip()} and {TABLE_END} once each")
    head, rest = text.split(TABLE_START)
    if TABLE_END not in rest:
        raise ValueError(f"{TABLE_END} comes before {TABLE_START.strip()} in docs/policies.md")
    return head + TABLE_START + policy_table() + TABLE_END + rest.split(TABLE_END, 1)[1]


def rendered_pages(root: Path) -> dict[Path, str]:
    """Each generated page of the repository at `root`, by path, as the code renders it."""
    policies = root / "docs" / "policies.md"
    return {
        root / "docs" / "layout.md": layout_page(root),
        policies: with_policy_table(policies.read_text(encoding="utf-8")),
    }


def stale_pages(root: Path) -> list[Path]:
    """The generated pages under `root` whose text differs from the rendered one."""
    return [
        path
        for path, text in rendered_pages(root).items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    """Write the pages (or, with `--check`, only report the stale ones); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(ROOT)
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python -m scripts.write_docs")
        return 1 if stale else 0
    for path, text in rendered_pages(ROOT).items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
