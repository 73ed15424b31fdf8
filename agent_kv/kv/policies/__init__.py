"""KV-cache policies, one module each, one interface (`agent_kv.kv.policies.base.Policy`)."""

from __future__ import annotations

import dataclasses

from agent_kv.errors import ConfigError
from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.kv.policies.arkv import Arkv, BaseOrigin
from agent_kv.kv.policies.base import Policy, check_budget
from agent_kv.kv.policies.base_quant import BaseQuant
from agent_kv.kv.policies.cold_recall import ColdRecall
from agent_kv.kv.policies.conf_kv import ConfKV
from agent_kv.kv.policies.conf_kv_arkv import ConfKVArkv
from agent_kv.kv.policies.conf_kv_l import ConfKVL
from agent_kv.kv.policies.full import FullKV
from agent_kv.kv.policies.h2o import H2O
from agent_kv.kv.policies.kvzip import KVzip
from agent_kv.kv.policies.random_eviction import RandomEviction
from agent_kv.kv.policies.snapkv import SnapKV
from agent_kv.kv.policies.window import SlidingWindow
from agent_kv.kv.policy_names import (
    REENCODE_SUFFIX,
    check_policy_name,
    split_recall,
    split_reencode,
)
from agent_kv.kv.store import Int8Config, KVStore

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FullKV, SlidingWindow, H2O, SnapKV, RandomEviction, ConfKV, ConfKVL,
        Arkv, BaseQuant, BaseOrigin, ConfKVArkv, KVzip,
    )
}  # fmt: skip


def make_policy(
    name: str, budget: int | None = None, recall: ColdConfig | None = None, **params
) -> Policy:
    """Build and validate a policy by name.

    Args:
        name: one of `POLICIES` (`full`, `window`, `h2o`, `snapkv`, `random`, `conf-kv`,
            `conf-kv-l`, `arkv`, `base-quant`, `base-origin`, `conf-kv+arkv`, `kvzip`), optionally
            with the suffix `+recall`: the policy wrapped in `ColdRecall`.
        budget: unpinned tokens per layer, mapped by the policy's `budget_params`: the window
            for `window`; the budget (half of it recent) for `h2o`; the budget for `snapkv`
            and `random`;
            `n_low`, with `n_high = budget // 2`, for `conf-kv`, `conf-kv-l` and
            `conf-kv+arkv`; for `arkv` and `base-origin` the mean bytes per layer, counted in
            full-precision tokens. `full` and `base-quant` take none.
        recall: the cold tier's settings for a `+recall` name (default `ColdConfig()`); giving
            them wraps the policy in `ColdRecall` whatever the name.
        **params: the policy's dataclass fields (e.g. `tau`, `protect_recent`, `sinks`);
            they win over what `budget` implies.

    Raises:
        ConfigError: unknown name, unknown parameter, or invalid values (`+recall` on a
            policy that evicts nothing); a `+reencode` name (an engine setting:
            `PolicySpec.parse` and `Engine(reencode=True)`).
    """
    check_policy_name(name)
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
    "Arkv",
    "BaseOrigin",
    "BaseQuant",
    "ConfKV",
    "ConfKVArkv",
    "ConfKVL",
    "ColdRecall",
    "FullKV",
    "H2O",
    "KVzip",
    "Policy",
    "RandomEviction",
    "SlidingWindow",
    "SnapKV",
    "check_policy_precision",
    "make_policy",
]
