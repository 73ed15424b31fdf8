"""The repository's layers: which unit each module lies in, and which layer each unit stands
on (`docs/layout.md` lists them; `tests/test_layers.py` holds the imports to them).

A module may import its own unit and the units of lower layers, never a unit of its own layer
or of a higher one."""

from __future__ import annotations

from pathlib import Path

PACKAGES = ("agent_kv", "api", "envs", "kernels", "tasks", "benchmarks", "scripts")
"""The top-level folders of Python code."""

LAYERS: list[tuple[str, ...]] = [
    ("agent_kv.base", "kernels", "tasks"),
    ("agent_kv.kv", "envs"),
    ("agent_kv.runtime", "agent_kv.runtime.models", "agent_kv.runtime.replies"),
    ("agent_kv.runtime.engine",),
    ("agent_kv.runtime.chat",),
    ("agent_kv.serving", "agent_kv.harness", "agent_kv.evals"),
    ("api",),
    ("agent_kv.cli",),
    ("benchmarks", "scripts"),
]
"""Units, lowest layer (1) first. `agent_kv.base` names the package's own root modules; the
runtime's rooms stack models and replies under the engine, and the engine under chats; the
benchmarks and the scripts stand on everything."""

BASE = {"agent_kv", "agent_kv.errors", "agent_kv.valid_text", "agent_kv.renamed_fields"}
"""The modules of `agent_kv.base`: the package itself, its errors, the Unicode check and the
old names of saved fields (read for one release)."""


def unit_of(module: str) -> str | None:
    """The unit a dotted module name belongs to (the longest unit it lies in), or None."""
    if module in BASE:
        return "agent_kv.base"
    units = [unit for layer in LAYERS for unit in layer]
    inside = [unit for unit in units if module == unit or module.startswith(unit + ".")]
    return max(inside, key=len, default=None)


def rank_of(unit: str) -> int:
    """The layer of a unit, counted from 1 at the bottom.

    Raises:
        StopIteration: `unit` is in no layer.
    """
    return next(i for i, layer in enumerate(LAYERS, start=1) if unit in layer)


def module_name(path: Path, root: Path) -> str:
    """The dotted module name of the file `path` under the repository `root` (a package is
    its folder's name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(root: Path) -> list[Path]:
    """Every Python file of the packages under `root`, sorted, package by package."""
    return [path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))]
