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
REENCODE_SUFFIX = "+reencode"
"""A policy name ending in it runs that policy on an engine that encodes the tokens the cache
keeps again, without the evicted history, before a new message once the cache has evicted as
many tokens as it holds since the last time (`agent_kv.runtime.engine.Engine.reencode`), e.g.
`window+reencode`."""


def split_recall(name: str) -> tuple[str, bool]:
    """`("h2o", True)` for `"h2o+recall"`, `("h2o", False)` for `"h2o"` (a
    `REENCODE_SUFFIX` is split off first: `split_reencode`)."""
    if name.endswith(RECALL_SUFFIX):
        return name[: -len(RECALL_SUFFIX)], True
    return name, False


def split_reencode(name: str) -> tuple[str, bool]:
    """`("window", True)` for `"window+reencode"`, `("window", False)` for `"window"`."""
    if name.endswith(REENCODE_SUFFIX):
        return name[: -len(REENCODE_SUFFIX)], True
    return name, False


def base_policy(name: str) -> str:
    """The policy's own name without its suffixes: `"h2o"` for `"h2o+recall"`, `"window"` for
    `"window+reencode"`."""
    return split_recall(split_reencode(name)[0])[0]


def check_policy_name(name: str) -> None:
    """Raise ConfigError (naming the choices) unless `name` is one of `POLICY_NAMES`, with or
    without `RECALL_SUFFIX` or `REENCODE_SUFFIX` (not both: re-encoding starts a fresh cache,
    which holds no cold tier; neither for a policy of `UNBUDGETED_NAMES`)."""
    unsuffixed, reencode = split_reencode(name)
    base, recall = split_recall(unsuffixed)
    if base not in POLICY_NAMES:
        raise ConfigError(
            f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)} (add "
            f"{RECALL_SUFFIX} to keep evicted tokens in a cold tier and recall them, or "
            f"{REENCODE_SUFFIX} to encode the kept tokens again without the evicted history)"
        )
    if recall and base in UNBUDGETED_NAMES:
        raise ConfigError(f"policy {base!r} evicts nothing: there is nothing to recall")
    if reencode and base in UNBUDGETED_NAMES:
        raise ConfigError(f"policy {base!r} evicts nothing: there is nothing to re-encode")
    if reencode and recall:
        raise ConfigError(
            f"{name!r}: re-encoding starts a fresh cache without the cold tier that recall "
            "reads; choose one of the two"
        )
