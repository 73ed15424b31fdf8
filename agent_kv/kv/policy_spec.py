"""The settings of a policy as a user gives them (command line, a sweep's job): a name, a
budget in tokens or in KV bytes, policy parameters as `KEY=VALUE` text, mixed precision, the
positions mode and the cold tier's recall settings, checked before the model loads
(`PolicySpec.parse`) and turned into a policy once the model's bytes per token are known
(`PolicySpec.build`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent_kv.errors import ConfigError
from agent_kv.kv.policy_names import (
    REENCODE_SUFFIX,
    check_policy_name,
    split_recall,
    split_reencode,
)

if TYPE_CHECKING:  # the store imports torch: this module must not, so options fail fast
    from agent_kv.kv.cold_tier import ColdConfig
    from agent_kv.kv.store import Int8Config

UNCHECKED_BUDGET = 2**40
"""Stands in for a byte budget not yet converted to tokens when settings are checked early."""


@dataclass
class PolicySpec:
    """A policy and its store options as the command line gives them; a byte budget needs
    the model to become tokens. `name` is the policy's own name (a `+recall` suffix becomes
    `recall`, a `+reencode` suffix `reencode`: the engine's `Engine.reencode` before new
    messages); `label` names the whole setting."""

    name: str
    budget: int | None
    budget_bytes: int | None
    params: dict
    int8: Int8Config | None
    rerotate: bool
    recall: ColdConfig | None = None
    reencode: bool = False

    @property
    def label(self) -> str:
        """The policy's name, with `+recall` when the cold tier is on (`h2o+recall`) and
        `+reencode` when the engine re-encodes (`window+reencode`)."""
        recall = "+recall" if self.recall is not None else ""
        return self.name + recall + (REENCODE_SUFFIX if self.reencode else "")

    @classmethod
    def parse(
        cls,
        name: str,
        budget: int | None,
        budget_bytes: str | None,
        tau: float | None = None,
        protect_recent: int | None = None,
        int8: bool = False,
        fp_window: int | None = None,
        positions: str = "original",
        extra: list[str] | None = None,
        recall: bool = False,
        recall_params: list[str] | None = None,
    ) -> PolicySpec:
        """Check everything that can be checked before the model loads; `extra` holds
        `--param KEY=VALUE` items. `recall` (or a `+recall` name) keeps evicted tokens in a
        cold tier and recalls them (`agent_kv.kv.policies.cold_recall`), with
        `recall_params` as `KEY=VALUE` fields of `ColdConfig` (`cap_bytes` may be a size
        such as `64MB`).

        Raises:
            ConfigError: both budgets given, an unreadable size, unknown positions mode,
                `fp_window` without `int8`, a malformed `--param`, an unknown policy (these
                before torch is imported), invalid policy, INT8 or recall settings, recall
                parameters without recall, `int8` with a policy that quantizes by its own
                rule, or a `+reencode` name with recall.
        """
        from agent_kv.kv.budgets import parse_bytes

        params = {**parse_params(extra or []), "tau": tau, "protect_recent": protect_recent}
        params = {key: value for key, value in params.items() if value is not None}
        if positions not in ("original", "rerotate"):
            raise ConfigError(f"--positions must be original or rerotate, got {positions!r}")
        if fp_window is not None and not int8:
            raise ConfigError("--fp-window sets the INT8 window: it needs --int8")
        check_policy_name(name)
        named_recall = split_recall(split_reencode(name)[0])[1]
        recall_items = parse_params(recall_params or [], "--recall-param")
        if recall_items and not (recall or named_recall):
            raise ConfigError("--recall-param sets the cold tier: it needs --recall")
        int8_config = None
        if int8:
            from agent_kv.kv.store import Int8Config

            int8_config = Int8Config() if fp_window is None else Int8Config(fp_window=fp_window)
            int8_config.validate()
        return cls.checked(
            name,
            budget,
            None if budget_bytes is None else parse_bytes(budget_bytes),
            params,
            int8_config,
            positions == "rerotate",
            recall_items if recall or named_recall else None,
        )

    @classmethod
    def checked(
        cls,
        name: str,
        budget: int | None = None,
        budget_bytes: int | None = None,
        params: dict | None = None,
        int8: Int8Config | None = None,
        rerotate: bool = False,
        recall: dict | None = None,
    ) -> PolicySpec:
        """The settings, checked as far as they can be before the model loads: the one way a
        policy is built from what a user gives (the command line through `parse`, the API's
        per-turn `policy`, the LangChain model), then `build` (or
        `agent_kv.runtime.engine.policy_setup.policy_from_spec`) once the model is known.

        Args:
            name: a policy name, with `+recall` or `+reencode` if wanted.
            budget: unpinned tokens per layer; or `budget_bytes`, KV bytes (not both).
            params: the policy's dataclass fields.
            int8: the store's INT8 settings (the policy must not manage precision itself).
            rerotate: rotate kept keys to contiguous positions.
            recall: the cold tier's settings (`ColdConfig.from_params`); given, even empty,
                it turns recall on, as a `+recall` name does.

        Raises:
            ConfigError: both budgets, an unknown policy, invalid policy or recall settings,
                `int8` with a policy that quantizes by its own rule, or a `+reencode` name
                with recall.
        """
        from agent_kv.kv.cold_tier import ColdConfig
        from agent_kv.kv.policies import check_policy_precision, make_policy

        if budget is not None and budget_bytes is not None:
            raise ConfigError("give --budget or --budget-bytes, not both")
        check_policy_name(name)
        name, reencode = split_reencode(name)
        name, named_recall = split_recall(name)
        if reencode and recall is not None:
            raise ConfigError(
                f"{REENCODE_SUFFIX} starts a fresh cache without the cold tier that recall "
                "reads; choose one of the two"
            )
        cold = ColdConfig.from_params(recall or {}) if recall is not None or named_recall else None
        spec = cls(name, budget, budget_bytes, params or {}, int8, rerotate, cold, reencode)
        # a byte budget becomes tokens only once the model is known: check the rest now with
        # a budget no conversion can exceed, the real one again in `build`
        placeholder = UNCHECKED_BUDGET if budget_bytes is not None else budget
        check_policy_precision(
            make_policy(name, budget=placeholder, recall=cold, **spec.params), int8
        )
        return spec

    def build(self, bytes_per_token: int, int8_bytes_per_token: float | None = None):
        """The validated policy. A byte budget becomes tokens with the FP cost of a token over
        all layers and, with INT8 on, the INT8 cost (`budgets.tokens_for_bytes`).

        Raises:
            ConfigError: the budget holds no token, or invalid policy settings.
        """
        from agent_kv.kv.budgets import tokens_for_bytes
        from agent_kv.kv.policies import make_policy

        budget = self.budget
        if self.budget_bytes is not None:
            fp_tokens = 0 if self.int8 is None else self.int8.max_fp_tokens
            budget = tokens_for_bytes(
                self.budget_bytes, bytes_per_token, int8_bytes_per_token, fp_tokens
            )
        return make_policy(self.name, budget=budget, recall=self.recall, **self.params)


def parse_params(items: list[str], flag: str = "--param") -> dict:
    """`["gamma=0.5", "quantized=int8"]` -> `{"gamma": 0.5, "quantized": "int8"}`: each value
    read as an integer, a number, true/false, or else kept as text; `flag` names the option
    in errors.

    Raises:
        ConfigError: an item without `=` or with an empty key.
    """
    params = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} takes KEY=VALUE, got {item!r}")
        params[key.strip()] = _param_value(text.strip())
    return params


def _param_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
