"""Each session's last prompt as rendered and tokenized, so that the next turn, whose
rendering a stateless client's resent chat makes a text extension of it, tokenizes only the
text from its generation prompt on (`agent_kv.runtime.chat.layout.placed_chat`, which splits
at an added token so the tokens are those of the whole chat) instead of the whole history.

Only a tokenization is kept here, never a cache: the tokens a turn gets are still matched
against its session's history (`agent_kv.runtime.chat.history_sync`), so a stale or missing entry
costs a full tokenization and nothing else. Entries are kept for the sessions in memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from agent_kv.runtime.chat.layout import RenderedChat


class LastPrompts:
    """The last prompt (`RenderedChat`) of each session, by session id."""

    def __init__(self, anonymous_prefix: str):
        self._anonymous_prefix = anonymous_prefix
        self._lock = threading.Lock()
        self._prompts: dict[str, RenderedChat] = {}

    def find(self, session_id: str | None, text: str) -> RenderedChat | None:
        """The prompt a turn whose rendering is `text` extends: the session's, or for a turn
        naming no session (matched to an anonymous one later), the longest of the anonymous
        sessions' that `text` starts with; None when there is none."""
        with self._lock:
            if session_id is not None:
                candidates = [self._prompts.get(session_id)]
            else:
                candidates = [
                    chat
                    for sid, chat in self._prompts.items()
                    if sid.startswith(self._anonymous_prefix)
                ]
        extended = [chat for chat in candidates if chat is not None and text.startswith(chat.text)]
        return max(extended, key=lambda chat: len(chat.text), default=None)

    def remember(self, session_id: str, chat: RenderedChat, in_memory: Iterable[str]) -> None:
        """Keep `chat` as the last prompt of `session_id`, and only those of the sessions
        `in_memory` (the others' are forgotten)."""
        kept = set(in_memory)
        with self._lock:
            self._prompts[session_id] = chat
            for sid in [sid for sid in self._prompts if sid not in kept]:
                del self._prompts[sid]

    def __len__(self) -> int:
        with self._lock:
            return len(self._prompts)
