"""A session saved to disk resumes with the same logits; a cache truncates back to where a
client rewrote history, when that is exact."""

from __future__ import annotations

import pytest
import torch
from helpers import random_tokens

from agent_kv.errors import AgentKVError
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config, KVStore
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import SequenceOutline, SequenceState

TEXT = (
    "Order 1182 shipped on Monday: two lamps and a rug. The courier left a note at the door. "
    "Order 1183 is waiting for a replacement part. Customer service answers within a day. "
) * 10


@pytest.mark.parametrize("rerotate", [False, True])
def test_saved_session_resumes_with_identical_logits(smollm, tmp_path, rerotate):
    ids = smollm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    policy = make_policy("conf-kv", budget=128, protect_recent=16)
    engine = Engine(
        smollm.model,
        smollm.tokenizer,
        policy,
        64,
        Int8Config(fp_window=16, group=8),
        rerotate=rerotate,
    )
    session = engine.new_sequence()
    session.store.pins.pin(0, 10)
    engine.prefill(session, ids[:300])
    assert session.store.figures.evicted_tokens > 0 and session.store.figures.quantized_tokens > 0
    session.save(tmp_path / "s.pt")
    restored = SequenceState.load(tmp_path / "s.pt", smollm.model)
    assert restored.token_ids == session.token_ids
    assert torch.equal(restored.last_logits, session.last_logits)
    assert restored.store.nbytes() == session.store.nbytes()
    for token in ids[300:320]:
        assert torch.equal(engine.prefill(restored, [token]), engine.prefill(session, [token]))
    assert restored.store.lengths() == session.store.lengths()
    assert restored.store.pins.mask(3).sum() == 10


def test_a_saved_file_holds_live_bytes_and_says_what_loading_allocates(smollm, tmp_path):
    engine = Engine(
        smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=128, protect_recent=16),
        64, Int8Config(fp_window=16, group=8),
    )  # fmt: skip
    session = engine.new_sequence()
    engine.prefill(session, smollm.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:300])
    session.save(tmp_path / "s.pt", {"session_id": "x"})
    live, allocated = session.store.nbytes(), session.store.allocated_nbytes()
    size = (tmp_path / "s.pt").stat().st_size
    assert size < live + 2_000_000 < allocated  # live slots (and metadata), no spare capacity
    outline = SequenceOutline.read(tmp_path / "s.pt")
    restored = SequenceState.load(tmp_path / "s.pt", smollm.model)
    assert outline.footprint == restored.store.footprint()  # known before loading
    assert outline.footprint.live_bytes == live and outline.meta == {"session_id": "x"}


def test_loading_a_bad_or_foreign_file_is_a_clear_error(smollm, tmp_path):
    with pytest.raises(AgentKVError, match="cannot load session"):
        SequenceState.load(tmp_path / "missing.pt", smollm.model)
    (tmp_path / "junk.pt").write_bytes(b"not a session")
    with pytest.raises(AgentKVError, match="cannot load session"):
        SequenceState.load(tmp_path / "junk.pt", smollm.model)
    other = SequenceState(store=KVStore(2, 1, 8), cache=None)
    random_tokens(other.store, 3)
    other.save(tmp_path / "other.pt")
    with pytest.raises(AgentKVError, match=r"\[2, 1, 8\]"):
        SequenceState.load(tmp_path / "other.pt", smollm.model)


def test_truncate_returns_the_cache_to_an_earlier_point_exactly(smollm):
    ids = smollm.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:120]
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=32)
    reference = engine.new_sequence()
    expected = [engine.prefill(reference, ids[:80])]
    expected += [engine.prefill(reference, [t]) for t in ids[80:90]]
    session = engine.new_sequence()
    engine.prefill(session, ids)  # a longer history, then the client rewrites from token 80
    session.store.truncate(80)
    assert session.store.lengths() == [80] * 30 and session.store.seen_tokens == 80
    got = [engine.prefill(session, [t]) for t in ids[80:90]]
    for a, b in zip(got, expected[1:], strict=True):
        assert (a - b).abs().max() < 1e-4


def test_truncate_refuses_past_an_eviction():
    store = KVStore(1, 1, 4)
    random_tokens(store, 50)
    make_policy("window", budget=20, evict_slack=0).evict(store, None)
    assert store.segments.changed_at == [50]
    with pytest.raises(ValueError, match="exact only back to 50"):
        store.truncate(40)
    with pytest.raises(ValueError, match="not in this store's 1 rows"):
        store.truncate(50, row=1)
    with pytest.raises(ValueError, match="to 50.5 tokens"):
        store.truncate(50.5)
    store.truncate(50)  # nothing to forget: fine


def test_a_damaged_or_malformed_file_is_refused_whole(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    sequence = engine.new_sequence()
    engine.prefill(sequence, list(range(10, 60)))
    path = tmp_path / "s.pt"
    sequence.save(path)
    data = bytearray(path.read_bytes())
    # bytes changed inside a tensor's record: torch.load reads them, the checksum does not
    start = data.find(b"data/0") + 200
    data[start : start + 64] = bytes(64)
    (tmp_path / "bytes.pt").write_bytes(bytes(data))
    with pytest.raises(AgentKVError, match="is damaged"):
        SequenceState.load(tmp_path / "bytes.pt", smollm.model)
    saved = torch.load(path, weights_only=True)
    for name, change in {
        "no_store": lambda d: d.pop("store"),
        "no_shape": lambda d: d["store"].pop("shape"),
        "no_tokens": lambda d: d.pop("token_ids"),
        "bad_steps": lambda d: d.__setitem__("steps", [{"bogus": 1}]),
        "store_none": lambda d: d.__setitem__("store", None),
    }.items():
        broken = torch.load(path, weights_only=True)
        change(broken)
        torch.save(broken, tmp_path / f"{name}.pt")
        with pytest.raises(AgentKVError, match="cannot be restored"):
            SequenceState.load(tmp_path / f"{name}.pt", smollm.model)
    restored = SequenceState.load(path, smollm.model)  # the intact file still loads
    assert restored.token_ids == saved["token_ids"]
