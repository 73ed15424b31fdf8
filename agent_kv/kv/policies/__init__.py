"""KV-cache policies, one module each, one interface (`agent_kv.kv.policies.base.Policy`).

A policy is one module in this package: its class sets `name` (and `summary`, `order`,
`paper`) and registers itself as it is defined (`agent_kv.kv.policies.registry`); importing
this package imports every module in it (`discover`), so `POLICIES`, `make_policy`, the docs'
table (`agent_kv.kv.policies.table`) and the command line's names
(`agent_kv.kv.policy_names`) all come from the classes themselves.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from agent_kv.errors import ConfigError
from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.kv.policies.base import Policy, check_budget
from agent_kv.kv.policies.cold_recall import ColdRecall
from agent_kv.kv.policies.registry import POLICIES
from agent_kv.kv.policy_names import (
    REENCODE_SUFFIX,
    check_policy_name,
    split_recall,
    split_reencode,
)
from agent_kv.kv.store import Int8Config, KVStore


def discover() -> None:
    """Import every module of this package (the directories of its `__path__`), so each
    policy class defined in one registers itself in `POLICIES`."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


discover()


def make_policy(
    name: str, budget: int | None = None, recall: ColdConfig | None = None, **params
) -> Policy:
    """Build and validate a policy by name.

    Args:
        name: a key of `POLICIES` (docs/policies.md lists them), optionally with the suffix
            `+recall`: the policy wrapped in `ColdRecall`.
        budget: unpinned tokens per layer, turned into the policy's fields by its
            `budget_params` (e.g. the window of `window`; `n_low`, with `n_high = budget //
            2`, for CONF-KV; ARKV's mean bytes per layer, counted in full-precision tokens);
            a policy without a budget (`takes_budget` false: full KV, pins only) takes none.
        recall: the cold tier's settings for a `+recall` name (default `ColdConfig()`); giving
            them wraps the policy in `ColdRecall` whatever the name.
        **params: the policy's dataclass fields (e.g. `tau`, `protect_recent`, `sinks`);
            they win over what `budget` implies.

    Raises:
        ConfigError: unknown name, unknown parameter, or invalid values (`+recall` on a
            policy that evicts nothing); a `+reencode` name (an engine setting:
            `PolicySpec.parse` and `Engine(reencode=True)`).
    """
    check_policy_name(name, {policy: cls.evicts for policy, cls in POLICIES.items()})
    if split_reencode(name)[1]:
        raise ConfigError(
            f"{REENCODE_SUFFIX} is the engine's setting, not the policy's: build {name!r} with "
            "PolicySpec.parse, or pass reencode=True to the Engine"
        )
    name, with_recall = split_recall(name)
    if with_recall or recall is not None:
        return ColdRecall(make_policy(name, budget, **params), recall or ColdConfig())
    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ConfigError(
            f"policy {name!r} has no parameter {unknown[0]!r} (its parameters: "
            f"{', '.join(sorted(fields)) or 'none'})"
        )
    for key, value in params.items():
        _check_type(name, key, value, _default(cls, key))
    if budget is not None:
        budget_fields = cls.budget_params(budget, params)  # refuses a budget for `full`
        check_budget(name, "budget", budget)
        params = {**budget_fields, **params}
    policy = cls(**params)
    policy.validate()
    return policy


def _default(cls: type[Policy], field_name: str):
    field = next(f for f in dataclasses.fields(cls) if f.name == field_name)
    return field.default


def _check_type(policy: str, key: str, value, default) -> None:
    """Raise ConfigError unless `value` has the type of the field's default (an int is
    accepted for a float field; a bool is never a number)."""
    expected = (int, float) if isinstance(default, float) else type(default)
    if isinstance(value, bool) or not isinstance(value, expected):
        kind = type(default).__name__
        raise ConfigError(f"policy {policy!r} parameter {key!r} must be {kind}, got {value!r}")


def check_policy_precision(
    policy: Policy, int8: Int8Config | None, store: KVStore | None = None
) -> None:
    """Raise `ConfigError` when a policy that chooses its quantized tokens itself (ARKV and
    its baselines) would run on a store with age-based mixed precision too (`int8`), or on
    a `store` that already holds quantized tokens of another format."""
    if not policy.manages_precision:
        return
    if int8 is not None:
        raise ConfigError(
            f"policy {policy.name!r} chooses which tokens to quantize itself: run it without --int8"
        )
    held = None if store is None else store.precision.quantized_format()
    if held not in (None, policy.quantized):
        raise ConfigError(
            f"this session's cache holds {held} tokens; policy {policy.name!r} would add "
            f"{policy.quantized} ones (one format per session)"
        )


__all__ = [
    "POLICIES",
    "ColdRecall",
    "Policy",
    "check_policy_precision",
    "discover",
    "make_policy",
]
