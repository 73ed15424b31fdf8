"""Decision agreement along a scripted trajectory: would the cache change the agent's next
action at any step of a long task?

A model that cannot finish a long task alone can still be asked, at every step of the task's
reference trajectory, what it would do next. The scripted runner
(`agent_kv.harness.scripted_episode`) replays the trajectory; with a `DecisionRecorder`,
before it forces each scripted action it first decodes the model's own next action from the
cache as it stands (greedy, under the page's action grammar, as in free navigation, on a
fork of the conversation so the replay goes on unchanged), and while it forces the scripted
reply it keeps the model's next-token distributions over the first `KL_TOKENS` tokens of the
action (after the note the reply may begin with). Full KV's run of a task is the reference:
it keeps, for each of those tokens, its `TOP_TOKENS` most likely next tokens and their log-
probabilities. A policy's run of the same task, given that record, gives per step:

- whether the policy's own action equals full KV's own action: their canonical text
  (`agreement.canonical`) with the element id written as the element the page shows
  (`element_action`: `type [textbox 'Search' #1] [lamp] [1]`), since the two runs replay the
  trajectory in two browser sessions whose element ids (Chromium's node ids) differ;
- KL(full || policy) of the next-token distributions along the same forced tokens, each
  distribution coarsened to full KV's `TOP_TOKENS` most likely tokens and one bucket for the
  rest: with S those tokens, P and Q the mass p and q give S,
  KL = sum_{v in S} p(v) (log p(v) - log q(v)) + (1 - P) (log(1 - P) - log(1 - Q)),
  averaged over the tokens compared (nats). By the data-processing inequality this is at
  most the KL of the whole distributions and equals it when S holds all of full KV's mass
  (Cover and Thomas, Elements of Information Theory, section 2.8);
- the KV bytes each cache holds at that step (allocated and live), and how many tokens back
  the task's first fact was read.

Each run writes its steps to `DECISIONS_JSON` in its trace directory (a few hundred KB for
full KV's 30 steps, a few KB for a policy's), so a sweep's records can be kept beside its
results and a later policy run compared with an earlier full-KV one.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from agent_kv.harness.action_formats import TEXT_ACTIONS
from agent_kv.harness.agent import AgentConfig
from agent_kv.harness.agreement import canonical
from agent_kv.runtime.chat.conversation import Conversation
from envs.actions import ActionParseError, parse_action

KL_TOKENS = 8
"""Tokens of each action over which the KL to full KV is taken (the action's first tokens,
after the note a reply may begin with)."""
TOP_TOKENS = 32
"""Next tokens full KV's record keeps per forced token (the KL's support, module docstring)."""
DECISIONS_JSON = "decisions.json"
ELEMENT_LINE = re.compile(r"^\s*\[(\d+)\] (\S+)(?: (['\"])(.*)\3)?", re.MULTILINE)
"""An element's line of an observation: its id, role and, when it has one, quoted name."""


def element_action(action: str, page: str) -> str:
    """`action` (canonical text) with its element id written as the element `page` (the
    observation the action answers, as shown) gives that id: its role, its name and its
    place among the page's elements of that role and name, e.g. `click [15]` ->
    `click [link 'Electronics' #1]`; `action` itself when it names no element or one the
    page does not show."""
    try:
        element_id = parse_action(action).element_id
    except ActionParseError:
        return action
    if element_id is None:
        return action
    seen: dict[tuple[str, str], int] = {}
    for line in ELEMENT_LINE.finditer(page):
        key = (line[2], line[4] or "")
        seen[key] = seen.get(key, 0) + 1
        if line[1] == str(element_id):
            element = f"{key[0]} '{key[1]}' #{seen[key]}"
            return action.replace(f"[{element_id}]", f"[{element}]", 1)
    return action


@dataclass(frozen=True)
class StepDecision:
    """The model's own decision at one step of a scripted trajectory.

    Attributes:
        step: 1-based page number of the trajectory (the page the action answers).
        action: the model's own next action, greedy (canonical text, its element written as
            the page shows it: `element_action`).
        scripted: the trajectory's action at that step (the same way).
        constrained: whether the action was decoded under the page's grammar.
        tokens_seen: tokens the cache has seen when the action is decoded (the history, the
            page and the assistant header).
        since_fact_tokens: `tokens_seen` minus its value at the page of the task's first fact
            (None before that page, or for a task without facts).
        kv_allocated_bytes: bytes the KV buffers hold at the decision.
        kv_live_bytes: live KV bytes at the decision.
        top_ids: full KV's record only: per forced token compared, its `TOP_TOKENS` most
            likely next tokens ([tokens][TOP_TOKENS]); empty in a policy's record.
        top_logprobs: their log-probabilities (nats), as `top_ids`.
        kl: a policy's record only: KL(full || policy) averaged over the forced tokens
            compared (nats; module docstring); None in full KV's record.
    """

    step: int
    action: str
    scripted: str
    constrained: bool
    tokens_seen: int
    since_fact_tokens: int | None
    kv_allocated_bytes: int
    kv_live_bytes: int
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    kl: float | None = None


def coarse_kl(top_ids: list[list[int]], top_logprobs: list[list[float]], q: torch.Tensor) -> float:
    """KL(p || q) over the distributions coarsened to p's kept tokens and the rest, averaged
    over the tokens compared (module docstring).

    Args:
        top_ids: per token, p's most likely next tokens ([n][k]).
        top_logprobs: their log-probabilities under p ([n][k], nats).
        q: [>= n, vocab] log-probabilities of the other distribution at the same tokens; only
            its first n rows are read.

    Returns:
        The mean KL in nats (0.0 when n is 0).
    """
    n = min(len(top_ids), len(q))
    if n == 0:
        return 0.0
    ids = torch.tensor(top_ids[:n])  # [n, k]
    log_p = torch.tensor(top_logprobs[:n], dtype=torch.float64)  # [n, k]
    log_q = q[:n].double().gather(1, ids)  # [n, k]
    p_top, q_top = log_p.exp(), log_q.exp()
    kl = (p_top * (log_p - log_q)).sum(1)
    rest_p = (1 - p_top.sum(1)).clamp(min=0.0)
    rest_q = (1 - q_top.sum(1)).clamp(min=1e-300)
    kl += torch.where(rest_p > 0, rest_p * (rest_p.clamp(min=1e-300).log() - rest_q.log()), 0.0)
    return float(kl.clamp(min=0.0).mean())


class DecisionRecorder:
    """Collects the model's own decision at each step of one scripted replay (see the module
    docstring) and writes them to the replay's trace directory.

    Args:
        config: the episode's settings (`constrain`, `sampling`; decoding is greedy
            whatever `config.sampling` says).
        fact_page: the page (1-based) of the task's first fact, or None.
        reference: full KV's steps of the same task (`read_decisions`), for a policy's run;
            None for full KV's own run, which keeps its top tokens instead.
    """

    def __init__(
        self,
        config: AgentConfig,
        fact_page: int | None,
        reference: list[dict[str, Any]] | None = None,
    ) -> None:
        self._config = config
        self._greedy = replace(config.sampling, temperature=0.0)
        self._fact_page = fact_page
        self._fact_tokens: int | None = None
        self._reference = {step["step"]: step for step in reference or []}
        self._keeps_top = reference is None
        self.steps: list[StepDecision] = []

    def decide(self, chat: Conversation, step: int, shown: str, tabs: int, scripted: str) -> None:
        """Prefill the queued page of `step` and decode the model's own next action on a fork
        of `chat` (the conversation itself is left with the page prefilled).

        Args:
            chat: the replay's conversation, its latest page queued.
            step: the page number (1-based).
            shown: the page as the agent sees it (its `[id]` lines make the grammar).
            tabs: open tabs.
            scripted: the action the trajectory takes there.

        Raises:
            ContextOverflowError: the page outgrows the model's context.
        """
        chat.prefill()
        store = chat.sequence.store
        if step == self._fact_page:
            self._fact_tokens = store.seen_tokens
        engine = chat.engine
        decoding = TEXT_ACTIONS.decoding(engine, self._greedy, shown, tabs, self._config.constrain)
        own = chat.fork().reply(decoding.params).text
        since = None if self._fact_tokens is None else store.seen_tokens - self._fact_tokens
        self.steps.append(
            StepDecision(
                step=step,
                action=element_action(canonical(own), shown),
                scripted=element_action(canonical(scripted), shown),
                constrained=decoding.constrained,
                tokens_seen=store.seen_tokens,
                since_fact_tokens=since,
                kv_allocated_bytes=store.allocated_nbytes(),
                kv_live_bytes=store.nbytes(),
            )
        )

    def forced(self, distributions: torch.Tensor, skip: int) -> None:
        """Take the next-token log-probabilities of the latest step's forced reply over its
        first `KL_TOKENS` tokens after the first `skip` (the note's): full KV's run keeps
        their top tokens, a policy's takes its KL from full KV's record of the same step (none
        when full KV has no such step).

        Args:
            distributions: [reply tokens, vocab] log-probabilities
                (`ForcedReply.distributions`).
            skip: tokens of the note the reply begins with (0 without one).
        """
        rows = distributions[skip : skip + KL_TOKENS].float()  # [<= KL_TOKENS, vocab]
        last = self.steps[-1]
        if self._keeps_top:
            top = rows.topk(TOP_TOKENS, dim=-1)
            kept = {
                "top_ids": top.indices.tolist(),
                "top_logprobs": [[round(x, 5) for x in row] for row in top.values.tolist()],
            }
        else:
            full = self._reference.get(last.step)
            kl = None if full is None else coarse_kl(full["top_ids"], full["top_logprobs"], rows)
            kept = {"kl": kl}
        self.steps[-1] = replace(last, **kept)

    def write(self, trace_dir: Path) -> None:
        """Write the steps to `DECISIONS_JSON` in `trace_dir`."""
        steps = [asdict(step) for step in self.steps]
        (trace_dir / DECISIONS_JSON).write_text(json.dumps(steps, separators=(",", ":")))


def read_decisions(trace_dir: Path) -> list[dict[str, Any]]:
    """A run's steps, as `DecisionRecorder.write` wrote them.

    Raises:
        FileNotFoundError: the run recorded no decisions (it ran without them, or ended
            before its first step).
    """
    path = trace_dir / DECISIONS_JSON
    if not path.exists():
        raise FileNotFoundError(f"no decisions in {trace_dir} (was its run made with them?)")
    return json.loads(path.read_text())


def compare_decisions(policy_dir: Path, full_dir: Path) -> dict[str, Any]:
    """Compare a policy's decisions with full KV's on the same task (both runs' trace
    directories; the policy's run made with full KV's record as its reference).

    Returns:
        The record fields of free navigation's agreement (`agreement.agreement_summary`), so
        a sweep's summary aggregates both alike: `agreement` (share of the steps both ran
        whose actions are equal, 0-1), `mean_kl` (nats, mean over those steps of the policy
        record's per-step KL), `steps_compared`, and `agreement_steps` (per step: `step`,
        `agree`, `kl`, `action`, `full_action`, `since_fact_tokens`, and both runs'
        `kv_allocated_bytes`).

    Raises:
        FileNotFoundError: either run recorded no decisions.
        ValueError: the runs' steps differ, or the policy's run has no KL (it was made
            without full KV's record).
    """
    full_steps = {step["step"]: step for step in read_decisions(full_dir)}
    compared = []
    for mine in read_decisions(policy_dir):
        full = full_steps.get(mine["step"])
        if full is None:
            raise ValueError(f"step {mine['step']} is not among full KV's steps")
        if mine["kl"] is None:
            raise ValueError(f"step {mine['step']} has no KL: run without full KV's record")
        compared.append(
            {
                "step": mine["step"],
                "agree": mine["action"] == full["action"],
                "kl": mine["kl"],
                "action": mine["action"],
                "full_action": full["action"],
                "since_fact_tokens": full["since_fact_tokens"],
                "kv_allocated_bytes": mine["kv_allocated_bytes"],
                "full_kv_allocated_bytes": full["kv_allocated_bytes"],
            }
        )
    if not compared:
        return {"agreement": None, "mean_kl": None, "steps_compared": 0, "agreement_steps": []}
    return {
        "agreement": sum(c["agree"] for c in compared) / len(compared),
        "mean_kl": math.fsum(c["kl"] for c in compared) / len(compared),
        "steps_compared": len(compared),
        "agreement_steps": compared,
    }
