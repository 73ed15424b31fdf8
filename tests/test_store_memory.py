"""Memory that is real and static: a bounded store allocates its bound once and keeps it, within
a tenth of it, and the peak of what its buffers held is tracked beside the live peak."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import random_tokens

from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import (
    CAPACITY_STEP,
    SCALE_CAPACITY_STEP,
    SHRINK_SLACK,
    Int8Config,
    KVStore,
    _capacity_bound,
    _fitted_capacity,
)

CHUNK = 512


@pytest.mark.parametrize(
    "current,needed,bound,expected",
    [
        (256, 10, 700, 704),  # a bound: its size, in whole grains, whatever is live
        (704, 300, 700, 704),  # kept while it holds the bound
        (768, 300, 700, 768),  # ... with at most a tenth to spare
        (832, 300, 700, 704),  # past that: fitted again
        (704, 900, 700, 960),  # a call that needs more gets it
        (256, 300, None, 512),  # no bound: doubling
        (512, 300, None, 512),
        (1024, 1025, None, 2048),
    ],
)
def test_capacities_follow_the_bound_or_double(current, needed, bound, expected):
    assert _fitted_capacity(current, needed, bound, CAPACITY_STEP) == expected


@pytest.mark.parametrize("step", [CAPACITY_STEP, SCALE_CAPACITY_STEP])
def test_no_sequence_of_lengths_passes_the_allocation_bound(step):
    rng = random.Random(0)
    for most in (10, step, step + 1, 3 * step - 5, 4 * step, 1000):
        for start in (0, step, 2 * step, 8 * step):
            for bounded in (False, True):
                capacity, limit = start, _capacity_bound(start, most, step)
                for _ in range(400):
                    needed = rng.randint(0, most)
                    bound = rng.randint(needed, most) if bounded else None
                    capacity = _fitted_capacity(capacity, needed, bound, step)
                    assert capacity <= limit, (most, start, capacity, limit)


def _conf_kv_int8_run(decode: int, confidence, pins: int = 40) -> tuple[KVStore, list[dict]]:
    """3,000 random tokens in 512-token chunks, then `decode` tokens, under conf-kv budget 512
    (`n_high` 256) with INT8 mixed precision (W 128, groups of 32), the first `pins` pinned,
    the store bounded as the engine bounds it before every call; per step the live and
    allocated bytes after it, the most allocated during it, and the bound's bytes."""
    torch.manual_seed(0)
    store = KVStore(4, 3, 16, int8=Int8Config())
    policy = make_policy("conf-kv", budget=512)
    store.pin(0, pins)
    steps = []

    def step(n: int, c: float | None) -> None:
        fp_bound, q_bound = policy.slot_bounds(store)
        store.bound_capacity(fp_bound, q_bound, CHUNK)
        random_tokens(store, n)
        policy.step(store, c)
        fp_slots = min(pins, store.seen_tokens) + fp_bound + CHUNK
        per_slot = store.bytes_per_token() // store.num_layers
        bound = store.num_layers * (fp_slots * per_slot + q_bound * per_slot // 4)
        steps.append(
            {
                "live": store.nbytes(),
                "allocated": store.allocated_nbytes(),
                "during": store.call_allocated_bytes,
                "bound": bound,
            }
        )

    for start in range(0, 3000, CHUNK):
        step(min(CHUNK, 3000 - start), None)
    for i in range(decode):
        step(1, confidence(i))
    return store, steps


def test_allocated_stays_within_a_tenth_of_the_bound():
    # uncertain and confident stretches of 50 tokens: the budget swings between 512 and 256
    store, steps = _conf_kv_int8_run(300, lambda i: 0.9 if (i // 50) % 2 else 0.1)
    scales = store.scales.nbytes(("keys", "values"))
    for s in steps[1:]:  # from the first full chunk on, the bound holds the store
        assert s["allocated"] - scales <= (1 + SHRINK_SLACK) * s["bound"], s
    assert scales <= 0.1 * store.allocated_nbytes()  # the scale rows are a small share


def test_a_steady_decode_keeps_its_buffers():
    store, _ = _conf_kv_int8_run(0, None)
    policy = make_policy("conf-kv", budget=512)
    held = []
    for _ in range(400):
        store.bound_capacity(*policy.slot_bounds(store), CHUNK)
        random_tokens(store, 1)
        policy.step(store, 0.9)
        held.append((store.fp["keys"], store.q["keys"], store.scales["keys"]))
    # every decode step of the session ran on the same buffers: static shapes
    assert all(all(a is b for a, b in zip(h, held[0], strict=True)) for h in held)
    fp_bound, q_bound = policy.slot_bounds(store)
    assert store.fp.capacity == -(-(40 + fp_bound + CHUNK) // 64) * 64
    assert store.q.capacity == q_bound == 512


def test_peak_allocated_is_the_most_any_step_held():
    store, steps = _conf_kv_int8_run(100, lambda i: 0.9)
    assert store.peak_allocated_bytes == max(s["during"] for s in steps)
    assert store.peak_allocated_bytes >= store.peak_bytes
    assert all(s["during"] >= s["allocated"] >= s["live"] for s in steps)


def test_peak_allocated_survives_saving():
    store, _ = _conf_kv_int8_run(10, lambda i: 0.9)
    restored = KVStore.from_state(store.state(trim=True))
    assert restored.peak_allocated_bytes == store.peak_allocated_bytes
    assert restored.allocated_nbytes() == store.allocated_nbytes()


def test_full_kv_reference_is_what_a_store_that_never_evicts_allocates():
    store = KVStore(2, 3, 16)
    for n in (512, 512, 512, 512, 512, 500, 1, 1):
        random_tokens(store, n)
        assert store.allocated_nbytes() == store.full_kv_allocated_nbytes()
    assert store.full_kv_allocated_nbytes() == 4096 * store.bytes_per_token()  # 3,062 seen
    assert store.full_kv_nbytes() == 3062 * store.bytes_per_token()
    assert store.allocated_nbytes(row=0) == store.allocated_nbytes()  # one row: all of it
