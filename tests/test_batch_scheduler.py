"""Continuous batching (`agent_kv.runtime.engine.batch_scheduler`) on the default model: sessions
decoded together give the replies they get one at a time; a packed call equals its parts run
alone; a lone turn is the serial path exactly; waiting turns time out or are cancelled without
touching their sequence; a failed step fails its own turns only; prompts arriving together
share a step up to the per-step budget of prefill tokens; with a KV cap, turns join only while
their KV bounds fit under it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from agent_kv.errors import KVCapacityError, QueueTimeoutError, TurnCancelled
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.batch_scheduler import BatchScheduler
from agent_kv.runtime.engine.batched_calls import PackedPart
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService

TOPICS = ["rivers", "violins", "glaciers", "bread", "comets", "chess"]
QUESTIONS = [
    "Tell me one fact about {t}.",
    "Why do people like {t}?",
    "Name a colour linked to {t}.",
    "Give a short title for a story about {t}.",
    "What is the opposite of {t}?",
    "Say goodbye in a sentence about {t}.",
]


def conversation(topic: str, turns: int, replies: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": f"You are a helpful guide to {topic}."}]
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i].format(t=topic)})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def run_session(service: ChatService, topic: str, out: dict) -> None:
    """Six turns of one session, each resending the whole conversation."""
    replies, tokens = [], []
    for turn in range(6):
        result = service.run(
            conversation(topic, turn + 1, replies),
            SamplingParams(max_new_tokens=6),
            session_id=topic,
        )
        replies.append(result.reply.text)
        tokens.append(result.reply.token_ids)
    out[topic] = tokens
    out[f"{topic} evicted"] = result.kv.evicted_tokens


def test_six_sessions_decoded_together_equal_one_at_a_time(tiny_llama, smollm):
    """6 sessions x 6 turns, greedy, under CONF-KV with INT8 and a budget that evicts:
    token-for-token the replies of serving the sessions one after another (a random-weight
    model behind SmolLM2's tokenizer: batching must not change what any model writes)."""

    def service(max_batch: int) -> ChatService:
        engine = Engine(
            tiny_llama, smollm.tokenizer, make_policy("conf-kv", budget=48, protect_recent=8),
            prefill_chunk=64, int8=Int8Config(fp_window=16, group=8),
        )  # fmt: skip
        return ChatService(engine, max_batch=max_batch)

    serial, together = {}, {}
    one_at_a_time = service(1)
    for topic in TOPICS:
        run_session(one_at_a_time, topic, serial)
    batched = service(8)
    threads = [threading.Thread(target=run_session, args=(batched, t, together)) for t in TOPICS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert together == serial
    assert all(serial[f"{topic} evicted"] > 0 for topic in TOPICS)  # the budget evicted
    scheduler = batched.scheduler
    assert scheduler.rows / scheduler.iterations > 2  # the sessions really shared forward calls
    assert one_at_a_time.scheduler.rows == one_at_a_time.scheduler.iterations  # batch of one


def test_packed_call_equals_its_parts_alone(smollm):
    """A decode token of one sequence and a prefill chunk of another in one packed call:
    the same logits and stored keys as each run alone (fp tolerance)."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=64)
    prompts = [list(range(200, 260)), list(range(300, 330))]
    alone, packed = [], []
    for holder in (alone, packed):
        for prompt in prompts:
            sequence = engine.new_sequence()
            engine.prefill(sequence, prompt)
            holder.append(sequence)
    steps = [[7], list(range(400, 440))]
    expected = [engine.prefill(s, tokens).clone() for s, tokens in zip(alone, steps, strict=True)]
    parts = [PackedPart(s, t, engine.policy, True) for s, t in zip(packed, steps, strict=True)]
    got = engine.step(parts)
    for want, have, a, b in zip(expected, got, alone, packed, strict=True):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
        assert a.token_ids == b.token_ids and a.store.seen_tokens == b.store.seen_tokens
        n = a.store.length(5, 0)
        torch.testing.assert_close(
            b.store.fp["keys"][5, 0, :, :n], a.store.fp["keys"][5, 0, :, :n], atol=1e-5, rtol=1e-5
        )
        assert len(a.steps) == len(b.steps)


def test_lone_turn_is_the_serial_path(smollm):
    """Alone in the scheduler, a sampled turn gives exactly `Engine.generate`'s reply and
    leaves exactly its cache."""
    engine = Engine(
        smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=32, protect_recent=8)
    )
    scheduler = BatchScheduler(engine)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, stop=["\n\n"])
    prompt = smollm.tokenizer("The capital of France is a city that")["input_ids"]
    direct, queued = engine.new_sequence(), engine.new_sequence()
    want = engine.generate(direct, prompt, params)
    streamed = []
    got = scheduler.generate(queued, prompt, params, on_text=streamed.append)
    assert got.token_ids == want.token_ids and got.text == want.text == "".join(streamed)
    assert got.finish_reason == want.finish_reason
    assert torch.equal(direct.last_logits, queued.last_logits)
    assert direct.token_ids == queued.token_ids
    scheduler.close()


class _Blocked:
    """Stands in for `Engine.step`: the first call waits for `release`."""

    def __init__(self, engine: Engine):
        self.inner = engine.step
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, parts):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return self.inner(parts)


def test_waiting_turns_time_out_or_are_cancelled_untouched(smollm, monkeypatch):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    blocked = _Blocked(engine)
    monkeypatch.setattr(engine, "step", blocked)
    scheduler = BatchScheduler(engine, max_batch=1)
    params = SamplingParams(max_new_tokens=3)
    results = {}
    first = threading.Thread(
        target=lambda: results.update(
            first=scheduler.generate(engine.new_sequence(), [5, 6], params)
        )
    )
    first.start()
    assert blocked.entered.wait(30)
    late = engine.new_sequence()
    with pytest.raises(QueueTimeoutError):
        scheduler.generate(late, [7, 8], params, deadline=time.monotonic() + 0.3)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TurnCancelled, match="waiting"):
        scheduler.generate(late, [7, 8], params, cancel=cancel)
    assert late.token_ids == [] and late.store.seen_tokens == 0  # nothing was fed
    blocked.release.set()
    first.join(30)
    assert len(results["first"].token_ids) == 3
    assert scheduler.running == 0 and scheduler.waiting == 0
    scheduler.close()


def test_a_failed_step_fails_its_turns_and_the_scheduler_goes_on(smollm, monkeypatch):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    scheduler = BatchScheduler(engine)
    real = engine.step
    failures = iter([RuntimeError("device lost")])

    def flaky(parts):
        error = next(failures, None)
        if error is not None:
            raise error
        return real(parts)

    monkeypatch.setattr(engine, "step", flaky)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(RuntimeError, match="device lost"):
        scheduler.generate(engine.new_sequence(), [5, 6], params)
    reply = scheduler.generate(engine.new_sequence(), [5, 6], params)
    assert len(reply.token_ids) == 2
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.generate(engine.new_sequence(), [5], params)


def test_prefill_chunks_share_a_step_up_to_the_token_budget(smollm, monkeypatch):
    """Turns that arrive together prefill in the same step while their chunks fit the
    per-step budget of prefill tokens; the next chunk waits for the next step."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=128)
    blocked = _Blocked(engine)
    steps: list[list[int]] = []

    def recording(parts):
        steps.append(sorted(len(part.tokens) for part in parts))
        return blocked(parts)

    monkeypatch.setattr(engine, "step", recording)
    scheduler = BatchScheduler(engine, max_batch=8, prefill_tokens=256)
    params = SamplingParams(max_new_tokens=2)
    prompts = [[5, 6], [7] * 100, [8] * 100, [9] * 300]
    replies = {}

    def turn(i: int) -> None:
        replies[i] = scheduler.generate(engine.new_sequence(), prompts[i], params)

    threads = [threading.Thread(target=turn, args=(0,))]
    threads[0].start()
    assert blocked.entered.wait(30)  # the first turn's prefill step holds the model
    for i in (1, 2, 3):  # queued in this order
        threads.append(threading.Thread(target=turn, args=(i,)))
        threads[-1].start()
        while scheduler.waiting < i:
            time.sleep(0.01)
    blocked.release.set()
    for thread in threads:
        thread.join(60)
    assert steps[0] == [2]
    assert steps[1] == [1, 100, 100]  # the first turn's decode token and two whole prompts
    assert [128] in [[s for s in step if s > 1] for step in steps]  # then the long one's chunk
    for step in steps:
        assert sum(s for s in step if s > 1) <= 256 or len([s for s in step if s > 1]) == 1
    assert sorted(replies) == [0, 1, 2, 3]
    assert all(len(reply.token_ids) == 2 for reply in replies.values())
    scheduler.close()


def test_the_repetition_penalty_counts_the_whole_prompt_on_every_path(smollm, tiny_llama):
    """As vLLM, the penalty counts the prompt's tokens, here all in the sequence's history
    (a reply straight from its last logits), and the reply's: under a huge penalty the greedy
    reply takes none of them, through `Engine.generate`, the scheduler and `generate_batch`
    alike, where without it the random-weight model repeats the history's last token."""
    engine = Engine(tiny_llama, smollm.tokenizer, make_policy("full"))
    history = smollm.tokenizer("The red bicycle stands on shelf seven. Where is it?")["input_ids"]
    plain = SamplingParams(max_new_tokens=12)
    penalized = SamplingParams(max_new_tokens=12, repetition_penalty=1e4)

    def reply(params: SamplingParams, scheduled: bool) -> list[int]:
        sequence = engine.new_sequence()
        engine.prefill(sequence, history)
        if not scheduled:
            return engine.generate(sequence, [], params).token_ids
        scheduler = BatchScheduler(engine)
        try:
            return scheduler.generate(sequence, [], params).token_ids
        finally:
            scheduler.close()

    assert reply(plain, scheduled=False) == [history[-1]] * 12
    for scheduled in (False, True):
        fresh = reply(penalized, scheduled)
        assert len(set(fresh)) == len(fresh) == 12 and not set(fresh) & set(history)
    (batched,) = engine.generate_batch([history], penalized).generations
    assert len(set(batched.token_ids)) == 12 and not set(batched.token_ids) & set(history)


def test_turns_join_while_their_kv_bounds_fit_the_cap(smollm, monkeypatch):
    """With a KV cap, a turn joins the batch only while its KV bound fits beside the running
    turns': three turns that fit one at a time run one after another, the sequences of each
    forward call never allocating past the cap, with the replies each gets alone; under a cap
    that holds all three they run together; a turn over the cap alone is refused before
    anything is fed."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=64)
    params = SamplingParams(max_new_tokens=8)
    prompts = [list(range(100 + i, 300 + i)) for i in range(3)]
    alone = [engine.generate(engine.new_sequence(), p, params).token_ids for p in prompts]
    one = engine.kv_memory.turn_bound(engine.new_sequence().store, engine.policy, 208)
    real = engine.step

    def run_together(cap: int) -> tuple[int, int, list[list[int]]]:
        scheduler = BatchScheduler(engine, max_batch=4, max_kv_bytes=cap)
        sequences = [engine.new_sequence() for _ in prompts]
        peak = {"running": 0, "allocated": 0}

        def watched(parts):
            results = real(parts)
            peak["running"] = max(peak["running"], scheduler.running)
            allocated = sum(part.sequence.store.allocated_nbytes() for part in parts)
            peak["allocated"] = max(peak["allocated"], allocated)
            return results

        monkeypatch.setattr(engine, "step", watched)
        replies: list[list[int]] = [[] for _ in prompts]

        def turn(i: int) -> None:
            replies[i] = scheduler.generate(sequences[i], prompts[i], params).token_ids

        threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        scheduler.close()
        return peak["running"], peak["allocated"], replies

    running, allocated, replies = run_together(one + one // 2)
    assert running == 1 and allocated <= one + one // 2
    assert replies == alone
    running, allocated, replies = run_together(3 * one)
    assert running == 3 and one < allocated <= 3 * one and replies == alone
    scheduler = BatchScheduler(engine, max_kv_bytes=one)
    big = engine.new_sequence()
    with pytest.raises(KVCapacityError, match="over the batch's cap"):
        scheduler.generate(big, list(range(100, 400)), params)
    assert big.store.seen_tokens == 0 and scheduler.waiting == 0


def test_a_lone_rerotate_turn_runs_past_the_context_in_tokens_seen(smollm):
    """With rerotate positions the context bounds the tokens a row holds, not the tokens it
    has seen: a turn alone in the batch (one sequence's `step`) runs on past it."""
    policy = make_policy("window", budget=64, sinks=4)
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=32, rerotate=True)
    scheduler = BatchScheduler(engine)
    sequence = engine.new_sequence()
    sequence.store.max_positions = 200
    scheduler.prefill(sequence, list(range(100, 500)))
    assert sequence.store.seen_tokens == 400 and max(sequence.store.lengths()) < 200
    reply = scheduler.generate(sequence, [7, 8], SamplingParams(max_new_tokens=3))
    assert len(reply.token_ids) == 3 and sequence.store.seen_tokens >= 404
    scheduler.close()
