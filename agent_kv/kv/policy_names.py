"""The KV policies' names, without importing the policies (they import torch), so the command
line refuses an unknown name before anything heavy loads. `make_policy` checks names here
too, so `agent_kv.kv.policies.POLICIES` cannot hold a policy missing from this list."""

from __future__ import annotations

from agent_kv.errors import ConfigError

POLICY_NAMES = (
    "full", "window", "h2o", "snapkv", "random", "conf-kv", "conf-kv-l",
    "arkv", "base-quant", "base-origin", "conf-kv+arkv", "kvzip",
)  # fmt: skip
"""The names of `agent_kv.kv.policies.POLICIES`, in its order."""
UNBUDGETED_NAMES = ("full", "base-quant")
"""The policies that evict nothing (`Policy.takes_budget` false): no budget, no recall."""
RECALL_SUFFIX = "+recall"
"""A policy name ending in it runs that policy with a cold tier and query-aware recall
(`agent_kv.kv.policies.cold_recall`), e.g. `h2o+recall`."""


def split_recall(name: str) -> tuple[str, bool]:
    """`("h2o", True)` for `"h2o+recall"`, `("h2o", False)` for `"h2o"`."""
    if name.endswith(RECALL_SUFFIX):
        return name[: -len(RECALL_SUFFIX)], True
    return name, False


def check_policy_name(name: str) -> None:
    """Raise ConfigError (naming the choices) unless `name` is one of `POLICY_NAMES`, with or
    without `RECALL_SUFFIX` (which a policy of `UNBUDGETED_NAMES` cannot take)."""
    base, recall = split_recall(name)
    if base not in POLICY_NAMES:
        raise ConfigError(
            f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)} (add "
            f"{RECALL_SUFFIX} to keep evicted tokens in a cold tier and recall them)"
        )
    if recall and base in UNBUDGETED_NAMES:
        raise ConfigError(f"policy {base!r} evicts nothing: there is nothing to recall")
