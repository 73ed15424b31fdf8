"""Imports go down only: each package of the project sits in a layer (docs/architecture.md,
"Layers"), and a module may import its own unit and the units of lower layers, never a unit
of its own layer or of a higher one. Every import counts, also those inside functions and
under `TYPE_CHECKING`. A module outside every unit fails too, so a new package has to be
placed in a layer. Inside a unit, no two modules import each other, directly or around a
circle."""

from __future__ import annotations

import ast
from pathlib import Path

from scripts.layers import PACKAGES, module_name, python_files, rank_of, unit_of

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path, module: str) -> set[str]:
    """Modules of the project that `path` (module `module`) imports, relative ones resolved."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` may import a submodule: count both
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def layer_violations(root: Path) -> list[str]:
    """Every import of a module under `root` that goes up or sideways, and every module that
    lies in no unit, as readable lines."""
    problems = []
    for path in python_files(root):
        module = module_name(path, root)
        unit = unit_of(module)
        if unit is None:
            problems.append(f"{module} lies in no layer: add its package to LAYERS")
            continue
        upward: dict[str, str] = {}  # unit imported -> the shortest name imported from it
        for target in sorted(imports_of(path, module), key=len):
            target_unit = unit_of(target)
            if target_unit is None or target_unit == unit:
                continue  # a name outside every unit, or the module's own unit
            if rank_of(target_unit) >= rank_of(unit):
                upward.setdefault(target_unit, target)
        problems += [
            f"{module} (layer {rank_of(unit)}) imports {target} "
            f"({target_unit}, layer {rank_of(target_unit)})"
            for target_unit, target in sorted(upward.items())
        ]
    return problems


def import_circles(root: Path) -> list[list[str]]:
    """Every circle of imports between the project's modules under `root` (each import
    counts, as in `layer_violations`; a package is its `__init__`), as module names in the
    order they import one another, each circle once."""
    modules = {module_name(path, root): path for path in python_files(root)}
    graph = {
        module: sorted(t for t in imports_of(path, module) if t in modules and t != module)
        for module, path in modules.items()
    }
    circles, seen = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:  # depth-first from `start`, through modules that sort after it
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        circles.append(path)
                elif target > start and target not in path:
                    stack.append((target, [*path, target]))
    return circles


def test_imports_go_down_only():
    assert layer_violations(ROOT) == []


def test_no_modules_import_each_other():
    assert import_circles(ROOT) == []


def test_a_circle_of_imports_is_caught(tmp_path):
    files = {
        "agent_kv/__init__.py": "",
        "agent_kv/kv/__init__.py": "",
        "agent_kv/kv/store.py": "from agent_kv.kv.forward_call import ForwardCall\n",
        "agent_kv/kv/forward_call.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from agent_kv.kv import store\n"
        ),
        "agent_kv/kv/policies.py": "from agent_kv.kv.store import KVStore\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    assert import_circles(tmp_path) == [["agent_kv.kv.forward_call", "agent_kv.kv.store"]]


def test_an_upward_or_sideways_import_is_caught(tmp_path):
    files = {
        "agent_kv/__init__.py": "",
        "agent_kv/errors.py": "",
        "agent_kv/kv/__init__.py": "",
        "agent_kv/kv/store.py": "from agent_kv.errors import X\n",
        "agent_kv/kv/policies.py": (
            "def f():\n    from agent_kv.runtime.engine.engine import Engine\n"
        ),
        "agent_kv/runtime/__init__.py": "",
        "agent_kv/runtime/engine/engine.py": "from ...kv import store\n",
        "agent_kv/harness/__init__.py": "",
        "agent_kv/harness/sweep/settings.py": "from agent_kv.cli import PolicySpec\n",
        "agent_kv/evals/__init__.py": "from agent_kv.harness import sweep\n",
        "agent_kv/scheduler.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    assert layer_violations(tmp_path) == [
        "agent_kv.evals (layer 6) imports agent_kv.harness (agent_kv.harness, layer 6)",
        "agent_kv.harness.sweep.settings (layer 6) imports agent_kv.cli (agent_kv.cli, layer 8)",
        "agent_kv.kv.policies (layer 2) imports agent_kv.runtime.engine.engine "
        "(agent_kv.runtime.engine, layer 4)",
        "agent_kv.scheduler lies in no layer: add its package to LAYERS",
    ]
