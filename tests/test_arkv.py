"""ARKV: FP8 storage, chosen-slot quantization, heavy-hitter statistics, the per-layer plan,
the tri-state step and its baselines, on stores driven directly (no model)."""

from __future__ import annotations

import pytest
import torch
from helpers import append_tokens, kept_positions, random_tokens, recorded_call

from agent_kv.errors import ConfigError
from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.policies import check_policy_precision, make_policy
from agent_kv.kv.policies.arkv import layer_sensitivity
from agent_kv.kv.store import Int8Config, KVStore
from kernels import fp8, int8
from kernels.torch_attention import (
    Segment,
    attention_profile,
    attention_with_mass,
    read_whole,
    segmented_attention,
)


def test_fp8_round_trip_keeps_three_mantissa_bits():
    torch.manual_seed(0)
    x = torch.randn(2, 64, 16) * torch.logspace(-2, 1, 16)  # channels of very different sizes
    q, scales = fp8.quantize_groups(x, 32)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (2, 2, 16)
    back = int8.dequantize(q, scales.repeat_interleave(32, dim=1))
    scale = scales.float().repeat_interleave(32, dim=1)
    # e4m3 rounds to 3 mantissa bits: relative error <= 2^-4 above its subnormal range
    assert bool(((back - x).abs() <= x.abs() / 16 + scale * 2.0**-9 + 1e-6).all())


def test_fp8_beats_int8_on_small_values_next_to_an_outlier():
    torch.manual_seed(1)
    x = torch.randn(1, 32, 8) * 0.01
    x[0, 0] = 5.0  # one outlier token sets every channel's scale
    errors = {}
    for name, module in (("fp8", fp8), ("int8", int8)):
        q, scales = module.quantize_groups(x, 32)
        back = int8.dequantize(q, scales.repeat_interleave(32, dim=1))
        errors[name] = (back - x)[0, 1:].abs().mean().item()
    assert errors["fp8"] < errors["int8"] / 4


def fp_store(tokens: int, layers: int = 1, heads: int = 2, dim: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    store = KVStore(layers, heads, dim)
    random_tokens(store, tokens)
    return store


def test_quantize_slots_moves_the_chosen_tokens_and_reads_back_close():
    store = fp_store(100)
    dense_keys = store.fp["keys"][0, :1, :, :100].clone()
    dense_values = store.fp["values"][0, :1, :, :100].clone()
    slots = torch.tensor([3, 7, 8, 20, 40, 41, 42, 99])
    assert store.precision.quantize_slots(0, 0, slots, group=4, fmt="fp8") == 8
    assert store.q.lengths[0][0] == 8 and store.fp.lengths[0][0] == 92
    assert store.q["keys"].dtype == torch.float8_e4m3fn
    others = [p for p in range(100) if p not in slots.tolist()]
    assert kept_positions(store) == slots.tolist() + others
    assert store.figures.quantized_tokens == 8 and store.precision.quantized_format() == "fp8"
    # 8 fp8 keys and values plus 2 groups of float16 scales, against 8 fp32 tokens
    assert store.nbytes() == 2 * 2 * 8 * (92 * 4 + 8 + 2 * 2)
    # attention over (quantized | FP) matches the dense oracle over the same tokens
    call = ForwardCall.open(store, range(1), 1)
    new_key, new_value = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    segments = [*call.segments(0), call.new_segment(new_key, new_value)]
    query = torch.randn(1, 4, 1, 8)
    order = torch.cat([slots, torch.tensor(others)])
    keys = torch.cat([dense_keys[:, :, order], new_key], dim=2)
    values = torch.cat([dense_values[:, :, order], new_value], dim=2)
    expected, expected_mass = attention_with_mass(query, keys, values, 8**-0.5)
    out, masses = segmented_attention(query, segments, 8**-0.5)
    assert torch.allclose(out, expected, atol=0.05)
    assert torch.allclose(
        torch.cat([masses[0][..., :8], masses[1][..., :92], masses[2]], -1),
        expected_mass,
        atol=0.02,
    )


def test_quantize_slots_refuses_bad_slots_and_a_second_format():
    store = fp_store(40)
    store.pins.pin(5, 6)
    with pytest.raises(ValueError, match="pinned"):
        store.precision.quantize_slots(0, 0, torch.tensor([4, 5]), 2, "fp8")
    with pytest.raises(ValueError, match="groups of 4"):
        store.precision.quantize_slots(0, 0, torch.tensor([1, 2]), 4, "fp8")
    with pytest.raises(ValueError, match="unknown quantized format"):
        store.precision.quantize_slots(0, 0, torch.tensor([1, 2]), 2, "fp4")
    store.precision.quantize_slots(0, 0, torch.tensor([1, 2]), 2, "fp8")
    with pytest.raises(ValueError, match="FP slots"):
        store.precision.quantize_slots(0, 0, torch.tensor([0, 1]), 2, "fp8")
    with pytest.raises(ConfigError, match="cannot add int8"):
        store.precision.quantize_slots(0, 0, torch.tensor([10, 11]), 2, "int8")


def test_welford_statistics_are_the_mean_and_variance_of_relative_attention():
    store = KVStore(1, 1, 4)
    append_tokens(store, torch.randn(1, 1, 3, 4))
    observed = {0: [], 1: [], 2: []}
    torch.manual_seed(2)
    for call in range(6):
        key = torch.randn(1, 1, 1, 4)
        n = 4 + call
        mass = torch.softmax(torch.randn(n), 0)  # over the 3 + call stored tokens and the new one
        recorded_call(store, key, masses=mass.view(1, 1, n))
        for token in observed:
            observed[token].append(mass[token].item() * n)
    for token, values in observed.items():
        values = torch.tensor(values)
        assert store.live_meta("hits", 0)[token].item() == 6
        mean = store.live_meta("hit_mean", 0)[0, token].item()
        assert mean == pytest.approx(values.mean().item(), rel=1e-5)
        variance = store.live_meta("hit_m2", 0)[0, token].item() / 6
        assert variance == pytest.approx(values.var(unbiased=False).item(), rel=1e-4)


def profiled_store(layer_scales: list[float], tokens: int = 48) -> KVStore:
    """A store whose layer i got prefill statistics from queries scaled by
    `layer_scales[i]` (small: flat attention; large: sharply peaked)."""
    torch.manual_seed(3)
    store = KVStore(len(layer_scales), 2, 16)
    keys = torch.randn(1, 2, tokens, 16)
    segments = [Segment(keys, keys, [tokens], causal=True)]
    query = torch.randn(1, 4, 8, 16)
    for idx, scale in enumerate(layer_scales):
        store.record_profile(idx, attention_profile(query * scale, segments, 0.25))
    return store


def test_attention_profile_tells_flat_from_peaked():
    store = profiled_store([0.05, 8.0])
    flat, peaked = store.profile_means()
    assert flat[0] > 0.99 and peaked[0] < 0.5  # normalised entropy
    assert flat[1] < 0.01 < 1.0 < peaked[1]  # log concentration
    assert flat[2] < peaked[2]  # log kurtosis


def test_attention_profile_reuses_a_whole_read_of_the_call():
    torch.manual_seed(5)
    keys = torch.randn(2, 2, 40, 16)
    segments = [Segment(keys, -keys, [40, 31], causal=True)]
    query = torch.randn(2, 4, 12, 16)  # 12 new tokens; the profile reads the last 5
    whole = read_whole(segments, 12, query.device)
    shared = attention_profile(query[:, :, -5:], segments, 0.25, whole)
    alone = attention_profile(query[:, :, -5:], segments, 0.25)
    assert torch.allclose(shared, alone)


def test_a_flatter_layer_keeps_more_original_tokens_and_a_larger_share():
    store = profiled_store([8.0, 0.05, 2.0])  # peaked, flat, between
    u = layer_sensitivity(store.profile_means(), 3)
    assert u[1] > u[2] > u[0]
    plans = make_policy("arkv", budget=256).layer_plan(store, [256, 256, 256])
    peaked, flat, _ = plans
    assert flat.original > peaked.original
    assert flat.original / (flat.original + flat.quantized) > peaked.original / (
        peaked.original + peaked.quantized
    )
    # each layer's bytes stay within its share; together within the budget's bytes
    rho = store.int8_bytes_per_token(32) / store.bytes_per_token()
    layer_bytes = [p.original + rho * p.quantized for p in plans]
    assert sum(layer_bytes) <= 3 * 256 + 1e-6
    assert layer_bytes[1] > layer_bytes[0]


def test_without_statistics_every_layer_gets_the_mean_plan():
    store = KVStore(4, 2, 16)
    policy = make_policy("arkv", budget=256, oq_ratio=0.8, group=4)
    plans = policy.layer_plan(store, [256] * 4)
    assert len(set(plans)) == 1
    original, quantized = plans[0].original, plans[0].quantized
    assert original / (original + quantized) == pytest.approx(0.8, abs=0.01)
    assert quantized % 4 == 0
    rho = store.int8_bytes_per_token(4) / store.bytes_per_token()
    room = 3 * (1 - rho)  # for the tokens waiting in FP for a whole group
    assert 255 <= original + rho * quantized + room <= 256  # the budget's bytes, in FP tokens


def scored_store(tokens: int, seed: int = 4) -> KVStore:
    """One layer of fp32 tokens whose heavy-hitter mean is a random permutation."""
    store = fp_store(tokens, seed=seed)
    store.fp["hits"][0, 0, :tokens] = 1.0
    store.fp["hit_mean"][0, 0, :, :tokens] = torch.randperm(tokens).float()
    return store


def test_tri_state_keeps_top_original_middle_quantized_and_evicts_the_rest():
    store = scored_store(400)
    score = store.fp["hit_mean"][0, 0, 0, :400].clone()
    store.pins.pin(10, 12)
    policy = make_policy("arkv", budget=256, evict_slack=0, share_spread=0.0)
    plan = policy.layer_plan(store, [256])[0]
    assert plan.quantized > 0 and plan.quantized % 8 == 0
    policy.evict(store, None)
    positions = store.live_positions(0)
    q_len = store.q.lengths[0][0]
    recent = set(range(400 - 64, 400))
    live = set(positions.tolist())
    assert {10, 11} | recent <= live  # pins and the protected window survive
    assert not ({10, 11} | recent) & set(positions[:q_len].tolist())  # ... at full precision
    unpinned = len(live) - 2
    assert unpinned == plan.original + plan.quantized and q_len == plan.quantized
    by_score = lambda ps: score[torch.tensor(sorted(ps))]  # noqa: E731
    original = set(positions[q_len:].tolist()) - recent - {10, 11}
    quantized = set(positions[:q_len].tolist())
    evicted = set(range(400)) - live
    assert by_score(original).min() > by_score(quantized).max()
    assert by_score(quantized).min() > by_score(evicted - recent).max()


def test_arkv_holds_the_bytes_of_window_at_the_same_budget():
    store, window_store = scored_store(600), scored_store(600)
    make_policy("arkv", budget=200, share_spread=0.0).evict(store, None)
    make_policy("window", budget=200).evict(window_store, None)
    assert store.nbytes() <= window_store.nbytes() * 1.05  # whole groups may wait in FP
    assert sum(store.lengths()) > sum(window_store.lengths())  # more tokens for the bytes
    assert store.quantized_lengths()[0] > 0


def test_short_contexts_are_left_alone():
    store = scored_store(100)
    assert make_policy("arkv", budget=256).evict(store, None) == 0
    assert store.quantized_lengths() == [0] and store.lengths() == [100]


def test_base_quant_quantizes_every_whole_group_and_evicts_nothing():
    store = fp_store(100)
    store.pins.pin(0, 4)
    assert make_policy("base-quant").evict(store, None) == 0
    assert store.q.lengths[0][0] == 96 and store.fp.lengths[0][0] == 4
    assert store.precision.quantized_format() == "fp8"
    assert kept_positions(store)[96:] == [0, 1, 2, 3]


def test_base_origin_never_quantizes():
    store = scored_store(600)
    make_policy("base-origin", budget=200, share_spread=0.0, evict_slack=0).evict(store, None)
    assert store.quantized_lengths() == [0] and store.lengths() == [200]


def test_conf_kv_arkv_spends_the_gated_budget():
    confident, uncertain = scored_store(900), scored_store(900)
    policy = make_policy("conf-kv+arkv", budget=400, evict_slack=0)
    policy.evict(confident, 0.95)
    policy.evict(uncertain, 0.1)
    assert confident.nbytes() < uncertain.nbytes()
    assert confident.quantized_lengths()[0] > 0


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("arkv", {"quantized": "fp4"}, "quantized must be one of"),
        ("arkv", {"oq_ratio": 0.0}, "oq_ratio"),
        ("arkv", {"share_spread": 1.0}, "share_spread"),
        ("arkv", {"gamma": -1.0}, "gamma"),
        ("base-quant", {"group": 0}, "group"),
        ("base-origin", {"oq_ratio": 0.5}, "Original"),
    ],
)
def test_bad_arkv_settings(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, budget=None if name == "base-quant" else 256, **kwargs)


def test_arkv_refuses_age_based_mixed_precision():
    for name in ("arkv", "base-quant", "base-origin", "conf-kv+arkv"):
        budget = None if name == "base-quant" else 256
        with pytest.raises(ConfigError, match="without --int8"):
            check_policy_precision(make_policy(name, budget=budget), Int8Config())
    check_policy_precision(make_policy("conf-kv", budget=256), Int8Config())
