"""Shared prefix blocks: pinned runs that sequences start with alike are held once, read by
every sequence that starts with them, reference-counted and returned when the last reader goes;
a sequence that reads them replies as one that computed them itself."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from agent_kv.kv.policies import make_policy
from agent_kv.kv.prefix_cache import PrefixCache
from agent_kv.kv.store import BLOCK_TOKENS, KVStore
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams

SYSTEM = "You are a careful web agent. Answer with one action. " * 12


def _run(cache: PrefixCache, blocks: int, parent=None, start: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    size = blocks * cache.block_tokens
    keys, values = torch.randn(2, 1, 3, size, 4), torch.randn(2, 1, 3, size, 4)
    return keys[0], values[0]


def test_blocks_are_found_by_their_history_and_given_back_with_the_last_reader():
    cache = PrefixCache(4, b"model")
    tokens = list(range(10))  # two whole blocks, a partial third
    digests = cache.digests(b"", tokens)
    assert len(digests) == 2
    assert cache.digests(b"", [0, 1, 2, 3, 9, 9, 9, 9])[0] == digests[0]  # same first block
    assert cache.digests(b"", [0, 1, 2, 3, 9, 9, 9, 9])[1] != digests[1]
    assert PrefixCache(4, b"other").digests(b"", tokens)[0] != digests[0]  # other model
    assert cache.match(digests) == []
    keys, values = _run(cache, 2)
    first = cache.publish(None, digests, keys, values, 0)
    assert [v.blocks for v in first] == [2] and cache.blocks == 2
    second = cache.match(digests)
    assert second[0].run is first[0].run and torch.equal(second[0].keys, keys)
    # a third sequence diverges in the second block: it reads the first, adds its own run
    other = cache.digests(b"", [0, 1, 2, 3, 7, 7, 7, 7])
    third = cache.match(other)
    assert [v.blocks for v in third] == [1]
    extra = cache.publish(third[-1], other[1:], *_run(cache, 1, seed=1), 4)
    assert len(extra) == 1 and extra[0].run.parent is first[0].run and cache.runs == 2
    assert cache.nbytes() == first[0].nbytes + extra[0].nbytes
    for views in (first, second, third):
        cache.release(views)
    assert cache.runs == 1  # the branch is still read
    cache.release(extra)
    assert cache.runs == 0 and cache.blocks == 0 and cache.nbytes() == 0


def test_a_block_published_twice_is_held_once():
    cache = PrefixCache(4, b"model")
    digests = cache.digests(b"", list(range(8)))
    a = cache.publish(None, digests, *_run(cache, 2), 0)
    b = cache.publish(None, digests, *_run(cache, 2, seed=1), 0)  # computed again meanwhile
    assert b[0].run is a[0].run and cache.runs == 1
    assert cache.match(digests[:1])[0].blocks == 1


@pytest.fixture(scope="module")
def engines(smollm):
    def make(share: bool) -> Engine:
        policy = make_policy("conf-kv", budget=160)
        return Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=64,
                      share_prefixes=share)  # fmt: skip

    return make(True), make(False)


def _chat(engine: Engine, question: str) -> Conversation:
    chat = Conversation(engine)
    chat.add("system", SYSTEM, pin=True)
    chat.add("user", question)
    return chat


def test_sessions_read_the_pinned_system_prompt_once_and_reply_as_alone(engines):
    shared, alone = engines
    params = SamplingParams(max_new_tokens=12)
    chats = [_chat(shared, q) for q in ("Open the forum.", "Find the cheapest laptop.")]
    replies = [chat.reply(params) for chat in chats]
    references = [_chat(alone, q) for q in ("Open the forum.", "Find the cheapest laptop.")]
    expected = [chat.reply(params) for chat in references]
    assert [r.text for r in replies] == [r.text for r in expected]
    system_end = chats[0].spans[0][1]
    stores = [chat.sequence.store for chat in chats]
    whole = system_end - system_end % BLOCK_TOKENS
    assert whole >= 4 * BLOCK_TOKENS
    for store, reference in zip(stores, (c.sequence.store for c in references), strict=True):
        assert store.prefix.tokens == whole
        assert store.seen_tokens == reference.seen_tokens
        # the shared tokens left the session's own KV: it holds that much less
        per_token = store.bytes_per_token()
        assert store.nbytes() <= reference.nbytes() - whole * per_token + per_token
        assert store.prefix.nbytes() == whole * per_token
    cache = shared.prefix_cache
    assert cache.nbytes() == whole * stores[0].bytes_per_token()  # held once for both
    assert stores[0].prefix.views()[0].run is stores[1].prefix.views()[0].run
    # the second session computed none of the shared tokens: its first call starts past them
    assert chats[1].sequence.steps[0].seen_tokens > whole
    # the logits after the replies agree with computing the prompt alone, within float32
    # rounding (the shared blocks were computed in other chunks, and read as their own segment)
    for chat, reference in zip(chats, references, strict=True):
        assert torch.allclose(chat.sequence.last_logits, reference.sequence.last_logits, atol=2e-3)
    del chats, replies, stores, store, chat
    gc.collect()
    assert cache.runs == 0 and cache.nbytes() == 0  # the sessions went: every block is back


def test_forks_and_saved_sessions_read_the_same_blocks(engines):
    shared, _ = engines
    chat = _chat(shared, "Open the forum.")
    chat.reply(SamplingParams(max_new_tokens=4))
    store = chat.sequence.store
    run = store.prefix.views()[0].run
    twin = chat.fork()
    assert twin.sequence.store.prefix.views()[0].run is run and run.refs == 2
    state = store.state(trim=True)
    restored = KVStore.from_state(state)
    assert restored.prefix.holder.cache is None and restored.prefix.tokens == store.prefix.tokens
    restored.prefix.adopt(shared.prefix_cache)
    assert restored.prefix.views()[0].run is run and run.refs == 3
    reference = store.state(trim=True)
    again = restored.state(trim=True)
    for key in ("keys", "values"):
        assert torch.equal(reference["shared"][key], again["shared"][key])
        assert torch.equal(reference["fp"][key], again["fp"][key])
    broken = copy.deepcopy(state)
    broken["shared"]["digests"] = broken["shared"]["digests"][:-1]
    with pytest.raises(ValueError, match="does not match"):
        KVStore.from_state(broken)
    del chat, twin, store, restored
    gc.collect()
    assert shared.prefix_cache.runs == 0


def test_a_session_that_rewrites_its_shared_history_copies_the_block_it_cuts(engines, smollm):
    shared, alone = engines
    chat = _chat(shared, "Open the forum.")
    chat.prefill()
    sequence, store = chat.sequence, chat.sequence.store
    whole = store.prefix.tokens
    end = whole - 10  # inside the last shared block
    store.truncate(end)
    del sequence.token_ids[end:]
    assert store.prefix.tokens == whole - BLOCK_TOKENS
    assert store.live_positions(0).tolist() == list(range(whole - BLOCK_TOKENS, end))
    more = smollm.tokenizer("Then search for laptops.", add_special_tokens=False)["input_ids"]
    logits = shared.prefill(sequence, more)
    reference = alone.new_sequence()
    expected = alone.prefill(reference, sequence.token_ids[:end] + more)
    assert torch.allclose(logits, expected, atol=2e-3)


def test_a_short_soak_gives_every_shared_block_back(smollm):
    from benchmarks.soak import soak

    # 12 sessions x 3 turns under a cap that holds about four: sessions spill and come back
    out = soak(smollm, sessions=12, turns=3, cap_mb=60, ttl=30, max_user=60, every=12, seed=1)
    assert out["spilled"] > 0
    assert all(s["allocated_mb"] <= 60 for s in out["samples"])
    assert max(s["shared_blocks"] for s in out["samples"]) >= 8  # both system prompts shared
    assert out["shared_blocks_left"] == 0 and out["shared_runs_left"] == 0


def test_a_batch_computes_its_prompts_common_prefix_once_and_replies_as_without(smollm):
    def make(share: bool) -> Engine:
        return Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=64,
                      share_prefixes=share)  # fmt: skip

    shared, alone = make(True), make(False)
    common = smollm.tokenizer(SYSTEM)["input_ids"]
    questions = ("Where is the cart?", "Open the first order.", "Sum the totals, please.")
    prompts = [common + smollm.tokenizer(q)["input_ids"] for q in questions]
    params = SamplingParams(max_new_tokens=8)
    batch = shared.generate_batch(prompts, params)
    reference = alone.generate_batch(prompts, params)
    assert [g.token_ids for g in batch.generations] == [g.token_ids for g in reference.generations]
    whole = len(common) - len(common) % BLOCK_TOKENS
    assert whole >= 4 * BLOCK_TOKENS
    store = batch.store
    assert store.prefix.tokens == whole and store.prefix.nbytes() == whole * (
        store.bytes_per_token()
    )
    # every row's own KV lacks the shared tokens: held once for the three rows
    assert reference.store.nbytes() - store.nbytes() == 3 * whole * store.bytes_per_token()
    assert [store.seen(row) for row in range(3)] == [reference.store.seen(row) for row in range(3)]
    # no row prefilled the shared tokens: its first call starts past them
    assert all(steps[0].seen_tokens > whole for steps in batch.steps)
    with pytest.raises(ValueError, match="read one shared prefix"):
        store.truncate(whole - 1, row=1)
    cache = shared.prefix_cache
    assert cache.blocks == whole // BLOCK_TOKENS
    del batch, store
    gc.collect()
    assert cache.runs == 0  # the batch went: its blocks are back
