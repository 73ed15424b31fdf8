"""The project's top-level packages (`kernels`, `envs`, `tasks`, `api`) are never taken for a
library of the same name: only this project provides them, and transformers' check for the
Hugging Face Hub's `kernels` library answers no."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = ("kernels", "envs", "tasks", "api")


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_each_top_level_package_is_this_projects_and_only_its(name):
    providers = set(importlib.metadata.packages_distributions().get(name, []))
    assert providers == {"agent-kv"}, f"{name} is also provided by {providers - {'agent-kv'}}"
    origin = Path(importlib.util.find_spec(name).origin).resolve()
    assert origin.is_relative_to(ROOT / name)


def test_transformers_finds_no_hub_kernels_library_and_uses_none():
    probe = (
        "import json, agent_kv.runtime.models.model_loading\n"
        "from transformers.integrations import hub_kernels\n"
        "from transformers.utils import import_utils\n"
        "print(json.dumps([hub_kernels._kernels_enabled,\n"
        "    import_utils.is_kernels_available(), import_utils.KERNELS_MIN_VERSION]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    enabled, available, minimum = json.loads(done.stdout.strip().splitlines()[-1])
    assert available is False and enabled is False  # no Hub kernel is used
    # what makes it false: transformers finds this project's `kernels` (the name is taken)
    # and reads the project's version for it, below the Hub library's minimum. A release at
    # or past that version would be taken for the library and imported in its place.
    project = Version(importlib.metadata.version("agent-kv"))
    assert importlib.util.find_spec("kernels") is not None and project < Version(minimum)
