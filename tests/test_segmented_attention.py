"""The store's block-wise attention read against the dense oracle: INT8 segments, ragged rows,
several blocks, rotation; and the INT8 quantizer's error bound."""

from __future__ import annotations

import pytest
import torch

from kernels.int8 import QMAX, dequantize, quantize_groups
from kernels.torch_attention import (
    Segment,
    apply_rotation,
    attention_with_mass,
    fused_attention,
    sampled_mass,
    segmented_attention,
)


def int8_segment(keys: torch.Tensor, values: torch.Tensor, group: int, lengths: list[int]):
    """Quantize `[B, H, L, D]` tensors row by row; returns the segment and the dequantized
    keys and values the oracle should see."""
    batch, heads, length, dim = keys.shape
    parts = [quantize_groups(t[b], group) for b in range(batch) for t in (keys, values)]
    q_keys = torch.stack([parts[2 * b][0] for b in range(batch)])
    q_values = torch.stack([parts[2 * b + 1][0] for b in range(batch)])
    key_scales = torch.stack([parts[2 * b][1] for b in range(batch)])
    value_scales = torch.stack([parts[2 * b + 1][1] for b in range(batch)])
    index = (torch.arange(length) // group).expand(batch, length).contiguous()
    segment = Segment(q_keys, q_values, lengths, False, key_scales, value_scales, index)
    expand = index[:, None, :, None].expand(batch, heads, length, dim)
    deq_keys = dequantize(q_keys, torch.gather(key_scales, 2, expand))
    deq_values = dequantize(q_values, torch.gather(value_scales, 2, expand))
    return segment, deq_keys, deq_values


@pytest.mark.parametrize("q_heads,kv_heads,q_len,head_dim", [(9, 3, 1, 64), (8, 2, 5, 128)])
def test_int8_then_fp_segments_match_dense_attention(q_heads, kv_heads, q_len, head_dim):
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    n_q, n_fp = 96, 20
    query = randn(1, q_heads, q_len, head_dim)
    segment, deq_k, deq_v = int8_segment(
        randn(1, kv_heads, n_q, head_dim), randn(1, kv_heads, n_q, head_dim), 32, [n_q]
    )
    fp_k, fp_v = randn(1, kv_heads, n_fp, head_dim), randn(1, kv_heads, n_fp, head_dim)
    fp = Segment(fp_k, fp_v, [n_fp], causal=True)
    scaling = head_dim**-0.5
    out, (mass_q, mass_fp) = segmented_attention(query, [segment, fp], scaling, block=40)
    ref_out, ref_mass = attention_with_mass(
        query, torch.cat([deq_k, fp_k], 2), torch.cat([deq_v, fp_v], 2), scaling
    )
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([mass_q, mass_fp], -1), ref_mass, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_attention(query, [segment, fp], scaling), ref_out)


def test_ragged_rows_are_masked_not_padded():
    gen = torch.Generator().manual_seed(1)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q_len, lengths_q, lengths_fp = 3, [64, 0, 33], [10, 3, 25]
    query = randn(3, 4, q_len, 16)
    segment, deq_k, deq_v = int8_segment(randn(3, 2, 64, 16), randn(3, 2, 64, 16), 16, lengths_q)
    # garbage past each row's length must not matter
    fp_k, fp_v = randn(3, 2, 25, 16) * 100, randn(3, 2, 25, 16) * 100
    fp = Segment(fp_k, fp_v, lengths_fp, causal=True)
    out, (mass_q, mass_fp) = segmented_attention(query, [segment, fp], 0.25, block=24)
    for b in range(3):
        nq, nf = lengths_q[b], lengths_fp[b]
        ref_out, ref_mass = attention_with_mass(
            query[b : b + 1],
            torch.cat([deq_k[b : b + 1, :, :nq], fp_k[b : b + 1, :, :nf]], 2),
            torch.cat([deq_v[b : b + 1, :, :nq], fp_v[b : b + 1, :, :nf]], 2),
            0.25,
        )
        torch.testing.assert_close(out[b : b + 1], ref_out, atol=1e-5, rtol=1e-5)
        got_mass = torch.cat([mass_q[b : b + 1, :, :nq], mass_fp[b : b + 1, :, :nf]], -1)
        torch.testing.assert_close(got_mass, ref_mass, atol=1e-5, rtol=1e-5)
        assert mass_q[b, :, nq:].abs().sum() == 0 and mass_fp[b, :, nf:].abs().sum() == 0
    # values of size ~100: the fused kernel's other summation order differs by ~1e-5 relative
    torch.testing.assert_close(
        fused_attention(query, [segment, fp], 0.25), out, rtol=1e-4, atol=1e-3
    )


def test_sampled_mass_sums_the_chosen_queries_each_under_its_causal_limit():
    gen = torch.Generator().manual_seed(4)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q_len, lengths_q, lengths_fp = 7, [40, 12], [7, 9]
    query = randn(2, 6, q_len, 16)
    segment, _, _ = int8_segment(randn(2, 2, 40, 16), randn(2, 2, 40, 16), 8, lengths_q)
    fp = Segment(randn(2, 2, 9, 16), randn(2, 2, 9, 16), lengths_fp, causal=True)
    segments = [segment, fp]
    # every query: the block-wise read's mass
    _, whole = segmented_attention(query, segments, 0.25)
    every = sampled_mass(query, torch.arange(q_len), segments, 0.25)
    for got, want in zip(every, whole, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a sample: the sum of each chosen query's own mass (the read of that one query, whose
    # last segment ends at its own position)
    chosen = [1, 4, 6]
    got = sampled_mass(query, torch.tensor(chosen), segments, 0.25)
    for b in range(2):
        want_q = torch.zeros(2, 40)
        want_fp = torch.zeros(2, 9)
        for i in chosen:
            upto = lengths_fp[b] - q_len + i + 1
            own = Segment(fp.keys[b : b + 1], fp.values[b : b + 1], [upto], causal=True)
            row = Segment(
                segment.keys[b : b + 1],
                segment.values[b : b + 1],
                [lengths_q[b]],
                False,
                segment.key_scales[b : b + 1],
                segment.value_scales[b : b + 1],
                segment.scale_index[b : b + 1],
            )
            _, (mass_q, mass_fp) = segmented_attention(
                query[b : b + 1, :, i : i + 1], [row, own], 0.25
            )
            want_q += mass_q[0]
            want_fp += mass_fp[0]
        torch.testing.assert_close(got[0][b], want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1][b], want_fp, atol=1e-5, rtol=1e-5)


def test_rotation_is_applied_to_keys_at_read():
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 1, 6, 8, generator=gen), torch.randn(1, 1, 6, 8, generator=gen)
    angles = torch.arange(6.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001]).repeat(2)
    cos, sin = angles.cos()[None], angles.sin()[None]
    query = torch.randn(1, 2, 2, 8, generator=gen)
    rotated = Segment(keys, values, [6], causal=True, cos=cos, sin=sin)
    out, _ = segmented_attention(query, [rotated], 0.3)
    ref_out, _ = attention_with_mass(query, apply_rotation(keys, cos, sin), values, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_attention(query, [rotated], 0.3), ref_out)


def test_int8_error_is_within_half_a_step_per_channel():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 16, generator=gen)
    x[:, :, 3] *= 40.0  # an outlier channel, as keys have
    q, scales = quantize_groups(x, 32)
    assert q.dtype == torch.int8 and scales.shape == (2, 2, 16)
    per_token = scales.repeat_interleave(32, dim=1)
    error = (dequantize(q, per_token) - x).abs()
    assert (error <= per_token.float() / 2 + 1e-6).all()
    # the outlier channel's scale does not coarsen the others (per-channel scales)
    assert error[:, :, 0].max() < 0.05 < error[:, :, 3].max()
    assert int(q.abs().max()) == QMAX
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_groups(x[:, :40], 32)
