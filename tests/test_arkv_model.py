"""ARKV on the default model: prefill statistics, the tri-state cache within its bytes, and a
saved ARKV session resuming exactly."""

from __future__ import annotations

import torch

from agent_kv.evals.texts import licence_text
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import SequenceState
from agent_kv.runtime.replies.sampling import SamplingParams


def licence_ids(smollm, n: int) -> list[int]:
    return smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"][:n]


def test_arkv_plans_from_prefill_statistics_and_keeps_within_its_bytes(smollm):
    policy = make_policy("arkv", budget=192, protect_recent=32, evict_slack=0)
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=128)
    session = engine.new_sequence()
    engine.prefill(session, licence_ids(smollm, 700))
    store = session.store
    profile = store.profile_means()
    assert profile is not None and profile.shape == (30, 3)
    assert bool((profile[:, 0] > 0).all() and (profile[:, 0] <= 1).all())  # normalised entropy
    plans = policy.layer_plan(store, [192] * 30)
    assert len({p.original for p in plans}) > 1  # layers differ
    assert store.precision.quantized_format() == "fp8" and sum(store.quantized_lengths()) > 0
    assert len(plans) == store.num_layers
    for idx, plan in enumerate(plans):
        assert store.q.lengths[idx][0] <= plan.quantized
        assert store.length(idx, 0) <= plan.original + plan.quantized
    budget_bytes = 192 * store.bytes_per_token()
    assert store.nbytes() <= budget_bytes  # within the bytes of window 192
    # decoding over the mixed cache keeps within the bytes after every step
    for _ in range(40):
        engine.generate(session, [], SamplingParams(max_new_tokens=1))
        assert store.nbytes() <= budget_bytes


def test_a_saved_arkv_session_resumes_with_identical_logits(smollm, tmp_path):
    ids = licence_ids(smollm, 420)
    policy = make_policy("arkv", budget=128, protect_recent=16, group=8)
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=64)
    session = engine.new_sequence()
    engine.prefill(session, ids[:400])
    assert session.store.figures.quantized_tokens > 0 and session.store.figures.evicted_tokens > 0
    session.save(tmp_path / "s.pt")
    restored = SequenceState.load(tmp_path / "s.pt", smollm.model)
    assert torch.equal(restored.store.profile, session.store.profile)
    for token in ids[400:420]:
        assert torch.equal(engine.prefill(restored, [token]), engine.prefill(session, [token]))
    assert restored.store.lengths() == session.store.lengths()
    assert restored.store.quantized_lengths() == session.store.quantized_lengths()
