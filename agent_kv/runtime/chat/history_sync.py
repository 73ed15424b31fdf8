"""How a request's tokens meet the history a sequence's cache already holds: what is reused,
what is cut back, and what is prefilled again (the cache kept across turns of a chat whose
client may change its earlier history)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent_kv.runtime.engine.sequence import SequenceState


@dataclass
class HistorySync:
    """How a request's tokens were matched against its session's history.

    Attributes:
        reused_tokens: tokens of the request the cache already held (not prefilled again).
        prefilled_tokens: tokens fed for this request.
        rebuild: "none" (the request extends the history), "truncated" (the client changed
            earlier history: the cache was cut back to the divergence point, or, when
            eviction or quantization since then depended on what changed, to the longest
            intact prefix before it, `KVStore.intact_tokens`: the pinned system turn at
            least, when it comes first) or "scratch" (no token of the history could be kept:
            rebuilt from the first token).
    """

    reused_tokens: int
    prefilled_tokens: int
    rebuild: str


def prepare_history(
    session: SequenceState,
    token_ids: list[int],
    fresh: Callable[[], SequenceState],
) -> HistorySync:
    """Make `session` ready to take `token_ids[sync.reused_tokens:]` (the returned sync) as
    its next tokens, with no model call: `token_ids` (a request's whole conversation,
    tokenized) is matched token by token against `session.token_ids`; when it diverges
    before the end of the history (or stops short of it), the cache is truncated to the
    divergence point if that is exact (`KVStore.truncate`), else rebuilt from scratch on
    `fresh()` (`SequenceState.restart`). The pins are left as they were: the caller makes them
    the chat's (`agent_kv.runtime.chat.session`).

    Raises:
        ValueError: `token_ids` is empty.
    """
    store = session.store
    sync = plan_history_sync(
        session.token_ids, token_ids, store.segments.changed_at[0], store.intact_tokens()
    )
    if sync.rebuild == "truncated":
        session.store.truncate(sync.reused_tokens)
        del session.token_ids[sync.reused_tokens :]
    elif sync.rebuild == "scratch":
        session.restart(fresh)
    return sync


def plan_history_sync(
    history: list[int], token_ids: list[int], exact_from: int, intact: int = 0
) -> HistorySync:
    """How `prepare_history` meets `token_ids` in a session whose history is `history`, whose
    cache is exact back to `exact_from` tokens (`Segments.changed_at`) and holds its first
    `intact` tokens as their prefill alone would (`KVStore.intact_tokens`): extended; cut
    back to where the two diverge (keeping at least one token to re-feed, whose logits the
    reply needs) when the cut is at or past `exact_from`; else cut back to the intact prefix
    when one is left; else rebuilt from scratch.

    Raises:
        ValueError: `token_ids` is empty.
    """
    if not token_ids:
        raise ValueError("a request needs at least one token")
    common = common_prefix(history, token_ids)
    if common == len(history):
        return HistorySync(common, len(token_ids) - common, "none")
    cut = min(common, len(token_ids) - 1)
    if cut < exact_from:
        cut = min(cut, intact)
    if cut > 0:
        return HistorySync(cut, len(token_ids) - cut, "truncated")
    return HistorySync(0, len(token_ids), "scratch")


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common
