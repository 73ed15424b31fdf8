"""The cold tier and recall: digests bound their pages, evicted tokens come back as they left
(dequantized, at their positions), bytes of both tiers are exact, a cold tier saves and
restores with its session, and with nothing evicted recall changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import append_tokens, random_tokens, recorded_call
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_kv.errors import ConfigError
from agent_kv.harness.bench import make_jobs
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.cold_tier import ColdConfig, ColdTier
from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policies.cold_recall import ColdRecall
from agent_kv.kv.policy_names import check_policy_name
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.store import KVStore
from agent_kv.runtime.engine import Engine
from agent_kv.runtime.sequence import Sequence
from envs.tasks import load_task
from kernels.int8 import quantize_groups
from kernels.page_digest import digest_bound, key_digest

TEXT = (
    "Order 1182 shipped on Monday: two lamps and a rug. The courier left a note at the door. "
    "Order 1183 is waiting for a replacement part. Customer service answers within a day. "
) * 10


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 3),
    group=st.integers(1, 3),
    tokens=st.integers(1, 40),
    dim=st.sampled_from([2, 8, 64]),
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(0.01, 100.0),
)
def test_a_digest_bounds_every_key_of_its_page(heads, group, tokens, dim, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, tokens, dim, generator=gen) * spread
    query = torch.randn(heads * group, 5, dim, generator=gen)
    kmin, kmax = key_digest(keys)
    assert (kmin <= keys.amin(1)).all() and (kmax >= keys.amax(1)).all()
    bound = digest_bound(query, kmin[None], kmax[None])[..., 0]  # [Hq, S]
    logits = torch.einsum("hsd,hnd->hsn", query, keys.repeat_interleave(group, 0))
    assert (bound + 1e-4 * (1 + bound.abs()) >= logits.amax(-1)).all()


def _store(rerotate_rotary=None, **cold) -> KVStore:
    store = KVStore(2, 2, 8, rotary=rerotate_rotary)
    store.recall.attach(ColdConfig(**cold))
    return store


def test_evicted_tokens_go_cold_in_pages_and_come_back_dequantized_at_their_positions():
    torch.manual_seed(0)
    store = _store(page_tokens=4, pages=1)
    keys, values = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    append_tokens(store, keys, values)
    keep = torch.tensor([0, 1, 2, 10, 11, 19])
    store.compact(0, keep)
    evicted = [p for p in range(20) if p not in keep.tolist()]  # 14 tokens: 4 pages of 4, 4, 3, 3
    cold = store.recall.tier
    assert [p.positions.tolist() for p in cold.pages[0][0]] == [
        [3, 4, 5, 6], [7, 8, 9, 12], [13, 14, 15], [16, 17, 18],
    ]  # fmt: skip
    assert cold.tokens(0) == len(evicted) and cold.tokens(1) == 0
    # a query that matches token 13's key picks the page holding it
    query = keys[0, :, 13:14] * 10  # [H, 1, D]
    positions, got_keys, got_values = cold.recall(0, 0, query, 1.0)
    assert positions.tolist() == [13, 14, 15]
    codes, scales = quantize_groups(keys[0, :, 13:16], 3)
    assert torch.equal(got_keys, codes.float() * scales.float())
    codes, scales = quantize_groups(values[0, :, 13:16], 3)
    assert torch.equal(got_values, codes.float() * scales.float())
    assert cold.tokens(0) == len(evicted) - 3 and cold.recalled_tokens == 3


def test_recall_puts_tokens_back_in_position_order_and_the_policy_keeps_them_first():
    torch.manual_seed(1)
    store = _store(page_tokens=4, pages=1)
    keys = torch.randn(1, 2, 16, 8)
    append_tokens(store, keys)
    store.compact(0, torch.tensor([0, 1, 14, 15]))
    store.compact(1, torch.tensor([0, 1, 14, 15]))
    # the next call's last query matches token 5's key: page [2, 3, 4, 5] comes back
    new = torch.randn(1, 2, 1, 8)
    call = ForwardCall.open(store, range(1), 1, CallPlan(recall=True))
    query = keys[:, :, 5:6] * 10  # [1, Hq = H, 1, D]
    assert store.recall.due(1, 0) is False  # decode tokens recall only with `every`
    assert store.figures.evicted_tokens == 24
    # before the layer's attention reads the store
    assert store.recall.recall(0, query, 1.0, call.rows, call.position_ids()) == 4
    assert store.figures.evicted_tokens == 20  # recalled tokens are no longer evicted
    for idx in range(2):  # each layer's attention reads its segments and stages the token
        call.segments(idx)
        call.stage(idx, new, new)
    call.close()
    assert store.live_positions(0).tolist() == [0, 1, 2, 3, 4, 5, 14, 15, 16]
    codes, scales = quantize_groups(keys[0, :, 2:6], 4)
    assert torch.equal(store.fp["keys"][0, 0, :, 2:6], codes.float() * scales.float())
    assert torch.equal(store.fp["keys"][0, 0, :, 8], new[0, :, 0])  # the newest token stays last
    assert (
        store.recall.held_mask(0).tolist() == [False, False, True, True, True, True] + [False] * 3
    )
    assert store.recall.tier.held[1][0] is None  # layer 1 has not recalled yet
    # within a budget of 6, h2o keeps the recalled tokens before its own choices
    policy = ColdRecall(make_policy("h2o", budget=6, protect_recent=1, evict_slack=0), ColdConfig())
    policy.prepare(store)
    policy.step(store, None)
    kept = store.live_positions(0).tolist()
    assert {2, 3, 4, 5, 16} <= set(kept) and len(kept) == 6


def test_both_tiers_count_their_bytes_exactly_and_apart():
    torch.manual_seed(2)
    store = _store(page_tokens=8)
    random_tokens(store, 40)
    hot_before = store.nbytes()
    store.compact(0, torch.arange(20, 40))
    heads, dim = 2, 8
    pages = store.recall.tier.pages[0][0]
    assert [p.positions.numel() for p in pages] == [7, 7, 6]
    codes = 20 * heads * dim * 2  # keys and values, one byte per channel
    scales = 3 * heads * dim * 2 * 2  # one float16 per head and channel, keys and values
    digests = 3 * heads * dim * 2 * 4  # float32 min and max
    assert store.recall.nbytes() == codes + scales + digests == store.recall.tier.peak_bytes
    assert store.nbytes() == hot_before - 20 * heads * dim * 2 * 4  # float32 hot tokens


def test_the_cold_tier_drops_its_oldest_pages_past_its_cap():
    torch.manual_seed(3)
    store = KVStore(1, 1, 4)
    page_bytes = 4 * 4 * 2 + 4 * 2 * 2 + 4 * 2 * 4  # a 4-token page
    store.recall.attach(ColdConfig(page_tokens=4, cap_bytes=2 * page_bytes))
    random_tokens(store, 16)
    store.compact(0, torch.arange(12, 16))  # 12 evicted: 3 pages, the oldest dropped
    assert [p.positions.tolist()[0] for p in store.recall.tier.pages[0][0]] == [4, 8]
    assert store.recall.tier.dropped_tokens == 4 and store.recall.nbytes() == 2 * page_bytes


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="page_tokens"):
        ColdConfig(page_tokens=0).validate()
    with pytest.raises(ConfigError, match="score"):
        ColdConfig(score="best").validate()
    with pytest.raises(ConfigError, match="fmt"):
        ColdConfig(fmt="int4").validate()
    with pytest.raises(ConfigError, match="holds nothing"):
        ColdConfig(cap_bytes=0).validate()
    with pytest.raises(ConfigError, match="nothing to recall"):
        ColdRecall(make_policy("full"), ColdConfig())
    inner = make_policy("h2o", budget=64)
    with pytest.raises(ConfigError, match="once"):
        ColdRecall(ColdRecall(inner, ColdConfig()), ColdConfig())
    assert ColdRecall(inner, ColdConfig()).name == "h2o+recall"


def test_without_recall_evictions_are_final_even_on_a_store_with_a_tier():
    store = _store()
    random_tokens(store, 10)
    plan = make_policy("h2o", budget=4, protect_recent=1, evict_slack=0).prepare(store)
    assert not plan.recall
    recorded_call(store, torch.randn(1, 2, 1, 8), plan=plan)  # a call of that policy
    store.compact(0, torch.arange(5, 11))
    assert store.recall.tier.tokens(0) == 0 and store.recall.held_mask(0) is None


@pytest.mark.model
@pytest.mark.parametrize("rerotate", [False, True])
def test_with_budgets_above_the_sequence_recall_changes_nothing(smollm, rerotate):
    ids = smollm.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:200]
    plain = Engine(smollm.model, smollm.tokenizer, make_policy("h2o", budget=4096), 64)
    wrapped = ColdRecall(make_policy("h2o", budget=4096), ColdConfig())
    recall = Engine(smollm.model, smollm.tokenizer, wrapped, 64, rerotate=rerotate)
    full = Engine(smollm.model, smollm.tokenizer, make_policy("full"), 64)
    sessions = [e.new_sequence() for e in (plain, recall, full)]
    logits = [e.feed(s, ids) for e, s in zip((plain, recall, full), sessions, strict=True)]
    assert torch.allclose(logits[1], logits[2], atol=1e-4) and torch.equal(logits[0], logits[2])
    for token in ids[:10]:
        step = [e.feed(s, [token]) for e, s in zip((recall, full), sessions[1:], strict=True)]
        assert torch.allclose(step[0], step[1], atol=1e-4)
    assert (
        sessions[1].store.recall.nbytes() == 0
        and sessions[1].store.recall.tier.recalled_tokens == 0
    )


@pytest.mark.model
@pytest.mark.parametrize("rerotate", [False, True])
def test_a_session_with_a_cold_tier_saves_restores_and_continues_identically(
    smollm, tmp_path, rerotate
):
    ids = smollm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    policy = ColdRecall(make_policy("h2o", budget=96), ColdConfig(page_tokens=16, pages=2))
    engine = Engine(smollm.model, smollm.tokenizer, policy, 64, rerotate=rerotate)
    session = engine.new_sequence()
    engine.feed(session, ids[:300])
    cold = session.store.recall.tier
    assert cold.recalled_tokens > 0 and session.store.recall.nbytes() > 0
    session.save(tmp_path / "s.pt")
    restored = Sequence.load(tmp_path / "s.pt", smollm.model)
    assert restored.store.recall.nbytes() == session.store.recall.nbytes()
    assert isinstance(restored.store.recall.tier, ColdTier)
    more = ids[300:364]
    assert torch.equal(engine.feed(restored, more), engine.feed(session, more))  # recalls again
    for token in ids[364:370]:
        assert torch.equal(engine.feed(restored, [token]), engine.feed(session, [token]))
    assert restored.store.lengths() == session.store.lengths()
    assert restored.store.recall.tier.recalled_tokens == session.store.recall.tier.recalled_tokens


def test_recall_settings_come_from_the_command_line_and_policy_names():
    spec = PolicySpec.parse(
        "h2o", 256, None, recall=True, recall_params=["pages=2", "cap_bytes=1MB", "score=digest"]
    )
    assert spec.recall == ColdConfig(pages=2, cap_bytes=1_000_000, score="digest")
    policy = spec.build(bytes_per_token=1)
    assert isinstance(policy, ColdRecall) and policy.inner.budget_tokens == 256
    assert policy.params()["recall"]["pages"] == 2
    named = PolicySpec.parse("conf-kv+recall", 512, None)
    assert named.name == "conf-kv" and named.recall == ColdConfig()
    assert named.label == "conf-kv+recall" and spec.label == "h2o+recall"
    with pytest.raises(ConfigError, match="--recall-param takes KEY=VALUE"):
        PolicySpec.parse("h2o", 256, None, recall=True, recall_params=["pages"])
    with pytest.raises(ConfigError, match="needs --recall"):
        PolicySpec.parse("h2o", 256, None, recall_params=["pages=2"])
    with pytest.raises(ConfigError, match="no parameter 'page'"):
        PolicySpec.parse("h2o", 256, None, recall=True, recall_params=["page=2"])
    with pytest.raises(ConfigError, match="nothing to recall"):
        PolicySpec.parse("full+recall", None, None)
    with pytest.raises(ConfigError, match=r"\+recall"):
        check_policy_name("h2o+recal")
    jobs = make_jobs([load_task("401")], ["full", "h2o+recall"], [256])
    assert [(j.policy, j.budget) for j in jobs] == [("full", None), ("h2o+recall", 256)]
