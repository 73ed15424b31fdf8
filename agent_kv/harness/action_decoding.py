"""How the agent decodes an action: under the action grammar of the page it sees, or freely.

Constrained (the default), the reply is drawn token by token from the actions the page
allows (`envs.action_grammar`: element ids of the observation as shown, the open tabs,
bounded free text), so it always parses; the token cap is raised to the grammar's longest
action so a reply cannot be cut short. A page whose grammar cannot be built (too many ids,
or a grammar llguidance refuses) is decoded freely, and the reason is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from agent_kv.errors import GrammarError
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.replies.grammar import Grammar
from agent_kv.runtime.replies.sampling import SamplingParams
from envs.action_grammar import ActionGrammarError, action_grammar, element_ids


@dataclass(frozen=True)
class ActionDecoding:
    """The decoding of one step.

    Attributes:
        params: the sampling parameters of the reply (with the page's grammar when
            constrained).
        constrained: whether the reply is decoded under the action grammar.
        unconstrained_reason: why a reply meant to be constrained is not (None otherwise).
    """

    params: SamplingParams
    constrained: bool
    unconstrained_reason: str | None = None

    def record(self) -> dict:
        """The step-record fields: `constrained` and `unconstrained_reason`."""
        return {"constrained": self.constrained, "unconstrained_reason": self.unconstrained_reason}


def action_decoding(
    engine: ChatEngine, base: SamplingParams, observation_text: str, tabs: int, constrain: bool
) -> ActionDecoding:
    """The decoding of the agent's next action on a page.

    Args:
        engine: builds (and here checks) the grammar against its tokenizer.
        base: the episode's sampling parameters.
        observation_text: the observation as the agent sees it (after truncation): its
            `[id]` lines are the ids the grammar allows.
        tabs: open tabs.
        constrain: False decodes freely (the `--no-constrain` comparison).
    """
    if not constrain:
        return ActionDecoding(base, constrained=False)
    try:
        grammar = action_grammar(element_ids(observation_text), tabs)
        constraint = Grammar("lark", grammar.lark)
        engine.grammars.matcher(constraint)  # ~2 ms: a refused grammar falls back here
    except (ActionGrammarError, GrammarError) as err:
        return ActionDecoding(base, constrained=False, unconstrained_reason=str(err))
    tokens = max(base.max_new_tokens, grammar.max_bytes + 1)
    params = replace(base, grammar=constraint, max_new_tokens=tokens)
    return ActionDecoding(params, constrained=True)
