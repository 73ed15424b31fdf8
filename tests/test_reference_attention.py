"""The store's attention kernel against PyTorch SDPA, and the mass it reports."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.torch_attention import attention_with_mass


def sdpa_reference(query, keys, values, scaling):
    """SDPA with repeat_kv and a bottom-right-aligned causal mask: [B, q, Hq, D]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    q_len, kv_len = query.shape[2], keys.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    probs = torch.softmax(
        (query @ k.transpose(-1, -2)) * scaling + torch.where(mask, 0.0, float("-inf")), -1
    )
    return out.transpose(1, 2), probs


@pytest.mark.parametrize(
    "q_heads,kv_heads,q_len,kv_len,head_dim",
    [(9, 3, 1, 37, 64), (9, 3, 16, 16, 64), (8, 2, 5, 40, 128), (4, 4, 7, 7, 32)],
)
def test_output_and_mass_match_sdpa(q_heads, kv_heads, q_len, kv_len, head_dim):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, q_heads, q_len, head_dim, generator=gen)
    keys = torch.randn(1, kv_heads, kv_len, head_dim, generator=gen)
    values = torch.randn(1, kv_heads, kv_len, head_dim, generator=gen)
    scaling = head_dim**-0.5
    out, mass = attention_with_mass(query, keys, values, scaling)
    ref_out, ref_probs = sdpa_reference(query, keys, values, scaling)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    group = q_heads // kv_heads
    ref_mass = ref_probs.reshape(1, kv_heads, group, q_len, kv_len).sum(dim=(2, 3))
    torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-5)
    # every query's probabilities sum to one: the mass per KV head totals group * q_len
    torch.testing.assert_close(mass.sum(-1), torch.full((1, kv_heads), float(group * q_len)))


def test_new_tokens_see_only_their_past():
    query = torch.zeros(1, 2, 3, 8)
    keys = torch.randn(1, 1, 5, 8)
    values = torch.eye(5).repeat(1, 1, 1, 2)[..., :8].reshape(1, 1, 5, 8)
    _, mass = attention_with_mass(query, keys, values, 1.0)
    # zero queries spread uniformly over what they see: query i sees slots 0..2+i
    expected = 2 * torch.tensor([1 / 3 + 1 / 4 + 1 / 5] * 3 + [1 / 4 + 1 / 5, 1 / 5])
    torch.testing.assert_close(mass[0, 0], expected)


def test_rejects_mismatched_heads():
    with pytest.raises(ValueError, match="cannot share"):
        attention_with_mass(
            torch.zeros(1, 5, 1, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 1.0
        )
