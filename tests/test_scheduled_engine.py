"""Episodes sharing one model through a `BatchScheduler` (`ScheduledEngine`): three
conversations under three policies and store options, run at once in threads, give the
replies, fed logits and caches of plain `Engine`s run one after another, and the model runs
only on the scheduler's thread; `BatchScheduler.prefill` refuses what `Engine.prefill` refuses."""

from __future__ import annotations

import threading

import pytest
import torch

from agent_kv.errors import ConfigError, TurnCancelled
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.engine.batch_scheduler import BatchScheduler
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.scheduled_engine import ScheduledEngine
from agent_kv.runtime.replies.grammar import Grammar
from agent_kv.runtime.replies.sampling import SamplingParams

pytestmark = pytest.mark.model

CHUNK = 32  # tokens per prefill call: the observations below take several
SPECS = {
    "rivers": PolicySpec.parse("conf-kv", 48, None, protect_recent=8, int8=True, fp_window=16),
    "violins": PolicySpec.parse("window", 64, None, positions="rerotate"),
    "glaciers": PolicySpec.parse("full", None, None),
}
ACTION = Grammar("regex", r"(click|scroll) \[[0-9]{1,2}\]")


def episode(engine, topic: str, start: threading.Barrier | None = None) -> dict:
    """A short agent-like conversation: a reply, an observation fed on its own (its logits
    kept), a teacher-forced reply, and a reply under a grammar."""
    chat = Conversation(engine)
    chat.add("system", f"You are a web agent shopping for {topic}.", pin=True)
    chat.add("user", f"Name one thing to check before buying {topic}.")
    if start is not None:
        start.wait(60)
    first = chat.reply(SamplingParams(max_new_tokens=6))
    page = " ".join(f"[{i}] link '{topic} item {i}'" for i in range(1, 13))
    chat.add("user", f"Page:\n{page}\nWhat next?")
    fed = chat.prefill().clone()
    forced = chat.force_reply("click [3]")
    chat.add("user", "The page changed. What next?")
    action = chat.reply(SamplingParams(max_new_tokens=8, grammar=ACTION))
    return {
        "replies": [first.token_ids, action.token_ids],
        "action": action.text,
        "fed": fed,
        "forced": forced.logprobs,
        "tokens": list(chat.sequence.token_ids),
        "steps": len(chat.sequence.steps),
        "kv": chat.sequence.store.nbytes(0),
    }


def test_episodes_sharing_one_model_equal_plain_engines_one_at_a_time(smollm):
    plain = {
        topic: episode(Engine.from_spec(spec, smollm.model, smollm.tokenizer, CHUNK), topic)
        for topic, spec in SPECS.items()
    }
    base = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=CHUNK)
    scheduler = BatchScheduler(base, max_batch=len(SPECS))
    views = {topic: ScheduledEngine.from_spec(spec, scheduler) for topic, spec in SPECS.items()}
    assert views["rivers"].store_options["int8"] is not None
    assert views["violins"].store_options["rerotate"] is True
    assert views["glaciers"].prefill_chunk == CHUNK

    threads_seen: set[str] = set()
    hook = smollm.model.register_forward_pre_hook(
        lambda module, args: threads_seen.add(threading.current_thread().name)
    )
    together: dict[str, dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(SPECS))

    def run(topic: str) -> None:
        try:
            together[topic] = episode(views[topic], topic, start)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    try:
        workers = [threading.Thread(target=run, args=(topic,)) for topic in SPECS]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(300)
    finally:
        hook.remove()
    assert not errors, errors
    assert threads_seen == {"agent-kv-batch"}  # the model ran on the scheduler's thread only
    assert scheduler.rows > scheduler.iterations  # the episodes really shared forward calls
    for topic in SPECS:
        want, have = plain[topic], together[topic]
        assert have["replies"] == want["replies"], topic
        assert have["tokens"] == want["tokens"] and have["steps"] == want["steps"], topic
        assert have["kv"] == want["kv"], topic
        torch.testing.assert_close(have["fed"], want["fed"], atol=1e-4, rtol=1e-4)
        assert have["forced"] == pytest.approx(want["forced"], abs=1e-4)
        assert have["action"].startswith(("click [", "scroll ["))
    scheduler.close()


def test_scheduler_feed_refuses_as_engine_feed_and_stops_when_cancelled(smollm):
    base = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=CHUNK)
    scheduler = BatchScheduler(base)
    view = ScheduledEngine(scheduler, make_policy("window", budget=64))
    assert isinstance(view, ChatEngine) and isinstance(base, ChatEngine)  # both declare it
    sequence = view.new_sequence()
    with pytest.raises(ValueError, match="at least one token"):
        view.prefill(sequence, [])
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TurnCancelled):
        view.prefill(sequence, list(range(100, 140)), cancel)
    assert sequence.token_ids == [] and sequence.store.seen_tokens == 0
    logits = view.prefill(sequence, list(range(100, 140)))
    assert logits.shape == (smollm.model.config.vocab_size,) and logits.dtype == torch.float32
    assert sequence.token_ids == list(range(100, 140)) and len(sequence.steps) == 2  # 2 chunks
    with pytest.raises(ConfigError, match="plain engine"):
        ScheduledEngine.from_spec(PolicySpec.parse("window+reencode", 64, None), scheduler)
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        view.prefill(sequence, [5])


def test_episodes_on_one_scheduler_read_their_common_system_turn_once(smollm):
    spec = PolicySpec.parse("conf-kv", 160, None)
    system = "You are a web agent. Reply with exactly one action, nothing else. " * 8

    def chat(engine, topic: str) -> Conversation:
        conversation = Conversation(engine)
        conversation.add("system", system, pin=True)
        conversation.add("user", f"Find the cheapest {topic}.")
        conversation.reply(SamplingParams(max_new_tokens=6))
        return conversation

    base = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=CHUNK,
                  share_prefixes=True)  # fmt: skip
    scheduler = BatchScheduler(base, max_batch=2)
    view = ScheduledEngine.from_spec(spec, scheduler)
    plain = Engine.from_spec(spec, smollm.model, smollm.tokenizer, CHUNK)
    try:
        shared = [chat(view, topic) for topic in ("laptops", "violins")]
    finally:
        scheduler.close()
    alone = [chat(plain, topic) for topic in ("laptops", "violins")]
    assert [c.messages[-1] for c in shared] == [c.messages[-1] for c in alone]
    stores = [c.sequence.store for c in shared]
    whole = shared[0].spans[0][1] // 32 * 32
    assert whole >= 3 * 32 and all(store.prefix.tokens == whole for store in stores)
    assert stores[0].prefix.views()[0].run is stores[1].prefix.views()[0].run
    assert base.prefix_cache.blocks == whole // 32
