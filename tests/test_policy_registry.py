"""The policy registry: a policy is one module that registers itself, found by `make_policy`,
the torch-free name check and the docs' table alike, and gone from all of them once removed."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import kept_positions, recorded_call

import agent_kv.kv.policies as policies
from agent_kv.errors import ConfigError
from agent_kv.kv.policies import POLICIES, discover, make_policy
from agent_kv.kv.policies.base import FixedBudgetPolicy
from agent_kv.kv.policies.table import policy_table
from agent_kv.kv.policy_names import check_policy_name, read_policies
from agent_kv.kv.store import KVStore

DOCS = Path(__file__).resolve().parents[1] / "docs" / "policies.md"
TABLE_START = "<!-- policy-table:start -->\n"
TABLE_END = "<!-- policy-table:end -->"

NEW_POLICY = '''"""Keep the oldest tokens."""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.kv.policies.base import FixedBudgetPolicy


@dataclass
class Oldest(FixedBudgetPolicy):
    """Keep the `budget_tokens` oldest unpinned tokens per layer."""

    name = "oldest"
    summary = "the oldest tokens, `budget_tokens` per layer"
    paper = "no paper"
    spare: int = 2

    def rank(self, store, view, candidates):
        return -view.positions.float()
'''
"""A policy module as a contributor would write it: one class, nothing else edited."""

NEW_STATISTIC_POLICY = '''"""Keep the tokens whose values are largest."""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.kv.policies.base import FixedBudgetPolicy
from agent_kv.kv.token_statistics import Column, TokenStatistic


@dataclass(frozen=True)
class ValueSum(TokenStatistic):
    """Each token's attention mass, summed over the calls, times two."""

    columns = (Column("twice_mass"),)

    def fold(self, measured, new):
        added = 2 * measured.mass
        return {"twice_mass": added if new else measured.stored["twice_mass"] + added}


@dataclass
class Twice(FixedBudgetPolicy):
    """Keep the tokens with the most attention, counted twice."""

    name = "twice"
    summary = "the most attended tokens, counted twice"
    statistics = (ValueSum(),)

    def rank(self, store, view, candidates):
        return store.joint("twice_mass", rows=view.rows).mean(dim=2)
'''
"""A policy with a statistic of its own, as a contributor would write it: one module."""


@pytest.fixture
def extra_directory(tmp_path, monkeypatch) -> Path:
    """A directory on the policy package's path; the registry, the path and the imported
    modules are restored after the test (as a fresh process would build them)."""
    directory = tmp_path / "policies"
    directory.mkdir()
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(directory)])
    monkeypatch.setattr(POLICIES, "_classes", dict(POLICIES._classes))
    yield directory
    sys.modules.pop(f"{policies.__name__}.oldest", None)


def test_the_docs_table_is_the_rendered_one():
    text = DOCS.read_text(encoding="utf-8")
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    between = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert between == policy_table()


def test_the_table_has_a_row_per_policy_with_its_parameters():
    lines = policy_table().splitlines()
    assert lines[0] == "| policy | keeps | parameters (defaults) |"
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `{name}`" for name in POLICIES]
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    assert rows["`full`"] == "| `full` | every token | none |"
    assert rows["`window`"].endswith("(StreamingLLM §3) | `window` (512), `sinks` (4) |")
    assert rows["`h2o`"].endswith("| `budget_tokens` (512), `protect_recent` (256) |")
    assert rows["`conf-kv-l`"].endswith("| `conf-kv`'s, plus `pyramid` (0.5) |")
    assert rows["`base-origin`"].endswith("| `arkv`'s, with `oq_ratio` (1.0), `oq_spread` (0.0) |")
    assert rows["`base-quant`"].endswith("| `quantized` (`fp8`), `group` (8) |")
    assert rows["`kvzip`"].endswith("| `budget_tokens` (512), `protect_recent` (32), `sinks` (4) |")


def test_the_listing_order_is_stable_and_unbudgeted_policies_follow_takes_budget():
    listed = (
        "full", "window", "h2o", "snapkv", "knorm", "random", "conf-kv", "conf-kv-l", "arkv",
        "base-quant", "base-origin", "conf-kv+arkv", "kvzip",
    )  # fmt: skip
    assert [name for name in POLICIES if name in listed] == list(listed)
    assert not POLICIES["full"].takes_budget and not POLICIES["base-quant"].takes_budget
    with pytest.raises(ConfigError, match="'base-quant' evicts nothing"):
        check_policy_name("base-quant+recall")
    with pytest.raises(ConfigError, match="'full' evicts nothing"):
        make_policy("full+recall")


def test_a_policy_is_one_module_and_removing_it_leaves_no_trace(extra_directory, monkeypatch):
    module = extra_directory / "oldest.py"
    module.write_text(NEW_POLICY, encoding="utf-8")
    discover()
    policy = make_policy("oldest", budget=64, spare=3)
    assert type(policy).__name__ == "Oldest" and (policy.budget_tokens, policy.spare) == (64, 3)
    assert make_policy("oldest+recall", budget=64).name == "oldest+recall"
    assert list(POLICIES)[-1] == "oldest"  # no `order` of its own: after the others
    row = "| `oldest` | the oldest tokens, `budget_tokens` per layer (no paper) | "
    assert row + "`budget_tokens` (512), `spare` (2) |\n" in policy_table()
    declared = read_policies(policies.__path__)
    assert list(declared)[-1] == "oldest" and declared["oldest"] is True

    module.unlink()
    monkeypatch.undo()  # the package's path and registry as a fresh process builds them
    sys.modules.pop(f"{policies.__name__}.oldest")
    discover()
    assert "oldest" not in POLICIES
    with pytest.raises(ConfigError, match="unknown policy 'oldest'"):
        make_policy("oldest")
    assert "oldest" not in policy_table()
    assert "oldest" not in read_policies([*policies.__path__, str(extra_directory)])


def test_a_policy_with_a_statistic_of_its_own_is_one_module(extra_directory):
    (extra_directory / "twice.py").write_text(NEW_STATISTIC_POLICY, encoding="utf-8")
    discover()
    policy = make_policy("twice", budget=4, protect_recent=0, evict_slack=0)
    store = KVStore(2, 1, 4)
    plan = policy.prepare(store)
    mass = torch.tensor([[[0.5, 0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4]]])
    recorded_call(store, torch.randn(1, 1, 8, 4), masses=mass, plan=plan)
    assert set(store.segments.columns) == {"twice_mass"}  # only what the plan named
    torch.testing.assert_close(store.live_meta("twice_mass", 1)[0], 2 * mass[0, 0])
    recorded_call(store, torch.randn(1, 1, 1, 4), masses=torch.full((1, 1, 9), 0.1), plan=plan)
    policy.evict(store, None)
    assert kept_positions(store) == [0, 2, 4, 6]  # the four most attended, both calls summed


def test_a_taken_name_or_a_missing_summary_is_refused_where_the_class_is_defined(monkeypatch):
    monkeypatch.setattr(POLICIES, "_classes", dict(POLICIES._classes))
    with pytest.raises(TypeError, match=r"'h2o' is taken by agent_kv\.kv\.policies\.h2o\.H2O"):

        @dataclass
        class Impostor(FixedBudgetPolicy):
            name = "h2o"
            summary = "anything"

    with pytest.raises(TypeError, match="policy 'unsummarised' .* sets no summary of its own"):

        @dataclass
        class Unsummarised(FixedBudgetPolicy):
            name = "unsummarised"

    assert "unsummarised" not in POLICIES and POLICIES["h2o"].__name__ == "H2O"
