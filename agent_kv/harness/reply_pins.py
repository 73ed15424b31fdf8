"""Which of the agent's own replies a policy may not evict (`AgentConfig.pin_replies`,
`--pin-replies`): a setting checked before anything heavy is imported."""

from __future__ import annotations

from agent_kv.errors import ConfigError

PIN_REPLIES = ("none", "notes", "all")
"""What `pin_replies` can pin: nothing; the note a scripted reply begins with
(`note [fact]`); or every reply, actions and notes."""


def check_pin_replies(value: str) -> None:
    """Raises ConfigError for a `pin_replies` setting outside `PIN_REPLIES`."""
    if value not in PIN_REPLIES:
        raise ConfigError(f"pin_replies must be one of {', '.join(PIN_REPLIES)}, got {value!r}")


def reply_pin(setting: str, note_tokens: int = 0) -> bool | int:
    """What to pin of one reply under `setting` (`Conversation.force_reply`'s and `reply`'s
    `pin`): True for the whole reply ("all"), the count of its first tokens that hold its
    note ("notes"; `note_tokens`, 0 for a reply without one), else nothing."""
    if setting == "all":
        return True
    return note_tokens if setting == "notes" else 0
