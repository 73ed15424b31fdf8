"""`docs/layout.md`, rendered from the code: the layers, then one section per folder of Python
code (its package docstring's first paragraph, and a row per module and subfolder with the
first sentence of its docstring), lowest layer first. `scripts.write_docs` writes it and
`tests/test_generated_docs.py` checks it, so the map cannot drift from the modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from scripts.layers import LAYERS, module_name, python_files, rank_of, unit_of

INTRO = """\
# Code layout

<!-- Written by `python -m scripts.write_docs` from the modules' docstrings: edit those, not
this page. -->

agent_kv is a local LLM backend for long-horizon web agents (KV-cache eviction policies, a KV
store, an engine, a FastAPI server, a LangChain chat model, a web-agent harness). This page
maps its source tree, folder by folder, each module by the first sentence of its docstring;
why it is cut this way, and the data flow of a decode step, are in
[architecture.md](architecture.md).

The code is cut in layers, and imports go down only: a module imports its own unit and the
units of lower layers, never a unit of its own layer or of a higher one
(`tests/test_layers.py` fails on any other import, and on a module in no layer; the layers
are `scripts/layers.py`'s).
"""

FULL_STOP = re.compile(r"\.(?=\s|$)")


class MissingDocstring(ValueError):
    """A module or package of the layout has no docstring to describe it by."""


def docstring(path: Path) -> str:
    """The docstring of the Python file `path`, its whitespace runs made single spaces,
    paragraph by paragraph (paragraphs joined by a blank line).

    Raises:
        MissingDocstring: the file has none.
    """
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not text:
        raise MissingDocstring(f"{path} has no docstring: say in one sentence what it holds")
    return "\n\n".join(" ".join(part.split()) for part in text.split("\n\n"))


def first_sentence(path: Path) -> str:
    """The first sentence of `path`'s docstring (up to its first full stop that is followed by
    a space or the end and lies outside `code`), or its first paragraph where it has none."""
    paragraph = docstring(path).split("\n\n")[0]
    for stop in FULL_STOP.finditer(paragraph):
        if paragraph.count("`", 0, stop.start()) % 2 == 0:
            return paragraph[: stop.end()]
    return paragraph


def layout_page(root: Path) -> str:
    """The whole text of `docs/layout.md` for the repository at `root`.

    Raises:
        MissingDocstring: a module, or a folder's `__init__.py`, has no docstring.
    """
    folders: dict[Path, list[Path]] = {}
    for path in python_files(root):
        folders.setdefault(path.parent, []).append(path)
    order = sorted(folders, key=lambda folder: (_rank(folder, root), folder.relative_to(root)))
    sections = [_section(folder, folders, root) for folder in order]
    return "\n".join([INTRO, _layers_table(), *sections])


def _rank(folder: Path, root: Path) -> int:
    unit = unit_of(module_name(folder / "__init__.py", root))
    return rank_of(unit) if unit else 0


def _layers_table() -> str:
    rows = ["## Layers\n", "| layer | units |", "| --- | --- |"]
    for rank, units in enumerate(LAYERS, start=1):
        rows.append(f"| {rank} | {', '.join(_unit_name(unit) for unit in units)} |")
    return "\n".join(rows) + "\n"


def _unit_name(unit: str) -> str:
    if unit == "agent_kv.base":
        return "`agent_kv/` (its own modules)"
    return f"`{unit.replace('.', '/')}/`"


def _section(folder: Path, folders: dict[Path, list[Path]], root: Path) -> str:
    where = folder.relative_to(root).as_posix()
    init = folder / "__init__.py"
    lines = [f"## `{where}/` (layer {_rank(folder, root)})\n"]
    if init.exists():
        lines.append(docstring(init).split("\n\n")[0])
    rows = [
        (f"[{path.name}]({_link(path, root)})", first_sentence(path))
        for path in folders[folder]
        if path.name != "__init__.py"
    ]
    rows += [
        (f"`{sub.name}/`", first_sentence(sub / "__init__.py"))
        for sub in sorted(folders)
        if sub.parent == folder and (sub / "__init__.py").exists()
    ]
    if rows:
        lines += ["", "| module | what it holds |", "| --- | --- |"]
        lines += [f"| {name} | {_cell(text)} |" for name, text in rows]
    return "\n".join(lines) + "\n"


def _link(path: Path, root: Path) -> str:
    return "../" + path.relative_to(root).as_posix()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
