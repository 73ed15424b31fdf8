"""The engine on the default model: exactness against transformers, no-op and budget properties."""

from __future__ import annotations

import pytest
import torch
from helpers import kept_positions
from transformers import AutoModelForCausalLM, DynamicCache

from agent_kv.errors import ConfigError
from agent_kv.kv.policies import Policy, make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams

PROMPT = (
    "The classifieds board lists bicycles, furniture, phones and books. "
    "A blue road bike in good condition costs 120 dollars and is sold by Maria in Oakland. "
    "A walnut desk with two drawers costs 80 dollars. Buyers message sellers through the site. "
) * 6
DECODE_STEPS = 50


@pytest.fixture(scope="module")
def prompt_ids(smollm) -> list[int]:
    ids = smollm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"][:300]
    assert len(ids) == 300
    return ids


@pytest.fixture(scope="module")
def reference(smollm, smollm_directory, prompt_ids):
    """Logits and greedy tokens from transformers' own DynamicCache + SDPA path."""
    model = AutoModelForCausalLM.from_pretrained(
        smollm_directory, attn_implementation="sdpa"
    ).eval()
    cache = DynamicCache(config=model.config)
    logits, tokens = [], []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True)
        for _ in range(DECODE_STEPS):
            step_logits = out.logits[0, -1].float()
            logits.append(step_logits)
            tokens.append(int(step_logits.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
    return torch.stack(logits), tokens


def run_engine(smollm, policy: Policy, prompt_ids, chunk: int = 128, check=None):
    """Teacher-free greedy run; returns the logits before each sampled token and the tokens."""
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=chunk)
    session = engine.new_sequence()
    logits, tokens = [engine.prefill(session, prompt_ids)], []
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        if len(tokens) < DECODE_STEPS:
            logits.append(engine.prefill(session, [tokens[-1]]))
    return torch.stack(logits), tokens, session


def test_full_policy_matches_transformers_dynamic_cache(smollm, prompt_ids, reference):
    ref_logits, ref_tokens = reference
    logits, tokens, _ = run_engine(smollm, make_policy("full"), prompt_ids)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4


def test_conf_kv_with_room_to_spare_is_a_no_op(smollm, prompt_ids):
    full_logits, full_tokens, _ = run_engine(smollm, make_policy("full"), prompt_ids)
    policy = make_policy("conf-kv", n_high=1024, n_low=2048)
    logits, tokens, session = run_engine(smollm, policy, prompt_ids)
    assert tokens == full_tokens
    assert torch.equal(logits, full_logits)
    assert session.store.figures.evicted_tokens == 0


@pytest.mark.parametrize("pins", [0, 8])
def test_tight_budget_bounds_the_cache_and_protects_recent_tokens(smollm, prompt_ids, pins):
    chunk, protect = 64, 16
    policy = make_policy("conf-kv", n_high=48, n_low=96, tau=0.5, protect_recent=protect)
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=chunk)
    session = engine.new_sequence()
    store = session.store
    store.pins.pin(0, pins)
    per_token_layer = store.bytes_per_token() // store.num_layers
    checks = []

    original_evict = policy.evict

    def checked_evict(st, conf, rows=None):
        evicted = original_evict(st, conf, rows)
        seen = st.seen_tokens
        for idx in range(st.num_layers):
            kept = set(kept_positions(st, idx))
            assert st.length(idx) <= policy.budget(conf) + pins, (
                "layer above budget + pins after a step"
            )
            assert set(range(max(0, seen - protect), seen)) <= kept, "a recent token was evicted"
            assert set(range(pins)) <= kept, "a pinned token was evicted"
        live = 2 * sum(
            st.fp["keys"][idx, 0, :, : st.fp.lengths[idx][0]].nbytes for idx in range(st.num_layers)
        )
        assert st.nbytes() == live == sum(st.lengths()) * per_token_layer
        checks.append(conf)
        return evicted

    policy.evict = checked_evict
    reply = engine.generate(session, prompt_ids, SamplingParams(max_new_tokens=DECODE_STEPS))
    fed = [t for t in reply.token_ids if t not in engine.eos_ids]
    assert len(checks) == -(-len(prompt_ids) // chunk) + len(fed)
    assert store.figures.evicted_tokens > 0
    assert store.figures.peak_bytes <= (policy.n_low + pins + chunk) * store.bytes_per_token()
    assert store.figures.peak_bytes > policy.n_high * store.bytes_per_token()
    budgets = {record.budget for record in session.steps}
    assert budgets <= {48, 96}


def test_sampling_is_seeded_and_stop_strings_cut(smollm, prompt_ids):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    first = engine.generate(engine.new_sequence(), prompt_ids[:40], params)
    second = engine.generate(engine.new_sequence(), prompt_ids[:40], params)
    assert first.token_ids == second.token_ids
    greedy = engine.generate(
        engine.new_sequence(), prompt_ids[:40], SamplingParams(max_new_tokens=12)
    )
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop = greedy.raw_text.strip().split()[1]
    cut = engine.generate(
        engine.new_sequence(), prompt_ids[:40], SamplingParams(max_new_tokens=12, stop=[stop])
    )
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and cut.raw_text.startswith(cut.text)


def test_attention_mass_reaches_the_store(smollm, prompt_ids):
    # the store records only the policy's own statistics: "full" records none, so a conf-kv
    # policy with room to spare (a no-op) ranks by, and records, the scores
    policy = make_policy("conf-kv", n_high=1024, n_low=2048)
    engine = Engine(smollm.model, smollm.tokenizer, policy)
    session = engine.new_sequence()
    engine.prefill(session, prompt_ids[:64])
    store = session.store
    for idx in range(store.num_layers):
        scores = store.live_meta("scores", idx)
        assert torch.all(scores > 0)
        # a 64-query prefill: the newest token was seen by one query per head, with all its mass
        assert scores.shape == (3, 64)


def test_decoding_after_eviction_matches_a_masked_full_forward(
    smollm, smollm_directory, prompt_ids
):
    """Kept keys keep their original positions: the next token after compaction equals a
    full-sequence forward whose last query may only see the kept tokens."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    session = engine.new_sequence()
    n = 200
    engine.prefill(session, prompt_ids[:n])
    keep = torch.tensor([p for p in range(n) if p % 3 == 0 or p >= 150])
    for idx in range(session.store.num_layers):
        session.store.compact(idx, keep)
    logits = engine.prefill(session, [prompt_ids[n]])

    reference = AutoModelForCausalLM.from_pretrained(
        smollm_directory, attn_implementation="sdpa"
    ).eval()
    mask = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()
    mask[n] = False
    mask[n, keep] = True
    mask[n, n] = True
    with torch.inference_mode():
        out = reference(
            input_ids=torch.tensor([prompt_ids[: n + 1]]), attention_mask=mask[None, None]
        )
    assert (logits - out.logits[0, -1].float()).abs().max().item() < 1e-4


def test_conf_kv_keeps_old_heavy_hitters_that_a_window_drops(smollm, prompt_ids):
    def kept_after(policy):
        engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=100)
        session = engine.new_sequence()
        engine.prefill(session, prompt_ids)
        return set(kept_positions(session.store, 15))

    window = kept_after(make_policy("window", budget=128, evict_slack=0))
    assert window == set(range(4)) | set(range(300 - 124, 300))  # 4 sinks and the newest
    for policy in (
        make_policy("conf-kv", n_high=128, n_low=128, protect_recent=16, evict_slack=0),
        make_policy("h2o", budget=128, evict_slack=0),
    ):
        kept = kept_after(policy)
        old = {p for p in kept if p < 300 - 128}
        assert len(kept) == 128
        assert 0 in old, policy.name  # the attention sink
        assert len(old) >= 16, policy.name


def test_snapkv_generates_within_its_budget_after_compressing_the_prompt(smollm, prompt_ids):
    policy = make_policy("snapkv", budget=96)  # observation window 32, evict_slack 32
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=128)
    session = engine.new_sequence()
    engine.prefill(session, prompt_ids)
    store = session.store
    assert store.observed_from == [300 - 32]  # the last chunk's last 32 queries
    with_sink = 0
    for idx in range(store.num_layers):
        positions = store.live_positions(idx)
        assert positions.numel() == 96 - 32
        assert set(range(300 - 32, 300)) <= set(positions.tolist())  # the window
        assert bool((store.live_meta("observation_mass", idx)[:, positions < 268] > 0).all())
        with_sink += int(positions[0]) == 0
    assert with_sink >= store.num_layers // 2  # kept for its attention: sinks=0 here
    question = smollm.tokenizer("\nWho sells the bike?", add_special_tokens=False)["input_ids"]
    reply = engine.generate(session, question, SamplingParams(max_new_tokens=DECODE_STEPS))
    assert reply.token_ids and store.figures.evicted_tokens > 0
    assert max(record.kv_live_bytes for record in session.steps) <= 96 * store.bytes_per_token()
    assert max(store.lengths()) <= 96


def test_end_of_turn_ids_may_be_lists(smollm, monkeypatch):
    monkeypatch.setattr(smollm.model.config, "eos_token_id", [2, 7])
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    assert {2, 7} <= engine.eos_ids


def test_score_is_the_teacher_forced_log_likelihood(smollm, smollm_directory, prompt_ids):
    model = AutoModelForCausalLM.from_pretrained(
        smollm_directory, attn_implementation="sdpa"
    ).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    targets = torch.tensor(prompt_ids[1:])
    expected = logits.log_softmax(-1)[:-1].gather(1, targets[:, None]).squeeze(1)
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    session = engine.new_sequence()
    scored = engine.score(session, prompt_ids, chunk=7)
    assert scored.shape == (len(prompt_ids) - 1,)
    assert (scored - expected).abs().max().item() < 1e-4
    assert session.token_ids == prompt_ids and session.store.seen_tokens == len(prompt_ids)
    # under a tight window the same text is predicted worse, and the cache stays bounded
    policy = make_policy("window", budget=16, evict_slack=0)
    window = Engine(smollm.model, smollm.tokenizer, policy)
    windowed = window.new_sequence()
    assert window.score(windowed, prompt_ids, chunk=8).mean() < scored.mean() - 0.5
    assert max(windowed.store.lengths()) <= 16


def test_reencode_encodes_the_kept_tokens_again_without_the_evicted_history(
    smollm, smollm_directory, prompt_ids
):
    """After eviction, a new message on a `reencode` engine reads the kept tokens as if only
    they had been fed, at their original positions: its logits equal transformers' forward
    over the kept tokens alone with those position ids, where the engine without re-encoding
    (its kept keys computed with the evicted history) differs."""

    def run(reencode: bool):
        policy = make_policy("window", budget=40, evict_slack=0)
        engine = Engine(smollm.model, smollm.tokenizer, policy, 64, reencode=reencode)
        session = engine.new_sequence()
        engine.prefill(session, prompt_ids[:200])
        kept = session.store.live_positions(0).tolist()
        before = (session.store.figures.evicted_tokens, session.store.figures.peak_allocated_bytes)
        logits = engine.prefill(session, prompt_ids[200:203])
        return kept, before, logits, session

    kept, (evicted, peak), logits, session = run(reencode=True)
    assert kept == [0, 1, 2, 3, *range(164, 200)]  # 4 sinks and the newest 36
    reference = AutoModelForCausalLM.from_pretrained(
        smollm_directory, attn_implementation="sdpa"
    ).eval()
    positions = [*kept, 200, 201, 202]
    with torch.inference_mode():
        out = reference(
            input_ids=torch.tensor([[prompt_ids[p] for p in positions]]),
            position_ids=torch.tensor([positions]),
        )
    expected = out.logits[0, -1].float()
    assert (logits - expected).abs().max().item() < 1e-4
    plain = run(reencode=False)[2]
    assert (plain - expected).abs().max().item() > 1e-2
    # the history, positions, pins and figures carry over the fresh cache
    store = session.store
    assert session.token_ids == prompt_ids[:203] and store.seen_tokens == 203
    assert store.live_positions(0).tolist() == [0, 1, 2, 3, *range(167, 203)]
    assert store.figures.evicted_tokens >= evicted and store.figures.peak_allocated_bytes >= peak
    assert session.evicted_at_reencode == evicted  # nothing evicted while re-encoding
    assert store.figures.reencoded_tokens == len(kept)
    # not due again until the cache has evicted as many tokens as it holds
    calls = []
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), reencode=True)
    engine.reencode = lambda sequence: calls.append(sequence)
    engine.prefill(engine.new_sequence(), prompt_ids[:50])
    assert calls == []  # full KV never evicts: never due
    with pytest.raises(ConfigError, match="shared prefix"):
        window = make_policy("window", budget=40)
        Engine(smollm.model, smollm.tokenizer, window, reencode=True, share_prefixes=True)
    recalling = make_policy("window+recall", budget=40)
    with pytest.raises(ConfigError, match="cold tier"):
        Engine(smollm.model, smollm.tokenizer, recalling, reencode=True)
