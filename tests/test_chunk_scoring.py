"""Prefill scoring covers the whole chunk: which tokens a policy keeps does not follow where
the prompt's chunk boundaries fall."""

from __future__ import annotations

import pytest
import torch

from agent_kv.evals.texts import licence_text
from agent_kv.kv.attention import SCORE_STRIDE, SCORED_QUERIES, scored_offsets
from benchmarks.chunk_scoring import distribution, kept_heavy_hitters


def test_short_calls_score_every_query_and_long_chunks_a_stride_ending_at_the_last():
    assert scored_offsets(1, torch.device("cpu")).tolist() == [0]
    assert scored_offsets(SCORED_QUERIES, torch.device("cpu")).tolist() == list(
        range(SCORED_QUERIES)
    )
    offsets = scored_offsets(512, torch.device("cpu"))
    assert offsets[-1] == 511 and offsets[0] == 511 % SCORE_STRIDE
    assert (offsets.diff() == SCORE_STRIDE).all() and len(offsets) == 512 // SCORE_STRIDE


@pytest.mark.model
def test_h2o_keeps_the_same_spread_of_heavy_hitters_at_every_chunk_size(smollm):
    """2,048 tokens of licence text under h2o at budget 256: the heavy hitters kept are spread
    over the prompt alike when it is prefilled in chunks of 512, 256 or 128 tokens (total
    variation distance of their 128-token-bin distributions <= 0.1; it was 0.54 and 0.69 when
    only a chunk's last 64 queries were scored), and the last quarter of each 512-token chunk
    holds no more than its share (it held 89% of them then)."""
    ids = smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"][:2048]
    kept = {chunk: kept_heavy_hitters(smollm, ids, chunk, 256) for chunk in (512, 256, 128)}
    spread = {chunk: distribution(positions, len(ids)) for chunk, positions in kept.items()}
    for chunk in (256, 128):
        assert 0.5 * (spread[512] - spread[chunk]).abs().sum() <= 0.1
    assert ((kept[512] % 512) >= 384).float().mean() < 0.3
