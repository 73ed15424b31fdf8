"""KVzip: the reconstruction pass scores the cache by the most any reconstruction query
attends to each token, and leaves the cache as it found it."""

from __future__ import annotations

import pytest
import torch
from helpers import random_tokens

from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import KVStore
from agent_kv.runtime.engine.engine import Engine
from kernels.torch_attention import Segment, sampled_mass

TEXT = (
    "Order 1182 shipped on Monday: two lamps and a rug. The courier left a note at the door. "
    "Order 1183 is waiting for a replacement part. Customer service answers within a day. "
) * 6


def test_the_max_reduction_takes_the_largest_probability_over_queries_and_grouped_heads():
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, 6, 8, generator=gen)  # 2 query heads per KV head
    keys, values = torch.randn(1, 2, 10, 8, generator=gen), torch.randn(1, 2, 10, 8, generator=gen)
    segments = [Segment(keys, values, [10], causal=True)]
    got = sampled_mass(query, torch.arange(6), segments, 0.5, reduce="max")[0]  # [1, 2, 10]
    logits = torch.einsum("bhqd,bhkd->bhqk", query, keys.repeat_interleave(2, 1)) * 0.5
    causal = torch.arange(10)[None] <= torch.arange(6)[:, None] + 4  # query i sees 4 + i
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    want = probs.reshape(1, 2, 2 * 6, 10).amax(dim=2)
    torch.testing.assert_close(got, want)


def test_kvzip_keeps_the_tokens_with_the_largest_reconstruction_scores():
    store = KVStore(1, 2, 4)
    random_tokens(store, 12)
    reconstruction = store.fp["reconstruction"][0, 0]  # [H, C]
    reconstruction[0, :12] = torch.tensor([9, 0, 0, 5, 0, 7, 0, 0, 0, 0, 0, 0.0])
    reconstruction[1, :12] = torch.tensor([0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0.0])
    policy = make_policy("kvzip", budget=6, protect_recent=2, sinks=1, evict_slack=0)
    policy.evict(store, None)
    # the sink (0), the 2 newest (10, 11), and the top scores by their best head: 5, 2, 3
    assert store.live_positions(0).tolist() == [0, 2, 3, 5, 10, 11]


@pytest.mark.model
def test_the_reconstruction_pass_leaves_the_cache_as_it_found_it(smollm):
    ids = smollm.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:150]
    kvzip = Engine(smollm.model, smollm.tokenizer, make_policy("kvzip", budget=4096), 64)
    full = Engine(smollm.model, smollm.tokenizer, make_policy("full"), 64)
    sessions = [kvzip.new_sequence(), full.new_sequence()]
    logits = [e.prefill(s, ids) for e, s in zip((kvzip, full), sessions, strict=True)]
    assert torch.equal(logits[0], logits[1])
    zipped, plain = (s.store for s in sessions)
    assert zipped.seen_tokens == plain.seen_tokens == len(ids)
    assert zipped.num_layers == plain.num_layers
    for layer in range(zipped.num_layers):
        assert zipped.length(layer) == plain.length(layer) == len(ids)
        assert torch.equal(
            zipped.fp["keys"][layer, 0, :, : len(ids)], plain.fp["keys"][layer, 0, :, : len(ids)]
        )
        assert (zipped.live_meta("reconstruction", layer) > 0).all()  # every token was scored
    step = [e.prefill(s, ids[:1]) for e, s in zip((kvzip, full), sessions, strict=True)]
    assert torch.equal(step[0], step[1])
