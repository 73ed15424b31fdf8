"""Policies on a synthetic store: budgets, protection, ranking, configuration errors."""

from __future__ import annotations

import pytest
import torch
from helpers import kept_positions, random_tokens

from agent_kv.errors import ConfigError
from agent_kv.kv.confidence import confidence
from agent_kv.kv.policies import POLICIES, ConfKV, make_policy
from agent_kv.kv.policy_names import POLICY_NAMES
from agent_kv.kv.store import KVStore


def store_with(tokens: int, scores: torch.Tensor | None = None) -> KVStore:
    store = KVStore(2, 2, 4)
    random_tokens(store, tokens)
    if scores is not None:
        for layer in store.layers:
            layer.scores[0, :, :tokens] = scores
    return store


def test_confidence_extremes():
    vocab = 1000
    flat = confidence(torch.zeros(vocab))
    # H_norm = 1, margin 0 -> sigmoid 0.5, p_top1 = 1/V
    assert flat.item() == pytest.approx(0.3 * 0.5 + 0.3 / vocab, abs=1e-6)
    peaked = torch.full((vocab,), -30.0)
    peaked[7] = 30.0
    assert confidence(peaked).item() == pytest.approx(1.0, abs=1e-4)
    two_way = torch.full((vocab,), -50.0)
    two_way[:2] = 10.0
    c = confidence(two_way).item()
    assert c == pytest.approx(
        0.4 * (1 - torch.log(torch.tensor(2.0)).item() / torch.log(torch.tensor(1000.0)).item())
        + 0.15
        + 0.15,
        abs=1e-4,
    )


def test_conf_kv_budget_follows_confidence_gate():
    policy = make_policy("conf-kv", n_high=32, n_low=48, tau=0.5, protect_recent=4, evict_slack=0)
    assert policy.budget(0.9) == 32
    assert policy.budget(0.1) == 48
    store = store_with(100)
    policy.step(store, confidence=0.1)
    assert store.lengths() == [48, 48]
    policy.step(store, confidence=0.9)
    assert store.lengths() == [32, 32]
    policy.step(store, confidence=0.1)  # evicted tokens never come back
    assert store.lengths() == [32, 32]


def test_conf_kv_keeps_heavy_hitters_recent_and_pinned():
    scores = torch.full((100,), 0.001)
    scores[[5, 17, 42]] = 0.5
    store = store_with(100, scores)
    store.pin(0, 3)
    policy = ConfKV(n_high=16, n_low=16, protect_recent=8, recency_weight=0.0, evict_slack=0)
    evicted = policy.step(store, confidence=1.0)
    kept = kept_positions(store)
    assert {0, 1, 2, 5, 17, 42} <= set(kept)
    assert set(range(92, 100)) <= set(kept)
    assert len(kept) == 3 + 16  # pins come on top of the budget
    assert evicted == 2 * (100 - 19)


def test_protect_recent_means_the_newest_unpinned_tokens():
    scores = torch.full((100,), 0.001)
    scores[:9] = 0.5
    scores[0] = 0.6
    store = store_with(100, scores)
    store.pin(90, 100)
    policy = ConfKV(n_high=9, n_low=9, protect_recent=8, recency_weight=0.0, evict_slack=0)
    policy.step(store, confidence=1.0)
    kept = kept_positions(store)
    assert kept == [0] + list(range(82, 100))  # best heavy hitter + 8 newest unpinned + pins


def test_conf_kv_ranking_survives_an_attention_sink():
    scores = torch.full((200,), 0.001)
    scores[0] = 0.9  # a sink with most of the mass, as real models have
    scores[[20, 40, 60]] = 0.02  # heavy hitters far below the sink
    store = store_with(200, scores)
    policy = ConfKV(n_high=12, n_low=12, protect_recent=4, recency_weight=0.3, evict_slack=0)
    policy.step(store, confidence=1.0)
    kept = set(kept_positions(store))
    assert {0, 20, 40, 60} <= kept


def test_no_signal_gets_the_loose_budget():
    policy = make_policy("conf-kv", n_high=32, n_low=48, protect_recent=4)
    assert policy.budget(None) == 48
    assert make_policy("window", budget=16).budget(None) == 16


def test_window_keeps_newest_and_sinks():
    store = store_with(50)
    policy = make_policy("window", budget=10, sinks=2, evict_slack=0)
    policy.step(store, 0.0)
    assert kept_positions(store, 1) == [0, 1] + list(range(42, 50))


def test_full_never_evicts():
    store = store_with(70)
    assert make_policy("full").step(store, 1.0) == 0
    assert store.lengths() == [70, 70]


def test_pins_never_crowd_out_the_newest_tokens():
    store = store_with(40)
    store.pin(0, 20)
    make_policy("window", budget=10, evict_slack=0).step(store, 0.0)
    assert store.lengths() == [30, 30]
    assert kept_positions(store) == list(range(20)) + list(range(30, 40))


@pytest.mark.parametrize(
    "name,kwargs,message",
    [
        ("lru", {}, "unknown policy 'lru'"),
        ("conf-kv", {"budget": 0}, "positive number of tokens"),
        ("conf-kv", {"budget": -5}, "positive number of tokens"),
        ("conf-kv", {"n_high": 128, "n_low": 96}, "must be >= n_high"),
        ("conf-kv", {"n_high": 64, "n_low": 128, "protect_recent": 64}, "protection window"),
        ("conf-kv", {"tau": 1.5}, "tau"),
        ("window", {"budget": 8, "sinks": 8}, "protection window"),
        ("full", {"budget": 10}, "takes no budget"),
        ("full", {"protect_recent": 5}, "protect_recent and evict_slack do not apply"),
        ("window", {"evict_slack": -1}, "evict_slack"),
        ("window", {"bogus": 1}, "no parameter .bogus."),
        ("conf-kv", {"budget": 100}, "too small"),
        ("random", {"seed": 1.5}, "'seed' must be int, got 1.5"),
        ("conf-kv", {"tau": "high"}, "'tau' must be float"),
        ("window", {"window": True}, "'window' must be int"),
    ],
)
def test_bad_configuration_is_a_clear_error(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, **kwargs)


def test_h2o_keeps_accumulated_heavy_hitters_and_its_recent_half():
    store = store_with(100)
    for layer in store.layers:
        layer.accumulated[0, :, :100] = 0.01
        layer.accumulated[0, :, [3, 30, 60]] = 5.0
    policy = make_policy("h2o", budget=20, evict_slack=0)
    assert (policy.budget_tokens, policy.protect_recent) == (20, 10)
    policy.step(store, confidence=None)
    kept = kept_positions(store)
    assert len(kept) == 20
    assert {3, 30, 60} <= set(kept) and set(range(90, 100)) <= set(kept)


def test_random_keeps_the_budget_reproducibly():
    def kept(seed):
        store = store_with(100)
        store.pin(0, 5)
        make_policy("random", budget=20, seed=seed, protect_recent=4, evict_slack=0).step(
            store, None
        )
        return kept_positions(store)

    first = kept(1)
    assert len(first) == 5 + 20
    assert set(range(5)) <= set(first) and set(range(96, 100)) <= set(first)
    assert first == kept(1)
    assert first != kept(2)


def test_conf_kv_l_pyramid_moves_budget_from_deep_to_shallow_layers():
    policy = make_policy(
        "conf-kv-l", n_high=100, n_low=200, protect_recent=8, pyramid=0.5, evict_slack=0
    )
    budgets = policy.layer_budgets(0.99, 30)
    assert sum(budgets) == 30 * 100
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] == 150 and budgets[-1] == 50
    assert sum(policy.layer_budgets(None, 7)) == 7 * 200
    store = KVStore(3, 2, 4)
    random_tokens(store, 400)
    policy.step(store, confidence=0.99)
    assert store.lengths() == policy.layer_budgets(0.99, 3) == [150, 100, 50]


@pytest.mark.parametrize(
    "name,kwargs,message",
    [
        ("h2o", {"budget": 10, "protect_recent": 10}, "protection window"),
        ("random", {"budget": 0}, "positive number of tokens"),
        ("conf-kv-l", {"n_high": 100, "n_low": 100, "protect_recent": 64}, "deepest layer"),
        ("conf-kv-l", {"pyramid": 1.0}, "pyramid"),
    ],
)
def test_bad_baseline_settings(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, **kwargs)


def test_evict_slack_amortises_compaction():
    store = store_with(100)
    policy = make_policy("window", budget=40, evict_slack=8)
    assert policy.step(store, None) == 2 * (100 - 32)
    assert store.lengths() == [32, 32]
    for added in range(1, 9):  # room for 8 more tokens before the next compaction
        random_tokens(store, 1)
        assert policy.step(store, None) == 0
        assert store.lengths() == [32 + added] * 2
    random_tokens(store, 1)
    assert policy.step(store, None) == 2 * 9
    assert store.lengths() == [32, 32]


def test_sinks_are_kept_by_any_policy_and_count_in_the_budget():
    scores = torch.linspace(1.0, 0.0, 60)  # the first tokens score highest...
    scores[:4] = 0.0  # ...except the sinks, which conf-kv alone would drop
    store = store_with(60, scores)
    policy = make_policy("conf-kv", n_high=20, n_low=20, protect_recent=4, sinks=4, evict_slack=0)
    policy.step(store, 0.9)
    kept = kept_positions(store)
    assert len(kept) == 20
    assert kept[:4] == [0, 1, 2, 3] and kept[-4:] == [56, 57, 58, 59]
    with pytest.raises(ConfigError, match="sink"):
        make_policy("h2o", budget=10, protect_recent=5, sinks=5)


def test_a_small_budget_is_never_cut_below_half_by_the_slack():
    store = store_with(100)
    policy = make_policy("window", budget=20)  # default evict_slack 32
    policy.step(store, None)
    assert store.lengths() == [10, 10]
    assert kept_positions(store) == list(range(90, 100))


def test_the_torch_free_name_list_is_the_registry():
    assert tuple(POLICIES) == POLICY_NAMES
