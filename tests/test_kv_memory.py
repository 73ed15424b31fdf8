"""`KVMemory`, the one place that says how far a sequence's KV may grow under a policy: each
layer's token bound while tokens are fed, the bytes the store's buffers can reach then, and
the store bound set before every forward call."""

from __future__ import annotations

import pytest
import torch
from helpers import append_tokens

from agent_kv.kv.kv_memory import KVMemory
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import ATTENTION_WINDOW_SLACK, KVStore


def test_a_budgeted_layer_holds_its_budget_plus_a_chunk_a_window_layer_its_window():
    memory = KVMemory(prefill_chunk=64, attention_window_holds=(None, 127, None))
    h2o = make_policy("h2o", budget=100)
    # 900 tokens fed: layer 0 is held to pinned + budget + a chunk, the window layer to its
    # window plus a chunk, and layer 2 already holds more than that (evictions only shrink it)
    bounds = memory.layer_token_bounds([10, 10, 500], h2o, appended=900, pinned=20)
    assert bounds == [20 + 100 + 64, 127 + 64, 500 + 64]
    assert memory.layer_token_bounds([10, 10, 10], h2o, appended=5, pinned=20) == [15, 15, 15]
    full = make_policy("full")  # bounds no tokens: everything fed stays (but for the window)
    assert memory.layer_token_bounds([10, 10, 10], full, 900, 0) == [910, 127 + 64, 910]
    with pytest.raises(ValueError, match="3 per-layer lengths"):
        memory.layer_token_bounds([10, 10], h2o, 5, 0)


def test_the_window_hold_comes_from_the_model_config():
    config = type("Config", (), {"num_hidden_layers": 2, "sliding_window": 32})()
    config.layer_types = ["sliding_attention", "full_attention"]
    memory = KVMemory.for_model(config, 16, mixed_precision=False)
    assert memory.attention_window_holds == (32 - 1 + ATTENTION_WINDOW_SLACK, None)


def test_the_byte_bound_covers_what_the_store_reaches_and_a_cut_history_lowers_it():
    store = KVStore(2, 2, 8)
    policy = make_policy("h2o", budget=64)
    memory = KVMemory(prefill_chunk=32, attention_window_holds=(None, None))
    append_tokens(store, torch.randn(1, 2, 200, 8))
    bound = memory.allocated_bound(store.footprint(), policy, appended=500, pinned=0)
    for _ in range(500 // 32):  # feed 500 tokens a chunk at a time, evicting after each
        memory.bound_store(store, policy)
        append_tokens(store, torch.randn(1, 2, 32, 8))
        policy.evict(store, None)
        assert store.allocated_nbytes() <= bound
    cut = memory.allocated_bound(store.footprint(), policy, 10_000, 0, kept_tokens=16)
    assert cut < memory.allocated_bound(store.footprint(), make_policy("full"), 10_000, 0)


def test_before_a_call_the_store_is_bounded_by_the_policy_and_a_chunk():
    store = KVStore(1, 1, 4)
    append_tokens(store, torch.randn(1, 1, 10, 4))
    store.pins.pin(0, 3)
    KVMemory(prefill_chunk=16, attention_window_holds=(None,)).bound_store(
        store, make_policy("h2o", budget=40)
    )
    assert store.segments.bounds[0] == 3 + 40 + 16  # pinned + budget + one chunk
