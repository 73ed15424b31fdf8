"""Prefix sharing (`Engine(share_prefixes=True)`): the pinned token runs that sequences start
with are held once, in blocks of an engine's `PrefixCache` that every sequence of the engine
reads (`agent_kv.kv.prefix_cache`).

A sequence that holds no token of its own yet reads the leading whole blocks of its prompt
that the cache holds (`read_shared`); once its prompt was fed, the whole blocks of the pinned
run its own tokens start with go to the cache (`publish_shared`). A batch of prompts computes
their common prefix once and every row reads it (`common_blocks`, `share_computed`).
"""

from __future__ import annotations

import torch

from agent_kv.kv.prefix_cache import PrefixCache
from agent_kv.kv.store import BLOCK_TOKENS, KVStore
from agent_kv.runtime.engine.sequence import SequenceState


def prefix_cache_for(model: torch.nn.Module, rerotate: bool) -> PrefixCache | None:
    """A prefix cache for the model's sequences, or None where keys cannot be shared:
    rerotate positions, sliding-window layers. Its identity: the model's name or path, its
    weights' dtype and its stores' dtype."""
    store = KVStore.for_model(model)
    if rerotate or any(window is not None for window in store.attention_windows):
        return None
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    weights = next(model.parameters()).dtype
    identity = (
        f"{name}|{weights}|{store.dtype}|{store.num_layers}x{store.kv_heads}x{store.head_dim}"
    )
    return PrefixCache(BLOCK_TOKENS, identity.encode())


def shares(cache: PrefixCache | None, store: KVStore) -> bool:
    """Whether `store` may read the shared prefix blocks of `cache`: there is a cache, the
    store has one row, and its keys are stored as the cache's are (not rerotated)."""
    return cache is not None and store.batch == 1 and store.rotary is None


def read_shared(cache: PrefixCache | None, sequence: SequenceState, token_ids: list[int]) -> int:
    """Before `token_ids` are fed to a sequence that holds no token of its own yet: read the
    longest run of their leading whole blocks that is pinned and that `cache` holds from its
    shared blocks instead of computing it (never the last token, whose logits the feed
    needs). The sequence moves past the tokens read. Returns how many: 0 without a cache, for
    a store of several rows or one with tokens of its own."""
    store = sequence.store
    if not shares(cache, store) or store.seen(0) != store.prefix.tokens:
        return 0
    start = store.seen(0)
    pinned = store.pins.run(start, len(token_ids) - 1)
    views = cache.match(cache.digests(_last_digest(store), token_ids[:pinned]))
    if not views:
        return 0
    added = store.prefix.share(cache, views)
    sequence.token_ids.extend(token_ids[:added])
    return added


def publish_shared(cache: PrefixCache | None, sequence: SequenceState) -> int:
    """After a sequence's prompt was fed: the whole blocks of the pinned run its own tokens
    start with go to `cache` (or are found there) and the sequence reads them shared from
    then on. Returns the tokens shared; 0 without a cache."""
    store = sequence.store
    if not shares(cache, store):
        return 0
    start = store.prefix.tokens
    run = store.pins.run(start, store.seen(0) - start)
    count = run - run % cache.block_tokens
    if not count or store.q.most() or min(store.lengths(0)) < count:
        return 0
    tokens = sequence.token_ids[start : start + count]
    keys, values = store.prefix.front_tokens(count)
    views = store.prefix.views()
    parent = views[-1] if views else None
    published = cache.publish(
        parent, cache.digests(_last_digest(store), tokens), keys, values, start
    )
    store.prefix.share_front(cache, published, count)
    return count


def common_blocks(cache: PrefixCache | None, store: KVStore, prompts: list[list[int]]) -> int:
    """The tokens of the prompts' longest common prefix that a batch's empty `store` may
    read shared: in whole blocks, before every prompt's last token (whose logits each row
    needs); 0 without a cache, with rerotate, or without one whole common block."""
    if cache is None or store.rotary is not None:
        return 0
    common = 0
    limit = min(len(prompt) for prompt in prompts) - 1
    while common < limit and all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    return common - common % cache.block_tokens


def share_computed(cache: PrefixCache, store: KVStore, computed: KVStore, count: int) -> int:
    """Every row of a batch's empty `store` reads the first `count` tokens shared from the
    blocks a one-row store (`computed`, which pinned and fed them) published to `cache` (or
    found there). Returns the tokens each row reads shared: 0 when they were not published
    (every row then prefills them)."""
    views = computed.prefix.views()
    if sum(view.tokens for view in views) != count:
        return 0
    cache.retain(views)  # the batch's store reads them too
    return store.prefix.share(cache, views)


def _last_digest(store: KVStore) -> bytes:
    """The digest of the last shared block the store reads (b"" for none)."""
    views = store.prefix.views()
    return views[-1].digest if views else b""
