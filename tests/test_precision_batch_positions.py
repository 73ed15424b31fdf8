"""On the default model: INT8 mixed precision, batched decoding, and rerotate positions."""

from __future__ import annotations

import pytest
import torch

from agent_kv.errors import ContextOverflowError
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams

TEXT = (
    "Listing 4412: a blue road bike, 56 cm frame, new tyres, sold by Maria in Oakland for 120 "
    "dollars. Listing 4413: a walnut desk with two drawers, 80 dollars, pickup only. Listing "
    "4414: a used phone with a cracked screen, 45 dollars. Buyers message sellers through the "
    "site and meet in public places. "
) * 12


def token_ids(smollm, text: str) -> list[int]:
    return smollm.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("steps", [50, pytest.param(150, marks=pytest.mark.slow)])
def test_int8_storage_changes_little_and_holds_fewer_bytes(smollm, steps):
    """400 tokens prefilled, then `steps` decode steps compared, FP against INT8."""
    ids = token_ids(smollm, TEXT)[: 400 + steps]
    runs = {}
    for label, int8 in (("fp", None), ("int8", Int8Config(fp_window=64, group=32))):
        engine = Engine(
            smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=384), 128, int8
        )
        session = engine.new_sequence()
        engine.prefill(session, ids[:400])
        logits = [engine.prefill(session, [t]) for t in ids[400:]]
        runs[label] = (torch.stack(logits), session.store)
    (fp_logits, fp_store), (q_logits, q_store) = runs["fp"], runs["int8"]
    assert q_store.lengths() == fp_store.lengths()  # same tokens kept, other precision
    assert min(q_store.quantized_lengths()) > 0
    assert q_store.nbytes() < 0.75 * fp_store.nbytes()
    fp_logp, q_logp = fp_logits.log_softmax(-1), q_logits.log_softmax(-1)
    kl = (fp_logp.exp() * (fp_logp - q_logp)).sum(-1)  # [steps] per decode step
    assert kl.mean() < 0.01
    agree = (fp_logits.argmax(-1) == q_logits.argmax(-1)).float().mean()
    assert agree > 0.95


def test_batched_decoding_equals_row_by_row(smollm):
    ids = token_ids(smollm, TEXT)
    prompts = [ids[:150], ids[40:420], ids[500:560]]
    engine = Engine(
        smollm.model,
        smollm.tokenizer,
        make_policy("conf-kv", budget=192, protect_recent=32),
        prefill_chunk=128,
        int8=Int8Config(fp_window=32, group=16),
    )
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)
    batched = engine.generate_batch(prompts, params)
    for row, prompt in enumerate(prompts):
        session = engine.new_sequence()
        alone = engine.generate(session, prompt, params)
        assert batched.generations[row].token_ids == alone.token_ids
        assert batched.store.lengths(row) == session.store.lengths()
        assert batched.store.quantized_lengths(row) == session.store.quantized_lengths()
        assert batched.store.nbytes(row) == session.store.nbytes()
        # each row has its own sawtooth: the same per-step bytes as when run alone
        assert [s.kv_live_bytes for s in batched.steps[row]] == [
            s.kv_live_bytes for s in session.steps
        ]
    assert len({batched.store.nbytes(row) for row in range(3)}) > 1  # ragged rows


@pytest.mark.parametrize("steps", [30, pytest.param(100, marks=pytest.mark.slow)])
def test_rerotate_without_eviction_matches_original_positions(smollm, steps):
    """300 tokens prefilled, then `steps` decode steps, in rerotate and original positions."""
    ids = token_ids(smollm, TEXT)[: 300 + steps]
    logits = []
    for rerotate in (False, True):
        engine = Engine(
            smollm.model, smollm.tokenizer, make_policy("full"), 128, None, rerotate=rerotate
        )
        session = engine.new_sequence()
        logits.append(
            torch.stack(
                [
                    engine.prefill(session, ids[:300]),
                    *[engine.prefill(session, [t]) for t in ids[300:]],
                ]
            )
        )
    assert (logits[0] - logits[1]).abs().max() < 1e-3


@pytest.mark.parametrize(
    ("context", "stream_tokens", "budget", "chunk"),
    [(2048, 3000, 512, 256), pytest.param(None, 12_000, 2048, 512, marks=pytest.mark.slow)],
    ids=["2048-context", "8192-context"],
)
def test_rerotate_runs_past_the_trained_context_and_keeps_a_pinned_fact(
    smollm, monkeypatch, context, stream_tokens, budget, chunk
):
    """A 12K-token stream under a 2K budget: beyond SmolLM2's 8192-token context. The
    default run: 3,000 tokens under a 512 budget, the model's config declaring a 2048-token
    context."""
    if context is not None:
        monkeypatch.setattr(smollm.model.config, "max_position_embeddings", context)
    head = token_ids(
        smollm,
        "There is important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it.\nThe pass key is 4817. Remember it. 4817 is the pass key.\n",
    )
    filler = token_ids(
        smollm, " The grass is green. The sky is blue. The sun is yellow. Here we go." * 900
    )
    question = token_ids(smollm, "\nWhat is the pass key? The pass key is")
    engine = Engine(
        smollm.model,
        smollm.tokenizer,
        make_policy("conf-kv", budget=budget),
        prefill_chunk=chunk,
        int8=Int8Config(),
        rerotate=True,
    )
    session = engine.new_sequence()
    session.store.pins.pin(0, len(head))
    stream = head + filler[: stream_tokens - len(head)]
    assert len(stream) == stream_tokens > smollm.model.config.max_position_embeddings
    engine.prefill(session, stream)
    assert torch.isfinite(session.last_logits).all()
    assert max(session.store.lengths()) <= budget + chunk + len(head)
    reply = engine.generate(session, question, SamplingParams(max_new_tokens=6))
    assert reply.text.strip().startswith("4817")
    assert session.store.seen_tokens > stream_tokens


def test_a_short_row_never_shrinks_the_buffers_of_a_long_one(smollm):
    ids = token_ids(smollm, TEXT)
    prompts = [ids[:700], ids[700:712]]  # the long row first: its buffers must survive
    engine = Engine(
        smollm.model,
        smollm.tokenizer,
        make_policy("full"),
        prefill_chunk=256,
        int8=Int8Config(fp_window=32, group=16),
    )
    params = SamplingParams(max_new_tokens=8)
    batched = engine.generate_batch(prompts, params)
    assert batched.store.quantized_lengths(0)[0] >= 640
    for row, prompt in enumerate(prompts):
        alone = engine.generate(engine.new_sequence(), prompt, params)
        assert batched.generations[row].token_ids == alone.token_ids


def test_original_positions_refuse_to_pass_the_context_before_any_compute(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256))
    session = engine.new_sequence()
    with pytest.raises(ContextOverflowError, match="8192-token context.*rerotate"):
        engine.prefill(session, [5] * 8193)
    assert session.token_ids == [] and session.store.seen_tokens == 0
