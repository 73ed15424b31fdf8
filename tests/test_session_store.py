"""The session store: LRU under a KV byte cap, spill to disk, idle TTL, in-flight safety."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import kept_positions, with_old_names

from agent_kv.errors import KVCapacityError
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.chat.history_sync import HistorySync, prepare_history
from agent_kv.runtime.chat.pin_rules import apply_pins
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import CallRecord, SequenceState
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.session_store import SessionBusyError, SessionStore

BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, fp32
SLOTS = 128  # what 100 tokens take: 100 + 5%, in whole 32-token blocks, per layer
SESSION_BYTES = SLOTS * BYTES_PER_TOKEN  # what a session of 100 tokens allocates


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(smollm):
    return Engine(smollm.model, smollm.tokenizer, make_policy("full"))


def prefill(store: SessionStore, sid: str, tokens: list[int]) -> torch.Tensor:
    with store.use(sid) as session:
        return store.engine.prefill(session, tokens).clone()


def test_least_recently_used_idle_session_leaves_memory_first(engine):
    clock = FakeClock()
    store = SessionStore(engine, max_kv_bytes=2 * SESSION_BYTES + 1, clock=clock)
    for t, sid in enumerate(["a", "b", "c"]):
        clock.now = float(t)
        prefill(store, sid, list(range(10, 110)))  # 100 tokens each
    assert store.in_memory() == ["b", "c"] and store.dropped == 1
    assert store.live_bytes() == 200 * BYTES_PER_TOKEN
    assert store.allocated_bytes() == 2 * SESSION_BYTES
    assert store.shared_bytes() == 0  # an engine without prefix sharing
    listed = store.describe()
    assert [s.kv_live_bytes for s in listed] == [100 * BYTES_PER_TOKEN] * 2
    assert [s.kv_allocated_bytes for s in listed] == [SESSION_BYTES] * 2
    assert all(s.kv_bytes == s.kv_live_bytes for s in listed)  # the deprecated alias
    clock.now = 3.0
    prefill(store, "b", [5])  # b is now the most recent: c goes next
    clock.now = 4.0
    prefill(store, "d", list(range(10, 60)))
    assert store.in_memory() == ["b", "d"]


def test_spilled_session_comes_back_with_identical_logits(engine, tmp_path):
    clock = FakeClock()
    store = SessionStore(engine, max_kv_bytes=SESSION_BYTES, spill_dir=tmp_path, clock=clock)
    prefill(store, "a", list(range(10, 110)))
    clock.now = 1.0
    prefill(store, "b", list(range(20, 120)))  # over the cap: a is saved to disk
    assert store.in_memory() == ["b"] and store.ids() == ["a", "b"] and store.spilled == 1
    assert len(list(tmp_path.iterdir())) == 1
    reference = engine.new_sequence()
    engine.prefill(reference, list(range(10, 110)))
    clock.now = 2.0
    resumed = prefill(store, "a", [7])
    assert torch.equal(resumed, engine.prefill(reference, [7]))


def test_a_session_saved_with_the_old_step_record_names_loads(engine, tmp_path):
    sequence = engine.new_sequence()
    engine.prefill(sequence, list(range(10, 60)))
    path = tmp_path / "old.pt"
    sequence.save(path)
    data = torch.load(path, weights_only=True)
    data["steps"] = [with_old_names(step) for step in data["steps"]]
    assert {"appended_kv_bytes", "kv_bytes", "allocated_kv_bytes"} <= set(data["steps"][0])
    torch.save(data, path)
    assert SequenceState.load(path, engine.model).steps == sequence.steps
    # a record from before allocated bytes were recorded
    old = {"seen_tokens": 5, "appended_kv_bytes": 10, "kv_bytes": 8, "confidence": 0.5}
    old |= {"gated": True, "budget": None, "evicted": 1}
    assert CallRecord.read(old) == CallRecord(
        seen_tokens=5, appended_kv_live_bytes=10, kv_live_bytes=8, confidence=0.5, gated=True,
        budget=None, evicted=1, kv_allocated_bytes=0,
    )  # fmt: skip


def test_idle_sessions_expire_and_in_flight_ones_never_leave(engine):
    clock = FakeClock()
    store = SessionStore(engine, max_kv_bytes=SESSION_BYTES, idle_ttl_s=10, clock=clock)
    with store.use("busy") as busy:
        engine.prefill(busy, list(range(10, 310)))  # outgrows the cap, but in flight
        with pytest.raises(KVCapacityError, match="held by requests in flight"):
            prefill(store, "other", list(range(10, 20)))  # no room beside it: refused
        assert "busy" in store.in_memory() and "other" not in store.ids()
        with pytest.raises(SessionBusyError):
            store.drop("busy")
    assert store.ids() == []  # once idle, busy is over the cap by itself
    prefill(store, "x", [1, 2, 3])
    clock.now = 11.0
    store.sweep()
    assert store.ids() == [] and store.drop("x") is False


def test_requests_to_one_session_are_serialised(engine):
    store = SessionStore(engine)
    inside, release = threading.Event(), threading.Event()
    order = []

    def first():
        with store.use("s"):
            order.append("first in")
            inside.set()
            release.wait(5)
            order.append("first out")

    def second():
        inside.wait(5)
        with store.use("s"):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    inside.wait(5)
    time.sleep(0.2)  # let the second request reach the session's lock
    release.set()
    for thread in threads:
        thread.join(5)
    assert order == ["first in", "first out", "second in"]


def sync_history(engine, session, ids):
    """A request's history met as the chat service meets it: prepared, then its new tokens
    prefilled."""
    sync = prepare_history(session, ids, engine.new_sequence)
    if sync.prefilled_tokens:
        engine.prefill(session, ids[sync.reused_tokens :])
    return sync


def fresh_logits(engine, ids):
    return engine.prefill(engine.new_sequence(), ids)


def test_history_is_matched_token_by_token(engine):
    a, b, c = list(range(100, 160)), list(range(200, 220)), list(range(300, 310))
    session = engine.new_sequence()
    assert sync_history(engine, session, a) == HistorySync(0, 60, "none")
    assert sync_history(engine, session, a + b) == HistorySync(60, 20, "none")
    assert (session.last_logits - fresh_logits(engine, a + b)).abs().max() < 1e-4
    # the client rewrote the end of its history: cut back to the divergence point
    assert sync_history(engine, session, a + c) == HistorySync(60, 10, "truncated")
    assert session.token_ids == a + c and session.store.seen_tokens == 70
    assert (session.last_logits - fresh_logits(engine, a + c)).abs().max() < 1e-4
    # a request that stops short of the history re-feeds its last token
    assert sync_history(engine, session, a) == HistorySync(59, 1, "truncated")
    assert (session.last_logits - fresh_logits(engine, a)).abs().max() < 1e-4


def test_history_rebuilt_from_scratch_when_eviction_followed_the_change(smollm):
    """A window without attention sinks evicts the first tokens: no intact prefix is left."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=40, sinks=0))
    a, b, c = list(range(100, 160)), list(range(200, 260)), list(range(300, 310))
    session = engine.new_sequence()
    sync_history(engine, session, a + b)  # evictions happened after token 60
    assert session.store.segments.changed_at[0] > 60
    assert session.store.intact_tokens() == 0
    assert sync_history(engine, session, a + c) == HistorySync(0, 70, "scratch")
    assert session.token_ids == a + c and session.store.seen_tokens == 70
    assert torch.equal(session.last_logits, fresh_logits(engine, a + c))


@pytest.mark.parametrize("sinks", [4, 0])
def test_a_changed_history_keeps_its_intact_prefix_after_eviction(smollm, sinks):
    """A client rewrote its last message after eviction ran (a browser-use step): the tokens no
    policy evicted before the change (the pinned system turn, and the window's attention
    sinks before it) stay cached, and the rest is prefilled as a fresh session would."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=40, sinks=sinks))
    system, b, c = list(range(100, 130)), list(range(200, 260)), list(range(300, 360))
    pins = [(0, 30)]
    session = engine.new_sequence()
    apply_pins(session.store, pins)
    engine.prefill(session, system + b)  # 90 tokens under a 40-token window: evictions
    assert session.store.figures.evicted_tokens > 0
    assert session.store.segments.changed_at[0] > 30
    assert session.store.intact_tokens() == 30
    sync = prepare_history(session, system + c, engine.new_sequence)
    apply_pins(session.store, pins)
    assert sync == HistorySync(30, 60, "truncated")
    engine.prefill(session, c)
    fresh = engine.new_sequence()
    apply_pins(fresh.store, pins)
    engine.prefill(fresh, system + c)
    assert (session.last_logits - fresh.last_logits).abs().max() < 1e-4
    assert kept_positions(session.store) == kept_positions(fresh.store)
    assert fresh.store.figures.evicted_tokens > 0


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_fact_survives_twenty_turns_under_a_tight_budget(smollm, pinned):
    tok = smollm.tokenizer
    head = tok(
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize "
        "it.\nThe pass key is 4817. Remember it. 4817 is the pass key.\n",
        add_special_tokens=False,
    )["input_ids"]
    engine = Engine(smollm.model, tok, make_policy("window", budget=256), prefill_chunk=128)
    session = engine.new_sequence()
    if pinned:
        session.store.pins.pin(0, len(head))
    ids = list(head)
    for turn in range(20):
        filler = (
            f" Turn {turn}. The grass is green. The sky is blue. The sun is yellow. Here we "
            "go. There and back again."
        ) * 2
        ids += tok(filler, add_special_tokens=False)["input_ids"]
        sync_history(engine, session, ids)  # each turn prefills only its own tokens
        assert session.steps[-1].seen_tokens == len(ids)
    ids += tok("\nWhat is the pass key? The pass key is", add_special_tokens=False)["input_ids"]
    sync_history(engine, session, ids)
    assert max(session.store.lengths()) <= 256 + 128 + len(head)
    reply = engine.generate(session, [], SamplingParams(max_new_tokens=6)).text
    kept = set(kept_positions(session.store, 0))
    if pinned:
        assert set(range(len(head))) <= kept and reply.strip().startswith("4817")
    else:
        # only the window's 4 attention sinks are left of the head
        assert kept & set(range(len(head))) == set(range(4)) and "4817" not in reply


def test_a_shared_spill_saves_each_session_after_its_request_and_another_replica_resumes_it(
    engine, tmp_path
):
    first = SessionStore(engine, spill_dir=tmp_path, shared_spill=True)
    prefill(first, "a", list(range(10, 110)))
    assert first.checkpoints.flush(timeout_s=30)
    assert first.checkpoints.written == 1 and first.in_memory() == ["a"]
    assert len(list(tmp_path.glob("*.pt"))) == 1  # kept in memory and on disk
    prefill(first, "a", list(range(110, 130)))  # its save is queued again...
    second = SessionStore(engine, spill_dir=tmp_path, shared_spill=True)
    assert second.ids() == []  # ...nothing is adopted at start
    assert first.checkpoints.flush(timeout_s=30) and first.checkpoints.written == 2
    reference = engine.new_sequence()
    engine.prefill(reference, list(range(10, 110)))
    engine.prefill(reference, list(range(110, 130)))
    resumed = prefill(second, "a", [7])  # the replica holding it died: another takes it over
    assert torch.equal(resumed, engine.prefill(reference, [7]))
    with second.use("a") as session:
        assert len(session.token_ids) == 121
    assert second.taken_over == 1 and first.taken_over == 0
    assert len(list(tmp_path.glob("*.pt"))) == 1  # the file stays: it is the session's save
    assert second.checkpoints.flush(timeout_s=30) and second.checkpoints.failed == 0
    second.drop("a")
    assert list(tmp_path.glob("*.pt")) == []  # a session forgotten leaves no save behind
    first.checkpoints.close(30)
    second.checkpoints.close(30)


def test_a_request_writes_its_sessions_queued_save_before_it_runs(engine, tmp_path):
    store = SessionStore(engine, spill_dir=tmp_path, shared_spill=True)
    release = threading.Event()
    started = threading.Event()

    def slow_checkpoint(session_id: str) -> bool:  # the writer thread, held back
        started.set()
        release.wait(30)
        return store.checkpoint(session_id)

    store.checkpoints._save = slow_checkpoint
    prefill(store, "blocker", [1, 2, 3])  # the writer holds this one back
    assert started.wait(30)
    prefill(store, "a", list(range(10, 40)))  # queued behind it
    with store.use("a") as session:  # the next request writes it first
        saved = SequenceState.load(store._path("a"), engine.model)
        assert saved.token_ids == session.token_ids == list(range(10, 40))
    assert store.checkpoints.written == 1
    release.set()
    store.checkpoints.close(30)
    assert store.checkpoints.written == 3  # blocker, then a's save after the last request


def test_a_save_that_fails_after_a_request_is_counted_and_the_request_stands(engine, tmp_path):
    store = SessionStore(engine, spill_dir=tmp_path, shared_spill=True)
    store._path("a").mkdir()  # the file cannot be written: a directory holds its name
    logits = prefill(store, "a", list(range(10, 40)))
    assert store.checkpoints.flush(timeout_s=30)
    assert store.checkpoints.failed == 1 and store.checkpoints.written == 0
    assert logits.shape[-1] == engine.model.config.vocab_size
    assert store.in_memory() == ["a"]
    store.checkpoints.close(30)


def test_a_shared_spill_needs_a_spill_dir(engine):
    with pytest.raises(ValueError, match="spill_dir"):
        SessionStore(engine, shared_spill=True)
