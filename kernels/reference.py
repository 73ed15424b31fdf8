"""Reference attention over a store's live keys, returning the attention mass per cached token.

Contract shared by every attention kernel of the project:

    query  [B, Hq, q, D]     the new tokens' queries, RoPE applied
    keys   [B, Hkv, L, D]    the layer's live keys; the last q slots are the new tokens
    values [B, Hkv, L, D]
    ->
    out    [B, q, Hq, D]     attention output in the layout transformers' attention modules expect
    mass   [B, Hkv, L]       float32, probability each key received, summed over the q queries
                             and the Hq/Hkv query heads that share its KV head (GQA groups;
                             query head h reads KV head h // (Hq/Hkv), as transformers' repeat_kv)

Causality is positional inside the store: the store keeps tokens in arrival order and appends
the new ones at the end, so query i (0-based among the q new ones) sees slots j <= L - q + i.
Evicted tokens are simply absent, never masked.
"""

from __future__ import annotations

import torch


def causal_visibility(query_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """`[query_len, kv_len]` bool: may query i attend to slot j (j <= kv_len - query_len + i)."""
    rows = torch.arange(query_len, device=device)[:, None] + (kv_len - query_len)
    cols = torch.arange(kv_len, device=device)[None, :]
    return cols <= rows


def attention_with_mass(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of the new queries over the live store, plus attention mass per key.

    Scores, softmax and the weighted sum run in float32 whatever the input dtype; the output
    is cast back to the query's dtype.

    Args:
        query: `[B, Hq, q, D]`.
        keys, values: `[B, Hkv, L, D]` with `L >= q` and `Hq % Hkv == 0`.
        scaling: softmax scale (usually `D ** -0.5`).

    Returns:
        `(out [B, q, Hq, D], mass [B, Hkv, L] float32)`.

    Raises:
        ValueError: the head counts do not divide or `L < q`.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} KV heads")
    if kv_len < q_len:
        raise ValueError(f"store holds {kv_len} tokens, fewer than the {q_len} new queries")
    group = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * q_len, head_dim).float()  # [B, Hkv, G*q, D]
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling  # [B, Hkv, G*q, L]
    visible = causal_visibility(q_len, kv_len, query.device).repeat(group, 1)  # [G*q, L]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [B, Hkv, G*q, L] float32
    out = torch.matmul(probs, values.float()).to(query.dtype)  # [B, Hkv, G*q, D]
    out = out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2)  # [B, q, Hq, D]
    mass = probs.sum(dim=-2)  # [B, Hkv, L]
    return out, mass
