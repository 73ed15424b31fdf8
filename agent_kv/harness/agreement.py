"""Agreement with full KV: does a policy's cache change the agent's decisions?

For a task, the full-KV episode is the reference trajectory: its observations and actions.
A policy replays that trajectory teacher-forced — the same observation and action turns
enter its cache turn by turn, exactly as in an episode, the policy evicting as it would —
and at each step decodes its own next action (greedy, under the page's grammar, in the
agent's action format: text or a tool call) from its cache. Beside it, the full-KV cache
replays the same turns. Per step this gives:

- whether the policy's action equals the reference action (canonical text, `parse_action`);
- KL(full || policy) of the next-token distributions along the reference action's tokens,
  teacher-forced in both caches: KL(p || q) = sum_v p(v) (log p(v) - log q(v)) at each
  token, averaged over the action's tokens (nats).

The metric needs no browser (the observations come from the reference trace) and is defined
for any model: it separates "the cache changed the decision" from "the model is too weak
to act", which an episode's success alone cannot.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from agent_kv.harness.action_formats import ActionFormat
from agent_kv.harness.agent import AgentConfig, add_observation, observation_role, open_conversation
from agent_kv.harness.reply_pins import reply_pin
from agent_kv.runtime.engine.chat_engine import ChatEngine
from envs.actions import ActionParseError, parse_action


@dataclass(frozen=True)
class ReferenceStep:
    """One step of a reference trajectory.

    Attributes:
        observation: the page text as the environment gave it (before truncation).
        tabs: open tabs at that step.
        action: the reply the reference agent gave (the text its cache holds).
    """

    observation: str
    tabs: int
    action: str


def read_trajectory(trace_dir: Path) -> list[ReferenceStep]:
    """The steps of an episode's trace (`step_NNN.json`, as `run_episode` writes them).

    Raises:
        FileNotFoundError: the trace holds no step.
    """
    paths = sorted(trace_dir.glob("step_[0-9][0-9][0-9].json"))
    if not paths:
        raise FileNotFoundError(f"no steps in the reference trace {trace_dir}")
    steps = []
    for path in paths:
        record = json.loads(path.read_text())
        steps.append(ReferenceStep(record["observation"], record["tabs"], record["reply"]))
    return steps


def _action_text(fmt: ActionFormat, reply: str, tokenizer) -> str:
    """The action text of a reply in `fmt` (by the model of `tokenizer`); the reply itself
    when it makes no action."""
    try:
        return fmt.action(reply, tokenizer)
    except ActionParseError:
        return reply


def canonical(action: str) -> str:
    """The canonical text of an action reply; the reply itself when it does not parse."""
    try:
        return str(parse_action(action))
    except ActionParseError:
        return action.strip()


@dataclass(frozen=True)
class StepAgreement:
    """One compared step.

    Attributes:
        step: 1-based.
        reference: the full-KV action (canonical).
        action: the policy's own action (canonical).
        agree: whether they are equal.
        kl: mean KL(full || policy) over the reference action's tokens (nats).
        tokens: tokens of the reference action.
    """

    step: int
    reference: str
    action: str
    agree: bool
    kl: float
    tokens: int


def replay_agreement(
    intent: str,
    trajectory: list[ReferenceStep],
    engine: ChatEngine,
    reference: ChatEngine,
    config: AgentConfig | None = None,
) -> list[StepAgreement]:
    """Replay `trajectory` under `engine`'s policy and `reference` (full KV) side by side.

    Args:
        intent: the task's goal, as in the episode's prompt.
        trajectory: the full-KV episode's steps (`read_trajectory`).
        engine: the policy under test.
        reference: the full-KV engine (same model and tokenizer).
        config: the episode's settings (observation truncation, constrained decoding, the
            action format the trajectory was written in); decoding is greedy here whatever
            `config.sampling` says.

    Returns:
        One `StepAgreement` per step of `trajectory`.

    Raises:
        ContextOverflowError: the trajectory outgrows the model's context.
    """
    config = config or AgentConfig()
    fmt = config.action_format
    greedy = replace(config.sampling, temperature=0.0)
    chats = {
        name: open_conversation(
            chat_engine, intent, fmt, page_pins=config.page_pins, pin_examples=config.pin_examples
        )
        for name, chat_engine in (("policy", engine), ("full", reference))
    }
    previous: int | None = None
    compared = []
    for number, step in enumerate(trajectory, 1):
        distributions = {}
        for name, chat in chats.items():
            role = observation_role(fmt, previous)
            text = add_observation(chat, step.observation, intent, config, role)
            chat.prefill()
            if name == "policy":
                decoding = fmt.decoding(engine, greedy, text, step.tabs, config.constrain)
                own = _action_text(fmt, chat.fork().reply(decoding.params).text, engine.tokenizer)
            pin = reply_pin(config.pin_replies)
            forced = chat.force_reply(step.action, keep_distributions=True, pin=pin)
            distributions[name] = forced.distributions  # [tokens, vocab]
        previous = len(chats["policy"].messages) - 2  # the observation before the reply
        p, q = distributions["full"], distributions["policy"]
        kl = (p.exp() * (p - q)).sum(-1)  # [tokens]
        reference_action = canonical(_action_text(fmt, step.action, engine.tokenizer))
        compared.append(
            StepAgreement(
                step=number,
                reference=reference_action,
                action=canonical(own),
                agree=canonical(own) == reference_action,
                kl=float(kl.mean()),
                tokens=int(kl.numel()),
            )
        )
    return compared


def agreement_summary(steps: list[StepAgreement]) -> dict[str, Any]:
    """Record fields: `agreement` (share of steps, 0-1), `mean_kl` (nats, mean over steps),
    `steps_compared`, and `agreement_steps` (the per-step comparisons)."""
    if not steps:
        return {"agreement": None, "mean_kl": None, "steps_compared": 0, "agreement_steps": []}
    return {
        "agreement": sum(s.agree for s in steps) / len(steps),
        "mean_kl": float(torch.tensor([s.kl for s in steps]).mean()),
        "steps_compared": len(steps),
        "agreement_steps": [asdict(s) for s in steps],
    }
