"""A policy and its store options set up for a model, at configuration time: the policy a
`PolicySpec` names, its byte budget turned into tokens at the model's cost per token
(`policy_from_spec`), and the check that a sequence's store options suit the policy and the
model (`check_store_options`). Both engines and the front ends that take a policy per request
use them."""

from __future__ import annotations

import torch

from agent_kv.kv.policies import Policy, check_policy_precision
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.rope import Rotary
from agent_kv.kv.store import Int8Config, KVStore


def policy_from_spec(spec: PolicySpec, model: torch.nn.Module) -> Policy:
    """The policy of `spec` for `model`: a byte budget becomes tokens at the model's FP cost
    per token and, with INT8, its INT8 cost.

    Raises:
        ConfigError: the budget holds no token, or invalid policy settings.
    """
    shape = KVStore.for_model(model)
    int8_cost = None if spec.int8 is None else shape.int8_bytes_per_token(spec.int8.group)
    return spec.build(shape.bytes_per_token(), int8_cost)


def check_store_options(
    model: torch.nn.Module, policy: Policy, int8: Int8Config | None, rerotate: bool
) -> None:
    """Check a sequence's store options against its policy and model, at configuration time.

    Raises:
        ConfigError: invalid `int8` settings, a policy that manages its own precision with
            `int8`, or `rerotate` on a model without rotary embeddings.
    """
    if int8 is not None:
        int8.validate()
    check_policy_precision(policy, int8)
    if rerotate:
        Rotary.from_model(model)
