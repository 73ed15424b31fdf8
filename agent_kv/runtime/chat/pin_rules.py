"""Protection rules: which token spans of a conversation are pinned (exempt from eviction
and quantization under every policy).

A conversation is a list of chat messages (`{"role", "content"}`, optionally `"pin": True`)
rendered with the model's chat template. Rules pin, in token positions of that rendering:
- every message whose role is in `roles` (default: system; add "tool" to keep every tool
  result);
- every message flagged `"pin": True`;
- the latest `latest_observations` messages whose role is in `observation_roles` (older ones
  are released when a newer one arrives): whole, or with `observation_patterns` only where
  those patterns match inside them (a page's interactive elements, say, its text left to the
  policy);
- the tools' description, with the system role, when it comes before the first message;
- every tool result (a `tool` message) answering a call of a tool named in `tool_names`,
  and, with `tool_calls`, every assistant message that calls tools (its text and calls);
- every match of the regular expressions in `patterns` (URLs, element ids...), wherever
  it occurs. Patterns are RE2 syntax, matched by RE2 (`google-re2`) in time linear in the
  text, so no pattern can backtrack catastrophically (RE2 has no backreferences or
  lookaround); at most `MAX_PATTERNS` patterns of at most `MAX_PATTERN_CHARS` characters.
`agent_kv.runtime.chat.session.ChatSession` applies them for every chat: turn by turn while a
chat extends what its cache holds (pinning what is new, releasing a superseded observation),
and from scratch when it does not. `ChatPins.choose` makes the choice over a whole rendered
conversation at once: a server turn chooses it once, sizes its KV reservation by it and hands
it to its `ChatSession`; `protected_spans` gives its spans. Messages are placed by
`agent_kv.runtime.chat.layout`, from one rendering of the chat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import re2

from agent_kv.errors import ConfigError
from agent_kv.kv.store import KVStore
from agent_kv.kv.store.pins import flag_runs
from agent_kv.runtime.chat.layout import RenderedChat, starting_tokens
from agent_kv.runtime.replies.tool_calls import TOOL_NAME_PATTERN
from agent_kv.valid_text import check_unicode

MAX_PATTERNS = 16
"""Pin patterns one set of rules may hold."""
MAX_PATTERN_CHARS = 256
"""Characters one pin pattern may have."""
PATTERN_MEMORY_BYTES = 1 << 20
"""Memory RE2 may use for one compiled pattern (RE2's `max_mem`); larger automata fail to
compile rather than grow."""

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a rule may name."""
RULE_FIELD_TYPES = {
    "roles": frozenset,
    "observation_roles": frozenset,
    "patterns": tuple,
    "observation_patterns": tuple,
    "tool_names": frozenset,
}
"""The `PinRules` fields whose JSON lists `PinRules.from_fields` converts, and to what."""


@dataclass(frozen=True)
class PinRules:
    """Which parts of a conversation to pin.

    Attributes:
        roles: roles whose messages are always pinned (default: system).
        latest_observations: how many of the newest observation messages to pin (0: none).
        observation_roles: the roles that count as observations (default: tool).
        patterns: regular expressions; every match in the rendered conversation is pinned.
        observation_patterns: regular expressions; when given, each of the latest
            observations is pinned only where one of them matches inside it, not whole (and
            released, like a whole one, when newer observations arrive).
        tool_names: tools whose results are always pinned (a `tool` message is a result of
            the tool its `tool_call_id`'s call named).
        tool_calls: pin every assistant message that makes tool calls.
    """

    roles: frozenset[str] = frozenset({"system"})
    latest_observations: int = 1
    observation_roles: frozenset[str] = frozenset({"tool"})
    patterns: tuple[str, ...] = field(default_factory=tuple)
    observation_patterns: tuple[str, ...] = field(default_factory=tuple)
    tool_names: frozenset[str] = frozenset()
    tool_calls: bool = False

    @classmethod
    def from_fields(cls, **fields) -> PinRules:
        """Checked rules from JSON fields, as the API's `pin` takes them: lists for `roles`,
        `observation_roles` (chat roles), `patterns` and `tool_names`; fields left out keep
        their defaults.

        Raises:
            ConfigError: a field the rules do not have, a value of the wrong type, a role
                that is not a chat role, a tool name that is no function name, or rules that
                cannot apply (`validate`).
        """
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"pin rules have no field {unknown[0]!r}")
        converted = {}
        for name, value in fields.items():
            if name in RULE_FIELD_TYPES:
                if not isinstance(value, list | tuple) or not all(
                    isinstance(v, str) for v in value
                ):
                    raise ConfigError(f"pin rule {name} must be a list of strings")
                value = RULE_FIELD_TYPES[name](value)
            elif name == "tool_calls" and not isinstance(value, bool):
                raise ConfigError("pin rule tool_calls must be true or false")
            elif name == "latest_observations" and type(value) is not int:
                raise ConfigError("pin rule latest_observations must be a whole number")
            converted[name] = value
        names = converted.get("tool_names", ())
        bad_names = [name for name in names if not re2.match(TOOL_NAME_PATTERN, name)]
        if bad_names:
            raise ConfigError(f"pin rule tool_names: {bad_names[0]!r} is not a function name")
        for name in ("roles", "observation_roles"):
            unknown = sorted(set(converted.get(name, ())) - set(CHAT_ROLES))
            if unknown:
                raise ConfigError(f"pin rule {name} names {unknown[0]!r}, not a chat role")
        rules = cls(**converted)
        rules.validate()
        return rules

    def validate(self) -> None:
        """Raises `ConfigError` for a negative count, more than `MAX_PATTERNS` patterns (both
        kinds together), a
        pattern longer than `MAX_PATTERN_CHARS`, or one RE2 cannot compile (bad syntax,
        backreferences, lookaround, an automaton over `PATTERN_MEMORY_BYTES`)."""
        if self.latest_observations < 0:
            raise ConfigError(f"latest_observations must be >= 0, got {self.latest_observations}")
        patterns = self.patterns + self.observation_patterns
        if len(patterns) > MAX_PATTERNS:
            raise ConfigError(f"at most {MAX_PATTERNS} pin patterns, got {len(patterns)}")
        for pattern in patterns:
            compile_pattern(pattern)

    def latest_observations_of(self, messages: list[dict]) -> list[int]:
        """The indices of the latest `latest_observations` observation messages, ascending."""
        if not self.latest_observations:
            return []
        observations = [
            i for i, message in enumerate(messages) if message["role"] in self.observation_roles
        ]
        return observations[-self.latest_observations :]

    def observation_spans(self, text: str, chars: tuple[int, int]) -> list[tuple[int, int]]:
        """The character spans of `text[chars[0]:chars[1]]` (an observation message) that
        `observation_patterns` match, non-empty ones only."""
        return [
            match.span()
            for pattern in self.observation_patterns
            for match in compile_pattern(pattern).finditer(text, *chars)
            if match.end() > match.start()
        ]

    def pinned_messages(self, messages: list[dict]) -> list[int]:
        """The indices of the messages the rules pin whole, ascending: by role, by their own
        `"pin": True`, as tool calls or results of the tools named, and the latest
        observations (unless `observation_patterns` pin only parts of them)."""
        called = {
            call.id: call.name for message in messages for call in message.get("tool_calls") or []
        }
        chosen = {
            i
            for i, message in enumerate(messages)
            if message["role"] in self.roles
            or message.get("pin")
            or (self.tool_calls and message.get("tool_calls"))
            or called.get(message.get("tool_call_id")) in self.tool_names
        }
        if not self.observation_patterns:
            chosen.update(self.latest_observations_of(messages))
        return sorted(chosen)

    def text_spans(
        self, text: str, preamble_chars: int = 0, start: int = 0
    ) -> list[tuple[int, int]]:
        """The character spans of `text[start:]` the rules pin apart from whole messages: every
        non-empty match of `patterns`, and the tools' description the rendering opens with
        (its first `preamble_chars` characters) when system messages are pinned."""
        spans = [(0, preamble_chars)] if preamble_chars and "system" in self.roles else []
        for pattern in self.patterns:
            spans += [
                match.span()
                for match in compile_pattern(pattern).finditer(text, start)
                if match.end() > match.start()
            ]
        return spans


@lru_cache(maxsize=256)
def compile_pattern(pattern: str):
    """`pattern` compiled by RE2 (linear-time matching, `PATTERN_MEMORY_BYTES` at most).

    Raises:
        ConfigError: the pattern is over `MAX_PATTERN_CHARS` characters, or RE2 cannot
            compile it.
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(
            f"pin pattern of {len(pattern)} characters: at most {MAX_PATTERN_CHARS} allowed"
        )
    check_unicode(pattern, f"pin pattern {pattern!r}")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = PATTERN_MEMORY_BYTES
    try:
        return re2.compile(pattern, options)
    except re2.error as err:
        reason = err.args[0].decode() if isinstance(err.args[0], bytes) else str(err)
        raise ConfigError(f"pin pattern {pattern!r} is not valid RE2 syntax: {reason}") from None


@dataclass(frozen=True)
class ChatPins:
    """What the rules pin over a whole rendered chat, in its token positions.

    Attributes:
        message_spans: per message, its tokens `[start, end)`: those whose first character
            lies in the message's characters.
        messages: the messages pinned whole (`PinRules.pinned_messages`), ascending.
        text: the tokens overlapping each pattern match and the pinned tools' description
            (`PinRules.text_spans`).
        observations: per latest observation, with `observation_patterns`, the tokens
            overlapping each match inside it (`PinRules.observation_spans`).
    """

    message_spans: list[tuple[int, int]]
    messages: tuple[int, ...]
    text: list[tuple[int, int]]
    observations: dict[int, list[tuple[int, int]]]

    @classmethod
    def choose(cls, chat: RenderedChat, messages: list[dict], rules: PinRules) -> ChatPins:
        """The rules' choice over `chat`, the rendering of `messages` (`placed_chat`).

        Raises:
            ConfigError: invalid rules.
        """
        rules.validate()
        message_spans = [
            starting_tokens(chat.token_starts, start, end) for start, end in chat.message_chars
        ]
        text = [chat.token_span(*span) for span in rules.text_spans(chat.text, chat.preamble_chars)]
        observations = {}
        if rules.observation_patterns:
            for i in rules.latest_observations_of(messages):
                matches = rules.observation_spans(chat.text, chat.message_chars[i])
                observations[i] = [chat.token_span(*span) for span in matches]
        return cls(
            message_spans,
            tuple(rules.pinned_messages(messages)),
            [span for span in text if span[1] > span[0]],
            {i: [span for span in spans if span[1] > span[0]] for i, spans in observations.items()},
        )

    def spans(self) -> list[tuple[int, int]]:
        """Every pinned span, in the order chosen: whole messages, text, observations' parts."""
        chosen = [self.message_spans[i] for i in self.messages] + self.text
        return chosen + [span for spans in self.observations.values() for span in spans]

    def merged(self) -> list[tuple[int, int]]:
        """The pinned tokens as sorted, merged spans `[start, end)`."""
        spans = self.spans()
        pinned = [False] * max((end for _, end in spans), default=0)
        for start, end in spans:
            pinned[start:end] = [True] * max(end - start, 0)
        return flag_runs(pinned)

    @property
    def pinned_tokens(self) -> int:
        """Tokens pinned (each counted once)."""
        return sum(end - start for start, end in self.merged())


def protected_spans(
    chat: RenderedChat, messages: list[dict], rules: PinRules
) -> list[tuple[int, int]]:
    """Token spans `[start, end)` of `chat` (the rendering of `messages`, `placed_chat`)
    that the rules pin, sorted and merged (`ChatPins.choose`).

    Raises:
        ConfigError: invalid rules.
    """
    return ChatPins.choose(chat, messages, rules).merged()


def apply_pins(store: KVStore, spans: list[tuple[int, int]], row: int = 0) -> None:
    """Make exactly `spans` pinned in the row: every other position is released. Spans may
    lie past the tokens seen so far: apply them before prefilling a prompt, so the policy
    keeps them from the first chunk on."""
    store.pins.unpin(0, max([store.seen(row), *(end for _, end in spans)]), row)
    for start, end in spans:
        store.pins.pin(start, end, row)
