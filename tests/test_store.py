"""KVStore bookkeeping: append, compaction, scores, pins, capacities and exact byte accounting."""

from __future__ import annotations

import pytest
import torch
from helpers import append_tokens, kept_positions, recorded_call

from agent_kv.errors import ConfigError, ContextOverflowError
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.forward_call import ForwardCall, append_kv
from agent_kv.kv.policies.conf_kv import AttentionEma
from agent_kv.kv.policies.h2o import AccumulatedMass
from agent_kv.kv.store import BLOCK_TOKENS, Int8Config, KVStore

MASS_STATISTICS = (AttentionEma(), AccumulatedMass())
"""CONF-KV's and H2O's statistics, both folded from every call's attention mass."""
MASS_PLAN = CallPlan(statistics=MASS_STATISTICS)


def filled_store(tokens: int, layers: int = 2, heads: int = 3, dim: int = 4) -> KVStore:
    store = KVStore(layers, heads, dim)
    # key channel 0 holds the token's position, so gathers can be checked
    keys = torch.arange(tokens, dtype=torch.float32).view(1, 1, tokens, 1)
    append_tokens(store, keys.expand(1, heads, tokens, dim).clone())
    return store


def live(store: KVStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = store.fp.lengths[layer][0]
    return store.fp["keys"][layer, :1, :, :n], store.fp["values"][layer, :1, :, :n]


def live_tensor_bytes(store: KVStore) -> int:
    return sum(k.nbytes + v.nbytes for k, v in (live(store, i) for i in range(store.num_layers)))


def test_append_keeps_positions_and_lengths():
    store = KVStore(2, 3, 4)
    keys = torch.randn(1, 3, 5, 4)
    append_tokens(store, keys)
    assert torch.equal(live(store, 1)[0], keys) and torch.equal(live(store, 0)[1], -keys)
    assert store.seen_tokens == 5 and store.lengths() == [5, 5]
    assert kept_positions(store) == [0, 1, 2, 3, 4]


def test_compact_gathers_kept_tokens_to_the_front():
    store = filled_store(10)
    store.compact(0, torch.tensor([1, 4, 9]))
    keys, values = live(store, 0)
    assert keys[0, 0, :, 0].tolist() == [1.0, 4.0, 9.0]
    assert values[0, 2, :, 3].tolist() == [-1.0, -4.0, -9.0]
    assert kept_positions(store) == [1, 4, 9]
    assert store.lengths() == [3, 10]
    assert store.figures.evicted_tokens == 7
    # the next token still takes the next original position
    append_tokens(store, torch.zeros(1, 3, 1, 4))
    assert kept_positions(store) == [1, 4, 9, 10]


def test_bytes_are_exactly_the_live_tensors():
    store = filled_store(300)
    per_token = 2 * 2 * 3 * 4 * 4  # k+v, layers, heads, dim, fp32 bytes
    assert store.bytes_per_token() == per_token
    assert store.nbytes() == live_tensor_bytes(store) == 300 * per_token
    store.compact(1, torch.arange(0, 300, 3))
    assert store.nbytes() == live_tensor_bytes(store) == (300 + 100) * per_token // 2
    assert store.allocated_nbytes() >= store.nbytes()
    assert store.figures.peak_bytes == 300 * per_token
    assert store.full_kv_nbytes() == 300 * per_token


def test_an_unbounded_store_grows_in_blocks_and_compacts_in_place():
    store = filled_store(300)
    assert store.fp.capacity == 320  # 300 + 5% in whole 32-token blocks
    buffer = store.fp["keys"]
    store.compact(0, torch.arange(10))
    assert store.fp["keys"] is buffer  # compaction moves slots in place
    assert live(store, 0)[0][0, 0, :, 0].tolist() == [float(i) for i in range(10)]


def test_a_bound_is_never_allocated_ahead_the_capacity_follows_the_live_tokens():
    store = filled_store(100)
    store.bound_capacity(fp_tokens=200, q_tokens=0, chunk=64)
    append_tokens(store, torch.zeros(1, 3, 1, 4))
    assert store.fp.capacity == 128  # 101 live: never the bound's 264 ahead of need
    buffer = store.fp["keys"]
    for _ in range(20):  # decode steps within the headroom: the buffers, so every shape, stay
        append_tokens(store, torch.zeros(1, 3, 1, 4))
    assert store.fp["keys"] is buffer
    store.compact(0, torch.arange(10))
    store.compact(1, torch.arange(10))
    append_tokens(store, torch.zeros(1, 3, 1, 4))  # 11 live: shrunk to one block
    assert store.fp.capacity == BLOCK_TOKENS
    assert store.allocated_nbytes() == 2 * 2 * 3 * BLOCK_TOKENS * 4 * 4
    assert store.decode_widths()["fp"] == BLOCK_TOKENS  # a static decode reads what is held


def scored_call(
    store: KVStore,
    n: int,
    masses: list[torch.Tensor],
    scored=None,
    plan: CallPlan = MASS_PLAN,
) -> None:
    """One forward call of `n` zero tokens on a one-layer store under `plan`, with the given
    attention masses (stored FP segment, then the new tokens) recorded."""
    call = ForwardCall.open(store, range(1), n, plan)
    zeros = torch.zeros(1, store.kv_heads, n, store.head_dim)
    call.segments(0)
    call.stage(0, zeros, zeros)
    call.record_attention(0, masses, group=1, scored=scored)
    call.close()


def test_scores_normalise_by_visible_queries():
    store = filled_store(2, layers=1, heads=1)
    store.ensure_columns(MASS_STATISTICS)
    store.fp["scores"][0, 0, :, :2] = 1.0
    # a 2-query chunk (tokens 2, 3) on top of 2 old tokens, group of 1
    scored_call(store, 2, [torch.tensor([[[0.8, 0.4]]]), torch.tensor([[[0.6, 0.2]]])])
    decay = AttentionEma().decay
    expected = [decay + (1 - decay) * 0.4, decay + (1 - decay) * 0.2, 0.6 / 2, 0.2 / 1]
    torch.testing.assert_close(store.live_meta("scores", 0)[0], torch.tensor(expected))


def test_scores_from_a_sample_of_queries_normalise_by_the_queries_that_see_each_token():
    store = filled_store(2, layers=1, heads=1)
    store.ensure_columns(MASS_STATISTICS)
    store.fp["scores"][0, 0, :, :2] = 1.0
    # a 4-query chunk (tokens 2..5) whose mass was measured over queries 1 and 3 of the call
    masses = [torch.tensor([[[0.6, 0.2]]]), torch.tensor([[[0.4, 0.2, 0.4, 0.2]]])]
    scored_call(store, 4, masses, scored=torch.tensor([1, 3]))
    decay = AttentionEma().decay
    old = [decay + (1 - decay) * 0.3, decay + (1 - decay) * 0.1]
    # tokens 2, 3 are seen by both scored queries, tokens 4, 5 by the last one only
    expected = [*old, 0.4 / 2, 0.2 / 2, 0.4 / 1, 0.2 / 1]
    torch.testing.assert_close(store.live_meta("scores", 0)[0], torch.tensor(expected))
    # H2O's accumulated mass counts each sampled query for the 4 / 2 queries it stands for
    accumulated = store.live_meta("accumulated", 0)[0]
    torch.testing.assert_close(accumulated, torch.cat([masses[0][0, 0], masses[1][0, 0]]) * 2)


def test_a_policy_that_ranks_by_nothing_records_nothing():
    store = filled_store(2, layers=1, heads=1)
    masses = [torch.tensor([[[0.8, 0.4]]]), torch.tensor([[[0.6, 0.2]]])]
    scored_call(store, 2, masses, plan=CallPlan())
    assert not store.live_meta("scores", 0).any() and not store.live_meta("accumulated", 0).any()


def test_a_store_holds_the_columns_of_the_statistics_its_calls_fold():
    store = KVStore(1, 1, 4)
    append_kv(store, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    assert store.segments.columns == {}  # no statistic asked for: no column held
    masses = [torch.tensor([[[0.8, 0.4]]]), torch.tensor([[[0.6, 0.2]]])]
    scored_call(store, 2, masses)
    assert set(store.segments.columns) == {"scores", "accumulated"}
    assert store.fp["scores"].shape == store.fp["positions"].shape[:2] + (1, store.fp.capacity)
    assert store.live_meta("scores", 0).shape == (1, 4)  # the 2 older tokens at 0, held since


def test_pins_follow_positions_through_compaction():
    store = filled_store(8, layers=1)
    store.pins.pin(2, 4)
    assert store.pins.mask(0).tolist() == [False, False, True, True, False, False, False, False]
    assert store.pins.live() == [[2]]
    store.compact(0, torch.tensor([0, 3, 7]))
    assert store.pins.mask(0).tolist() == [False, True, False]
    assert store.pins.live() == [[1]]
    store.pins.unpin(3, 4)
    assert not store.pins.mask(0).any() and store.pins.live() == [[0]]


def test_rejects_bad_rows_and_sizes():
    store = KVStore(1, 3, 4, batch=2)
    with pytest.raises(ValueError, match="ascending range"):
        ForwardCall.open(store, range(1, 3), 1)
    with pytest.raises(ValueError, match="ascending range"):
        ForwardCall.open(store, range(2), 0)
    with pytest.raises(ValueError, match="decay must lie"):
        AttentionEma(decay=1.0)
    with pytest.raises(ValueError, match="positive"):
        KVStore(0, 1, 1)


def test_pin_spans_are_validated_and_pins_grow_with_the_episode():
    store = filled_store(4, layers=1)
    with pytest.raises(ValueError, match="invalid position span"):
        store.pins.pin(5, 2)
    with pytest.raises(ValueError, match="invalid position span"):
        store.pins.unpin(-1, 3)
    store.pins.pin(1000, 1001)  # beyond the tokens seen: applies when that position arrives
    for _ in range(1000):
        append_tokens(store, torch.zeros(1, 3, 1, 4))
    mask = store.pins.mask(0)
    assert mask.sum().item() == 1 and mask[1000]
    assert store.pins.live() == [[1]]  # counted as it arrived


def int8_store(tokens: int, window: int = 8, group: int = 4) -> KVStore:
    store = KVStore(1, 2, 4, int8=Int8Config(fp_window=window, group=group))
    keys = torch.arange(tokens, dtype=torch.float32).view(1, 1, tokens, 1).expand(1, 2, tokens, 4)
    append_tokens(store, keys.clone())
    return store


def quantized_keys(store: KVStore, n: int) -> torch.Tensor:
    """`[H, n, D]` float: the first `n` quantized keys of layer 0, row 0, dequantized."""
    codes = store.q["keys"][0, 0, :, :n].float()
    return codes * store.scales["keys"][0, 0][:, store.q["group"][0, 0, :n]].float()


def test_tokens_leaving_the_fp_window_move_to_int8_in_whole_groups():
    store = int8_store(30)
    store.pins.pin(2, 4)
    moved = store.precision.quantize_stale()
    # 28 unpinned, 8 stay in the window: 20 stale, moved as 5 groups of 4
    assert moved == 20 and store.q.lengths == [[20]] and store.fp.lengths == [[10]]
    assert store.scales.lengths == [[5]]
    assert kept_positions(store) == [0, 1, *range(4, 22), 2, 3, *range(22, 30)]
    assert store.pins.mask(0).tolist() == [False] * 20 + [True, True] + [False] * 8
    # INT8 keys read back as their positions, to within half a quantization step
    expected = torch.tensor([0, 1, *range(4, 22)], dtype=torch.float32)
    assert (quantized_keys(store, 20)[0, :, 0] - expected).abs().max() <= 21 / 127 / 2 + 1e-3
    assert store.precision.quantize_stale() == 0  # nothing more until a whole group is stale


def test_int8_bytes_count_int8_values_and_scales_exactly():
    store = int8_store(30)
    store.precision.quantize_stale()
    fp_bytes = 2 * 10 * 2 * 4 * 4  # keys + values, 10 tokens, fp32
    int8_bytes = 2 * 20 * 2 * 4
    scale_bytes = 2 * 5 * 2 * 4 * 2  # float16, 5 groups
    assert store.nbytes() == fp_bytes + int8_bytes + scale_bytes == 640 + 320 + 160
    # evicting every token of two groups drops their scales
    keep = torch.tensor([*range(8, 20), *range(20, 30)])
    store.compact(0, keep)
    assert store.scales.lengths == [[3]] and store.q.lengths == [[12]]
    assert store.nbytes() == 640 + 2 * 12 * 2 * 4 + 2 * 3 * 2 * 4 * 2
    assert (quantized_keys(store, 12)[0, :, 0] - torch.arange(8, 20)).abs().max() < 0.1


def test_rows_keep_their_own_lengths_and_bytes():
    store = KVStore(2, 2, 4, batch=3)
    append_tokens(store, torch.randn(3, 2, 10, 4), rows=range(3))
    append_tokens(store, torch.randn(1, 2, 5, 4), rows=range(1, 2))
    store.compact(0, torch.arange(4), row=2)
    assert [store.lengths(r) for r in range(3)] == [[10, 10], [15, 15], [4, 10]]
    assert [store.seen(r) for r in range(3)] == [10, 15, 10]
    per_token_layer = 2 * 2 * 4 * 4
    assert store.nbytes(1) == 30 * per_token_layer
    assert store.nbytes() == sum(store.nbytes(r) for r in range(3)) == 64 * per_token_layer
    assert store.figures.row_peak_bytes == [
        20 * per_token_layer,
        30 * per_token_layer,
        20 * per_token_layer,
    ]


def test_pins_name_a_real_row_and_int8_settings_are_whole_numbers():
    store = KVStore(1, 1, 4, batch=2)
    with pytest.raises(ValueError, match="row 2"):
        store.pins.pin(0, 3, row=2)
    with pytest.raises(ValueError, match="row -1"):
        store.pins.unpin(0, 3, row=-1)
    for bad in (Int8Config(group=2.5), Int8Config(fp_window=1.5), Int8Config(group=0)):
        with pytest.raises(ConfigError, match="whole number"):
            KVStore(1, 1, 4, int8=bad)


def test_no_forward_call_passes_the_context():
    store = KVStore(1, 1, 4, max_positions=10)
    append_tokens(store, torch.zeros(1, 1, 10, 4))
    with pytest.raises(ContextOverflowError, match="position 10 is past the model's 10-token"):
        ForwardCall.open(store, range(1), 1)


def test_a_saved_store_loads_back_with_its_capacity_and_contents():
    store = int8_store(30)
    store.pins.pin(2, 4)
    store.precision.quantize_stale()
    store.bound_capacity(fp_tokens=40, q_tokens=64, chunk=8)
    append_tokens(store, torch.ones(1, 2, 1, 4))
    trimmed = store.state(trim=True)
    assert trimmed["fp"]["keys"].shape[3] == store.fp.most()  # only live slots saved
    loaded = KVStore.from_state(trimmed)
    assert loaded.fp.capacity == store.fp.capacity and loaded.q.capacity == store.q.capacity
    assert loaded.allocated_nbytes() == store.allocated_nbytes()
    assert loaded.nbytes() == store.nbytes() and loaded.seen_tokens == 31
    assert kept_positions(loaded) == kept_positions(store)
    assert torch.equal(quantized_keys(loaded, 20), quantized_keys(store, 20))
    assert loaded.pins.live() == [[2]]


def test_a_store_saved_with_the_old_observation_mass_name_loads_it_under_the_new(tmp_path):
    store = KVStore(1, 2, 4)
    keys = torch.randn(1, 2, 6, 4)
    observed = torch.rand(1, 2, 6)
    recorded_call(store, keys, window=observed, observed=3)
    mass = store.live_meta("observation_mass", 0)
    assert torch.equal(mass, observed[0])  # the call's observation-window mass, per KV head
    state = store.state(trim=True)
    for table in ("fp", "q"):  # as a session saved before the rename holds it
        state[table] = {
            ("window_mass" if field == "observation_mass" else field): tensor
            for field, tensor in state[table].items()
        }
    torch.save(state, tmp_path / "store.pt")
    loaded = KVStore.from_state(torch.load(tmp_path / "store.pt"))
    assert "window_mass" not in loaded.fp.fields and "window_mass" not in loaded.q.fields
    assert torch.equal(loaded.live_meta("observation_mass", 0), mass)
    assert kept_positions(loaded) == list(range(6))


def test_a_call_closes_once():
    store = KVStore(1, 1, 4)
    call = ForwardCall.open(store, range(1), 2)
    call.stage(0, torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    call.close()
    with pytest.raises(ValueError, match="closed already"):
        call.close()
    assert store.seen_tokens == 2 and store.lengths() == [2]


def test_tokens_for_another_number_of_layers_are_refused():
    store = KVStore(2, 1, 4)
    with pytest.raises(ValueError, match="keys for 3 layers, the store has 2"):
        append_kv(store, torch.zeros(3, 1, 1, 2, 4), torch.zeros(3, 1, 1, 2, 4))
    assert store.seen_tokens == 0
