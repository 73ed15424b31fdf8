"""KV-cache policies, one module each, one interface (`agent_kv.policies.base.Policy`)."""

from __future__ import annotations

import dataclasses

from agent_kv.errors import ConfigError
from agent_kv.policies.base import Policy, check_budget
from agent_kv.policies.conf_kv import ConfKV
from agent_kv.policies.full import FullKV
from agent_kv.policies.window import SlidingWindow

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (FullKV, SlidingWindow, ConfKV)}


def make_policy(name: str, budget: int | None = None, **params) -> Policy:
    """Build and validate a policy by name.

    Args:
        name: one of `POLICIES` (`full`, `window`, `conf-kv`).
        budget: tokens per layer. For `window` the window size; for `conf-kv` the loose budget
            `n_low`, with `n_high = budget // 2` unless given. Ignored by `full` (must be None).
        **params: the policy's dataclass fields (e.g. `tau`, `protect_recent`, `sinks`).

    Raises:
        ConfigError: unknown name, unknown parameter, or invalid values.
    """
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ConfigError(
            f"policy {name!r} has no parameter {unknown[0]!r} (its parameters: "
            f"{', '.join(sorted(fields)) or 'none'})"
        )
    if budget is not None:
        if cls is FullKV:
            raise ConfigError("policy 'full' keeps every token and takes no budget")
        check_budget(name, "budget", budget)
        if cls is SlidingWindow:
            params.setdefault("window", budget)
        else:
            params.setdefault("n_low", budget)
            params.setdefault("n_high", budget // 2)
            protect = params.get("protect_recent", ConfKV.protect_recent)
            if params["n_high"] <= protect:
                raise ConfigError(
                    f"conf-kv: budget {budget} is too small: its confident half "
                    f"({params['n_high']}) must exceed protect_recent={protect}"
                )
    policy = cls(**params)
    policy.validate()
    return policy


__all__ = ["POLICIES", "ConfKV", "FullKV", "Policy", "SlidingWindow", "make_policy"]
