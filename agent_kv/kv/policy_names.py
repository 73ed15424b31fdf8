"""The KV policies' names, without importing the policies (they import torch), so the command
line refuses an unknown name before anything heavy loads. `make_policy` checks names here
too, so `agent_kv.kv.policies.POLICIES` cannot hold a policy missing from this list."""

from __future__ import annotations

from agent_kv.errors import ConfigError

POLICY_NAMES = (
    "full", "window", "h2o", "snapkv", "random", "conf-kv", "conf-kv-l",
    "arkv", "base-quant", "base-origin", "conf-kv+arkv",
)  # fmt: skip
"""The names of `agent_kv.kv.policies.POLICIES`, in its order."""


def check_policy_name(name: str) -> None:
    """Raise ConfigError (naming the choices) unless `name` is one of `POLICY_NAMES`."""
    if name not in POLICY_NAMES:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")
