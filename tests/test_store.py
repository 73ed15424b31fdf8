"""KVStore bookkeeping: append, compaction, scores, pins and exact byte accounting."""

from __future__ import annotations

import pytest
import torch
from helpers import append_tokens, kept_positions

from agent_kv.store import CAPACITY_STEP, KVStore


def filled_store(tokens: int, layers: int = 2, heads: int = 3, dim: int = 4) -> KVStore:
    store = KVStore(layers, heads, dim)
    # key channel 0 holds the token's position, so gathers can be checked
    keys = torch.arange(tokens, dtype=torch.float32).view(1, 1, tokens, 1)
    append_tokens(store, keys.expand(1, heads, tokens, dim).clone())
    return store


def live(store: KVStore, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = store.layers[layer_idx]
    return layer.keys[:, :, : layer.fp_len[0]], layer.values[:, :, : layer.fp_len[0]]


def live_tensor_bytes(store: KVStore) -> int:
    return sum(k.nbytes + v.nbytes for k, v in (live(store, i) for i in range(len(store.layers))))


def test_append_returns_live_views_and_positions():
    store = KVStore(2, 3, 4)
    keys = torch.randn(1, 3, 5, 4)
    store.begin_forward(range(1), 5)
    returned = store.append(0, keys, -keys)
    assert torch.equal(returned[0], keys) and torch.equal(returned[1], -keys)
    store.append(1, keys, -keys)
    assert store.seen_tokens == 5
    assert kept_positions(store) == [0, 1, 2, 3, 4]


def test_compact_gathers_kept_tokens_to_the_front():
    store = filled_store(10)
    store.compact(0, torch.tensor([1, 4, 9]))
    keys, values = live(store, 0)
    assert keys[0, 0, :, 0].tolist() == [1.0, 4.0, 9.0]
    assert values[0, 2, :, 3].tolist() == [-1.0, -4.0, -9.0]
    assert kept_positions(store) == [1, 4, 9]
    assert store.lengths() == [3, 10]
    assert store.evicted_tokens == 7
    # the next token still takes the next original position
    append_tokens(store, torch.zeros(1, 3, 1, 4))
    assert kept_positions(store) == [1, 4, 9, 10]


def test_bytes_are_exactly_the_live_tensors():
    store = filled_store(300)
    per_token = 2 * 2 * 3 * 4 * 4  # k+v, layers, heads, dim, fp32 bytes
    assert store.bytes_per_token() == per_token
    assert store.nbytes() == live_tensor_bytes(store) == 300 * per_token
    store.compact(1, torch.arange(0, 300, 3))
    assert store.nbytes() == live_tensor_bytes(store) == (300 + 100) * per_token // 2
    assert store.allocated_nbytes() >= store.nbytes()
    assert store.peak_bytes == 300 * per_token
    assert store.full_kv_nbytes() == 300 * per_token


def test_buffers_shrink_after_heavy_eviction():
    store = filled_store(4 * CAPACITY_STEP)
    store.compact(0, torch.arange(10))
    assert store.layers[0].capacity == CAPACITY_STEP
    assert live(store, 0)[0][0, 0, :, 0].tolist() == [float(i) for i in range(10)]


def test_scores_normalise_by_visible_queries():
    store = filled_store(4, layers=1, heads=1)
    # a 2-query chunk (tokens 2, 3) on top of 2 old tokens, group of 1
    mass = torch.tensor([[[0.8, 0.4, 0.6, 0.2]]])
    store.layers[0].scores[0, :, :2] = 1.0
    store.record_attention(0, [mass], query_len=2, group=1)
    decay = store.ema_decay
    expected = [decay + (1 - decay) * 0.4, decay + (1 - decay) * 0.2, 0.6 / 2, 0.2 / 1]
    torch.testing.assert_close(store.layers[0].scores[0, 0, :4], torch.tensor(expected))


def test_pins_follow_positions_through_compaction():
    store = filled_store(8, layers=1)
    store.pin(2, 4)
    assert store.pinned_mask(0).tolist() == [False, False, True, True, False, False, False, False]
    store.compact(0, torch.tensor([0, 3, 7]))
    assert store.pinned_mask(0).tolist() == [False, True, False]
    store.unpin(3, 4)
    assert not store.pinned_mask(0).any()


def test_rejects_bad_rows_and_shapes():
    store = KVStore(1, 3, 4, batch=2)
    with pytest.raises(ValueError, match="ascending range"):
        store.begin_forward(range(1, 3), 1)
    store.begin_forward(range(2), 1)
    with pytest.raises(ValueError, match="expected keys"):
        store.append(0, torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match="expected keys"):
        store.append(0, torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(ValueError, match="ema_decay"):
        KVStore(1, 1, 1, ema_decay=1.0)


def test_pin_spans_are_validated_and_pins_grow_with_the_episode():
    store = filled_store(4, layers=1)
    with pytest.raises(ValueError, match="invalid position span"):
        store.pin(5, 2)
    with pytest.raises(ValueError, match="invalid position span"):
        store.unpin(-1, 3)
    store.pin(1000, 1001)  # beyond the tokens seen: applies when that position arrives
    for _ in range(1000):
        append_tokens(store, torch.zeros(1, 3, 1, 4))
    mask = store.pinned_mask(0)
    assert mask.sum().item() == 1 and mask[1000]
