"""How the agent writes an action: as action text (`click [12]`, VisualWebArena's format) or
as a tool call (`run-episode --agent tools`: each browser action a function tool,
`agent_kv.harness.action_tools`).

A format gives the prompt (system message, tools listed in it, example turns), the role of
observations after the first, the decoding of each reply, and the two translations the
harness needs: a reply to the action text the environment parses (`action`), and an action
text to the reply the model would write for it (`reply`, to teacher-force reference actions).

- **text**: observations are user turns; a reply is decoded under the page's action grammar
  (`action_decoding`) and is the action itself.
- **tools**: the tools are rendered into the prompt by the chat template's tool support or
  the generic format (`agent_kv.runtime.chat.rendering`), the same tools on every page so
  the prompt stays a prefix of the cache; a reply is one call, decoded under the grammar of
  the page's tools (`page_tools`: only its element ids and tabs) with `tool_choice`
  required; the page an action leads to comes back as the call's result, a `tool` turn. A
  reply that is not exactly one call of an action with arguments of the right types (free
  decoding, `constrain=False`, or a page whose grammar cannot be built) is no action:
  `action` raises, and the harness answers it with an error observation that says how to
  call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from agent_kv.errors import GrammarError
from agent_kv.harness.action_decoding import ActionDecoding, action_decoding
from agent_kv.harness.action_tools import ACTION_TOOLS, action_call, call_action, page_tools
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_call_format import tool_call_format
from agent_kv.runtime.replies.tool_calls import (
    ReplySpec,
    Tool,
    ToolChoice,
    parse_reply,
    render_calls,
)
from envs.action_grammar import TEXT_CHARS, URL_CHARS, element_ids
from envs.actions import ACTION_FORMATS, ActionParseError, parse_action

TEXT_SYSTEM_PROMPT = (
    "You are a web agent. Each turn you get a web page as an accessibility tree "
    "([id] role 'name' per line) and a goal. Reply with exactly one action: click [id], "
    "type [id] [text], scroll [down], go_back, or stop [answer]. "
    "Reply stop [answer] when the page shows the answer.\nThe goal of this episode: {intent}"
)
TOOLS_SYSTEM_PROMPT = (
    "You are a web agent. Each turn you get a web page as an accessibility tree "
    "([id] role 'name' per line) and a goal. Act by calling exactly one function: the "
    "browser action to take. Call stop with the answer when the page shows it; the page "
    "an action leads to comes back as the function's result.\n"
    "The goal of this episode: {intent}"
)
FEW_SHOT = [
    (
        "Page:\n[5] heading 'Red chair'\n[8] StaticText 'Price: $45'\n[9] link 'Furniture'\n"
        "Goal: What is the price of the Red chair?",
        "stop [$45]",
    ),
    (
        "Page:\n[3] textbox 'Search'\n[12] link 'Phones'\n[13] link 'Books'\n"
        "Goal: Open the Phones category.",
        "click [12]",
    ),
    (
        "Page:\n[4] heading 'Green lamp'\n[6] StaticText 'Seller: '\n[7] link 'Ann Lee'\n"
        "Goal: Who sells the Green lamp?",
        "stop [Ann Lee]",
    ),
]
"""Example turns (page, action text) that teach a small model the reply format; each
format writes the action its own way. Pinned with the system prompt."""
CALL_HELP = (
    "Call exactly one function, once: the browser action to take, with its arguments as "
    "the function's parameters say."
)
"""What an error observation tells the tool agent after a reply that is no action."""
CALL_BYTES = 6 * max(TEXT_CHARS, URL_CHARS) + 256
"""An upper bound on the UTF-8 bytes of one decoded action call (a character of a JSON
string is at most a 6-byte escape; 256 covers the name, the keys and the markup), and so on
its tokens: the token cap of every tool-agent reply."""


@dataclass(frozen=True)
class ActionFormat:
    """One way of writing actions (see the module docstring).

    Attributes:
        name: "text" or "tools".
        system_prompt: the system message, with `{intent}` for the goal.
        tools: the tools listed in the prompt (none for text).
        observation_role: the role of every observation after the first (a user turn
            opens the episode).
    """

    name: str
    system_prompt: str
    tools: tuple[Tool, ...]
    observation_role: str

    def few_shot(self, tokenizer) -> list[tuple[str, str]]:
        """`FEW_SHOT` with each action written as this format's reply for the model of
        `tokenizer`."""
        return [(page, self.reply(action, tokenizer)) for page, action in FEW_SHOT]

    def decoding(
        self,
        engine: ChatEngine,
        base: SamplingParams,
        observation_text: str,
        tabs: int,
        constrain: bool,
    ) -> ActionDecoding:
        """The decoding of the next reply on a page (`action_decoding`'s arguments)."""
        if self.name == "text":
            return action_decoding(engine, base, observation_text, tabs, constrain)
        free = replace(base, stop=[], max_new_tokens=max(base.max_new_tokens, CALL_BYTES))
        if not constrain:
            return ActionDecoding(free, constrained=False)
        spec = self._page_spec(element_ids(observation_text), tabs)
        try:
            grammar = spec.grammar(tool_call_format(engine.tokenizer))
            engine.grammars.matcher(grammar)
        except GrammarError as err:
            return ActionDecoding(free, constrained=False, unconstrained_reason=str(err))
        return ActionDecoding(replace(free, grammar=grammar), True)

    def action(self, reply: str, tokenizer) -> str:
        """The action text of a reply, for the environment: the reply itself in text (the
        environment parses it); in tools the action of its one call, in the tool-call format
        of the model of `tokenizer`.

        Raises:
            ActionParseError: in tools, the reply is not exactly one call that makes an
                action; the message says how to call, for the error observation.
            ToolFormatError: in tools, the model's template has no tool-call format
                agent_kv reads.
        """
        if self.name == "text":
            return reply
        spec = ReplySpec(self.tools, ToolChoice("required"))
        _, calls = parse_reply(reply, spec, tool_call_format(tokenizer))
        if len(calls) != 1:
            found = f"{len(calls)} calls" if calls else "no complete call"
            raise ActionParseError(f"the reply holds {found}. {CALL_HELP}")
        try:
            return call_action(calls[0])
        except ValueError as err:
            raise ActionParseError(f"{err}. {CALL_HELP}") from None

    def reply(self, action: str, tokenizer) -> str:
        """The reply the model of `tokenizer` writes for an action text (a canonical call in
        its tool-call format in tools; as given in text).

        Raises:
            ActionParseError: in tools, `action` is no action.
            ValueError: in tools, it names its element by reference, not by id.
            ToolFormatError: in tools, the model's template has no tool-call format
                agent_kv reads.
        """
        if self.name == "text":
            return action
        return render_calls([action_call(parse_action(action))], tool_call_format(tokenizer))

    def _page_spec(self, ids: list[int], tabs: int) -> ReplySpec:
        return ReplySpec(page_tools(ids, tabs), ToolChoice("required"), parallel=False)


TEXT_ACTIONS = ActionFormat("text", TEXT_SYSTEM_PROMPT, (), "user")
TOOL_ACTIONS = ActionFormat("tools", TOOLS_SYSTEM_PROMPT, ACTION_TOOLS, "tool")
FORMATS = {fmt.name: fmt for fmt in (TEXT_ACTIONS, TOOL_ACTIONS)}


def action_format(agent: str) -> ActionFormat:
    """The format named `agent` (`ACTION_FORMATS`).

    Raises:
        ValueError: an unknown name.
    """
    if agent not in FORMATS:
        raise ValueError(f"unknown agent {agent!r}: choose one of {', '.join(ACTION_FORMATS)}")
    return FORMATS[agent]
