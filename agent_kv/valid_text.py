"""Text a tokenizer or RE2 can take: a Python string can hold a lone UTF-16 surrogate (JSON's
`"\\ud800"` decodes to one), which is not Unicode text and which neither accepts."""

from __future__ import annotations

from agent_kv.errors import ConfigError


def check_unicode(text: str, what: str) -> None:
    """Raise `ConfigError` naming `what` and the position when `text` holds a lone
    surrogate (it cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ConfigError(
            f"{what} is not valid Unicode: a lone UTF-16 surrogate at character {err.start}"
        ) from None
