"""Policies on a synthetic store: budgets, protection, ranking, configuration errors."""

from __future__ import annotations

import pytest
import torch
from helpers import kept_positions, random_tokens, recorded_call

from agent_kv.errors import ConfigError
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.confidence import confidence
from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.policies import POLICIES, make_policy
from agent_kv.kv.policies.arkv import RelativeAttentionMoments
from agent_kv.kv.policies.conf_kv import ConfKV
from agent_kv.kv.policies.h2o import AccumulatedMass
from agent_kv.kv.policies.snapkv import ObservationMass
from agent_kv.kv.policy_names import declared_policies
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.store import KVStore


def store_with(tokens: int, scores: torch.Tensor | None = None) -> KVStore:
    store = KVStore(2, 2, 4)
    random_tokens(store, tokens)
    if scores is not None:
        store.fp["scores"][:, 0, :, :tokens] = scores
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
    policy.evict(store, confidence=0.1)
    assert store.lengths() == [48, 48]
    policy.evict(store, confidence=0.9)
    assert store.lengths() == [32, 32]
    policy.evict(store, confidence=0.1)  # evicted tokens never come back
    assert store.lengths() == [32, 32]


def test_conf_kv_keeps_heavy_hitters_recent_and_pinned():
    scores = torch.full((100,), 0.001)
    scores[[5, 17, 42]] = 0.5
    store = store_with(100, scores)
    store.pins.pin(0, 3)
    policy = ConfKV(n_high=16, n_low=16, protect_recent=8, recency_weight=0.0, evict_slack=0)
    evicted = policy.evict(store, confidence=1.0)
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
    store.pins.pin(90, 100)
    policy = ConfKV(n_high=9, n_low=9, protect_recent=8, recency_weight=0.0, evict_slack=0)
    policy.evict(store, confidence=1.0)
    kept = kept_positions(store)
    assert kept == [0] + list(range(82, 100))  # best heavy hitter + 8 newest unpinned + pins


def test_conf_kv_ranking_survives_an_attention_sink():
    scores = torch.full((200,), 0.001)
    scores[0] = 0.9  # a sink with most of the mass, as real models have
    scores[[20, 40, 60]] = 0.02  # heavy hitters far below the sink
    store = store_with(200, scores)
    policy = ConfKV(n_high=12, n_low=12, protect_recent=4, recency_weight=0.3, evict_slack=0)
    policy.evict(store, confidence=1.0)
    kept = set(kept_positions(store))
    assert {0, 20, 40, 60} <= kept


def test_no_signal_gets_the_loose_budget():
    policy = make_policy("conf-kv", n_high=32, n_low=48, protect_recent=4)
    assert policy.budget(None) == 48
    assert make_policy("window", budget=16).budget(None) == 16


def test_window_keeps_newest_and_sinks():
    store = store_with(50)
    policy = make_policy("window", budget=10, sinks=2, evict_slack=0)
    policy.evict(store, 0.0)
    assert kept_positions(store, 1) == [0, 1] + list(range(42, 50))


def test_window_keeps_four_attention_sinks_unless_told_none():
    store = store_with(50)
    policy = make_policy("window", budget=10, evict_slack=0)
    assert policy.sinks == 4
    policy.evict(store, 0.0)
    assert kept_positions(store) == [0, 1, 2, 3] + list(range(44, 50))
    plain = PolicySpec.parse("window", 10, None, extra=["sinks=0", "evict_slack=0"]).build(1)
    store = store_with(50)
    plain.evict(store, 0.0)
    assert kept_positions(store) == list(range(40, 50))
    with pytest.raises(ConfigError, match="protection window"):
        make_policy("window", budget=4)  # the 4 sinks fill it


def test_full_never_evicts():
    store = store_with(70)
    assert make_policy("full").evict(store, 1.0) == 0
    assert store.lengths() == [70, 70]


def test_pins_only_keeps_the_pinned_tokens_and_nothing_else():
    store = store_with(100)
    store.pins.pin(0, 10)
    store.pins.pin(60, 65)
    policy = make_policy("pins-only", protect_recent=0)
    assert (policy.budget(0.1), policy.budget(None), policy.takes_budget, policy.evicts) == (
        0,
        0,
        False,
        True,
    )
    assert policy.evict(store, None) == 2 * 85
    assert kept_positions(store) == list(range(10)) + list(range(60, 65))
    random_tokens(store, 3)  # a new call's tokens go after it has run
    assert policy.evict(store, 0.5) == 2 * 3
    assert store.lengths() == [15, 15]
    with pytest.raises(ConfigError, match="keeps pinned and recent tokens only"):
        make_policy("pins-only", sinks=4)
    with pytest.raises(ConfigError, match="takes no budget"):
        make_policy("pins-only", budget=64)


def test_pins_only_keeps_conf_kvs_recent_window_by_default():
    """The floor keeps the newest tokens CONF-KV protects (64), so a decoded answer reads the
    question and its own tokens; the older unpinned ones all go."""
    assert make_policy("pins-only").protect_recent == make_policy("conf-kv").protect_recent == 64
    store = store_with(200)
    store.pins.pin(0, 10)
    policy = make_policy("pins-only")
    assert policy.evict(store, None) == 2 * (190 - 64)
    assert kept_positions(store) == list(range(10)) + list(range(136, 200))
    random_tokens(store, 5)
    assert policy.evict(store, 0.9) == 2 * 5
    assert kept_positions(store) == list(range(10)) + list(range(141, 205))


def test_pins_never_crowd_out_the_newest_tokens():
    store = store_with(40)
    store.pins.pin(0, 20)
    make_policy("window", budget=10, evict_slack=0).evict(store, 0.0)
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
    store.fp["accumulated"][:, 0, :, :100] = 0.01
    store.fp["accumulated"][:, 0, :, [3, 30, 60]] = 5.0
    policy = make_policy("h2o", budget=20, evict_slack=0)
    assert (policy.budget_tokens, policy.protect_recent) == (20, 10)
    policy.evict(store, confidence=None)
    kept = kept_positions(store)
    assert len(kept) == 20
    assert {3, 30, 60} <= set(kept) and set(range(90, 100)) <= set(kept)


def test_random_keeps_the_budget_reproducibly():
    def kept(seed):
        store = store_with(100)
        store.pins.pin(0, 5)
        make_policy("random", budget=20, seed=seed, protect_recent=4, evict_slack=0).evict(
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
    policy.evict(store, confidence=0.99)
    assert store.lengths() == policy.layer_budgets(0.99, 3) == [150, 100, 50]


@pytest.mark.parametrize(
    "name,kwargs,message",
    [
        ("h2o", {"budget": 10, "protect_recent": 10}, "protection window"),
        ("random", {"budget": 0}, "positive number of tokens"),
        ("conf-kv-l", {"n_high": 100, "n_low": 100, "protect_recent": 64}, "deepest layer"),
        ("conf-kv-l", {"pyramid": 1.0}, "pyramid"),
        ("snapkv", {"budget": 64}, "keeps 32 tokens after an eviction .evict_slack 32."),
        ("snapkv", {"budget": 64, "evict_slack": 0, "observation_window": 0}, "observation_w"),
        ("snapkv", {"kernel": 6}, "kernel must be an odd width"),
    ],
)
def test_bad_baseline_settings(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, **kwargs)


def test_evict_slack_amortises_compaction():
    store = store_with(100)
    policy = make_policy("window", budget=40, evict_slack=8)
    assert policy.evict(store, None) == 2 * (100 - 32)
    assert store.lengths() == [32, 32]
    for added in range(1, 9):  # room for 8 more tokens before the next compaction
        random_tokens(store, 1)
        assert policy.evict(store, None) == 0
        assert store.lengths() == [32 + added] * 2
    random_tokens(store, 1)
    assert policy.evict(store, None) == 2 * 9
    assert store.lengths() == [32, 32]


def test_sinks_are_kept_by_any_policy_and_count_in_the_budget():
    scores = torch.linspace(1.0, 0.0, 60)  # the first tokens score highest...
    scores[:4] = 0.0  # ...except the sinks, which conf-kv alone would drop
    store = store_with(60, scores)
    policy = make_policy("conf-kv", n_high=20, n_low=20, protect_recent=4, sinks=4, evict_slack=0)
    policy.evict(store, 0.9)
    kept = kept_positions(store)
    assert len(kept) == 20
    assert kept[:4] == [0, 1, 2, 3] and kept[-4:] == [56, 57, 58, 59]
    with pytest.raises(ConfigError, match="sink"):
        make_policy("h2o", budget=10, protect_recent=5, sinks=5)


def test_a_small_budget_is_never_cut_below_half_by_the_slack():
    store = store_with(100)
    policy = make_policy("window", budget=20)  # default evict_slack 32
    policy.evict(store, None)
    assert store.lengths() == [10, 10]
    assert kept_positions(store) == [0, 1, 2, 3] + list(range(94, 100))  # 4 sinks by default


def test_the_torch_free_name_list_is_the_registry():
    declared = declared_policies()
    assert tuple(POLICIES) == tuple(declared)
    assert {name for name, cls in POLICIES.items() if not cls.evicts} == {
        name for name, evicts in declared.items() if not evicts
    }


def observed_store(mass: torch.Tensor, window: int) -> KVStore:
    """A two-layer store of `mass.shape[-1]` tokens fed in one call whose last `window`
    queries gave each token the attention `mass` (`[tokens]` for both KV heads, or
    `[kv_heads, tokens]`)."""
    tokens = mass.shape[-1]
    store = KVStore(2, 2, 4)
    per_head = mass.expand(2, tokens)[None].clone()  # [rows, kv_heads, tokens]
    keys, values = torch.randn(1, 2, tokens, 4), torch.randn(1, 2, tokens, 4)
    recorded_call(store, keys, values, window=per_head, observed=window)
    return store


def test_snapkv_keeps_the_tokens_the_observation_window_attends_to():
    mass = torch.full((2, 100), 0.01)
    mass[0, [10, 30]] = 1.0  # each KV head has its own heavy hitters: the mean keeps both
    mass[1, [50, 70]] = 1.0
    store = observed_store(mass, window=8)
    assert store.observed_from == [92]
    policy = make_policy("snapkv", budget=12, observation_window=8, kernel=1, evict_slack=0)
    assert policy.evict(store, confidence=0.9) == 2 * (100 - 12)
    assert kept_positions(store) == [10, 30, 50, 70] + list(range(92, 100))
    assert kept_positions(store, 1) == kept_positions(store)


def test_snapkv_pooling_keeps_the_neighbours_of_a_hit():
    mass = torch.linspace(0.001, 0.002, 100)  # faint, rising toward the window
    mass[40] = 1.0
    pooled = make_policy("snapkv", budget=15, observation_window=8, evict_slack=0)
    assert pooled.kernel == 7
    store = observed_store(mass, window=8)
    pooled.evict(store, None)
    assert kept_positions(store) == list(range(37, 44)) + list(range(92, 100))
    unpooled = make_policy("snapkv", budget=15, observation_window=8, kernel=1, evict_slack=0)
    store = observed_store(mass, window=8)
    unpooled.evict(store, None)
    assert kept_positions(store) == [40] + list(range(86, 100))


def test_snapkv_holds_its_budget_through_decode_and_compresses_again_next_turn():
    mass = torch.full((100,), 0.01)
    mass[[5, 15, 25]] = 1.0
    store = observed_store(mass, window=8)
    policy = make_policy("snapkv", budget=40, observation_window=8, kernel=1, evict_slack=8)
    assert policy.max_kept_tokens(2) == [40, 40]
    policy.evict(store, 0.5)  # the end of the prompt: the compression point
    assert store.lengths() == [32, 32]
    assert {5, 15, 25} | set(range(92, 100)) <= set(kept_positions(store))
    for _ in range(20):  # decode: one query per call, nothing scored anew
        random_tokens(store, 1)
        policy.evict(store, 0.5)
        assert max(store.lengths()) <= 40
    kept = set(kept_positions(store))
    assert {5, 15, 25} | set(range(92, 120)) <= kept  # generated tokens stay, hits too
    # the next turn's prompt: a new window scores the whole cache, the reply included
    positions = torch.cat([store.live_positions(0), torch.arange(120, 130)])  # 10 more
    assert torch.equal(store.live_positions(1), store.live_positions(0))
    mass = torch.where((positions >= 100) & (positions < 110), 0.0, 0.01)
    mass[positions == 110] = 1.0
    window = mass.expand(2, -1)[None].clone()
    # a forward call records its attention as well as its window (the attention function
    # records both; the window's mass is what SnapKV ranks by)
    recorded_call(store, torch.randn(1, 2, 10, 4), masses=window, window=window, observed=8)
    assert store.observed_from == [122]
    policy.evict(store, 0.5)
    kept = set(kept_positions(store))
    assert len(kept) == 32 and 110 in kept and set(range(122, 130)) <= kept
    assert not kept & set(range(100, 110))


def test_snapkv_keeps_pins_and_sinks_whatever_their_attention():
    mass = torch.full((100,), 0.01)
    mass[[0, 1, 20, 21, 22, 23, 24]] = 0.0
    mass[[50, 60]] = 1.0
    store = observed_store(mass, window=8)
    store.pins.pin(20, 25)
    policy = make_policy(
        "snapkv", budget=12, observation_window=8, sinks=2, kernel=1, evict_slack=0
    )
    policy.evict(store, None)
    assert kept_positions(store) == [0, 1, *range(20, 25), 50, 60, *range(92, 100)]


def test_knorm_keeps_the_keys_of_smallest_norm_scored_from_the_keys_alone():
    store = KVStore(1, 2, 4)
    norms = torch.tensor([5.0, 1.0, 4.0, 0.5, 3.0, 2.0, 6.0, 0.1, 7.0, 8.0])
    keys = torch.zeros(1, 2, 10, 4)
    keys[0, :, :, 0] = norms  # both heads, one channel: the norm is the value
    policy = make_policy("knorm", budget=4, protect_recent=1, sinks=1, evict_slack=0)
    recorded_call(store, keys, plan=policy.prepare(store))  # no attention recorded at all
    torch.testing.assert_close(store.live_meta("key_norm", 0), norms.expand(2, -1))
    policy.evict(store, None)
    # the sink (0) and the newest (9) stay, within the budget of 4: then the two smallest norms
    assert kept_positions(store) == [0, 3, 7, 9]


def test_each_policy_plans_what_its_calls_measure():
    store = store_with(4)
    snapkv = make_policy("snapkv", observation_window=16).prepare(store)
    assert (snapkv.observation_window, snapkv.profile, snapkv.recall) == (16, False, False)
    arkv = make_policy("arkv").prepare(store)
    assert (arkv.observation_window, arkv.profile) == (0, True)
    assert arkv.statistics == (RelativeAttentionMoments(),)
    h2o = make_policy("h2o").prepare(store)
    assert (h2o.observation_window, h2o.profile, h2o.maxima_pass) == (0, False, False)
    assert h2o.statistics == (AccumulatedMass(),)
    assert snapkv.statistics == (ObservationMass(),)
    assert make_policy("window").prepare(store).statistics == ()  # ranks by recency alone


@pytest.mark.parametrize("query_len,window", [(100, 8), (100, 64), (40, 8), (6, 8)])
def test_the_attention_function_measures_the_observation_window(query_len, window):
    from agent_kv.kv.attention import store_attention

    gen = torch.Generator().manual_seed(query_len + window)
    store = KVStore(1, 2, 16)
    random_tokens(store, 30)  # already cached
    keys, values = (torch.randn(1, 2, query_len, 16, generator=gen) for _ in range(2))
    plan = CallPlan(statistics=(ObservationMass(),), observation_window=window)
    call = ForwardCall.open(store, range(1), query_len, plan)
    query = torch.randn(1, 6, query_len, 16, generator=gen)  # 3 query heads per KV head
    layer = torch.nn.Module()
    layer.layer_idx = 0
    store_attention(layer, query, keys, values, None, kv_call=call)
    call.close()
    cached = store.fp["keys"][0, :1, :, : 30 + query_len].repeat_interleave(3, dim=1)
    logits = query @ cached.transpose(-1, -2) / 4.0  # [1, 6, q, L]
    visible = torch.ones(query_len, 30 + query_len, dtype=torch.bool).tril(diagonal=30)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    observed = min(query_len, window)
    expected = probs[0, :, -observed:].sum(dim=1).view(2, 3, -1).sum(dim=1)  # [kv_heads, L]
    torch.testing.assert_close(store.fp["observation_mass"][0, 0, :, : 30 + query_len], expected)
    assert store.observed_from == [30 + query_len - observed]


def test_reencode_is_a_setting_of_the_engine_named_by_a_suffix():
    spec = PolicySpec.parse("window+reencode", 64, None)
    assert (spec.name, spec.reencode, spec.label) == ("window", True, "window+reencode")
    assert not PolicySpec.parse("window", 64, None).reencode
    with pytest.raises(ConfigError, match="nothing to re-encode"):
        PolicySpec.parse("full+reencode", None, None)
    with pytest.raises(ConfigError, match="cold tier"):
        PolicySpec.parse("h2o+recall+reencode", 64, None)
    with pytest.raises(ConfigError, match="cold tier"):
        PolicySpec.parse("h2o+reencode", 64, None, recall=True)
    with pytest.raises(ConfigError, match="engine's setting"):
        make_policy("window+reencode", budget=64)
