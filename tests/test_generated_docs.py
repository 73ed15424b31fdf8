"""The pages rendered from the code (`scripts.write_docs`): docs/layout.md, from the modules'
docstrings, and the policy table of docs/policies.md, are the rendered ones; a stale page is
reported, and a module with nothing to describe it by is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.layout_page import MissingDocstring, first_sentence, layout_page
from scripts.write_docs import TABLE_END, TABLE_START, stale_pages, with_policy_table

ROOT = Path(__file__).resolve().parents[1]


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")


def test_the_generated_pages_are_current():
    assert stale_pages(ROOT) == []


def test_the_layout_lists_every_module_under_its_folder_and_layer():
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    assert "## `agent_kv/runtime/engine/` (layer 4)" in page
    assert "| [engine.py](../agent_kv/runtime/engine/engine.py) | The inference engine" in page
    assert "## `scripts/long_tasks/` (layer 9)" in page
    for path in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("agent_kv/kv/policies/*.py")]:
        if path.name != "__init__.py":
            assert f"({'../' + path.relative_to(ROOT).as_posix()})" in page, path


def test_a_small_tree_renders_folder_by_folder(tmp_path):
    write(
        tmp_path,
        {
            "agent_kv/__init__.py": '"""The package.\n\nMore."""\n',
            "agent_kv/errors.py": '"""Errors: the `a. b` kind. Second."""\n',
            "agent_kv/kv/__init__.py": '"""The cache."""\n',
            "agent_kv/kv/store.py": '"""A store | with a pipe"""\n',
        },
    )
    page = layout_page(tmp_path)
    assert "| 2 | `agent_kv/kv/`, `envs/` |" in page
    assert page.index("## `agent_kv/` (layer 1)") < page.index("## `agent_kv/kv/` (layer 2)")
    assert "| [errors.py](../agent_kv/errors.py) | Errors: the `a. b` kind. |" in page
    assert "| `kv/` | The cache. |" in page
    assert "| [store.py](../agent_kv/kv/store.py) | A store \\| with a pipe |" in page


def test_a_module_without_a_docstring_is_refused(tmp_path):
    write(
        tmp_path, {"agent_kv/__init__.py": '"""The package."""\n', "agent_kv/errors.py": "X = 1\n"}
    )
    with pytest.raises(MissingDocstring, match="errors.py has no docstring"):
        layout_page(tmp_path)


def test_the_first_sentence_ends_outside_code(tmp_path):
    write(tmp_path, {"m.py": '"""A bound on `q . k` per page. More\ntext."""\n'})
    assert first_sentence(tmp_path / "m.py") == "A bound on `q . k` per page."


def test_a_stale_page_is_reported(tmp_path):
    policies = f"# Policies\n\n{TABLE_START}old rows\n{TABLE_END}\n\nAfter.\n"
    write(
        tmp_path,
        {
            "agent_kv/__init__.py": '"""The package."""\n',
            "docs/policies.md": policies,
            "docs/layout.md": "old\n",
        },
    )
    assert stale_pages(tmp_path) == [tmp_path / "docs/layout.md", tmp_path / "docs/policies.md"]
    (tmp_path / "docs/layout.md").write_text(layout_page(tmp_path), encoding="utf-8")
    (tmp_path / "docs/policies.md").write_text(with_policy_table(policies), encoding="utf-8")
    assert stale_pages(tmp_path) == []
    assert with_policy_table(policies).endswith(f"{TABLE_END}\n\nAfter.\n")


def test_policy_markers_out_of_place_are_an_error():
    with pytest.raises(ValueError, match="once each"):
        with_policy_table("no markers\n")
    with pytest.raises(ValueError, match="comes before"):
        with_policy_table(f"{TABLE_END}\n{TABLE_START}")
