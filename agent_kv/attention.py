"""Route a transformers model's attention through the KV store.

`register_attention()` registers, under the name `"agent_kv"`:
- an attention function (transformers `AttentionInterface`) that runs
  `kernels.reference.attention_with_mass` over the keys and values the cache returned and hands
  the attention mass to the store given as the `kv_store` keyword of the model call;
- a mask function (`AttentionMaskInterface`) that builds no mask: causality is positional
  inside the store (see `kernels.reference`), so no `[q, L]` mask is materialised.

Load a model with `attn_implementation="agent_kv"` (done by `agent_kv.model_loading`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kernels.reference import attention_with_mass

NAME = "agent_kv"
UNSUPPORTED_FEATURES = ("sliding_window", "softcap", "s_aux")
"""Attention keywords of some model families this function does not implement."""


def store_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_store=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the store.

    Args:
        module: the attention module; `module.layer_idx` names the layer.
        query: `[1, Hq, q, D]`; key, value: `[1, Hkv, L, D]`, the store's live tokens.
        attention_mask: ignored when None (the store's causality applies); a given 4D mask
            is refused, since the store never holds padding.
        scaling: softmax scale, default `D ** -0.5`.
        kv_store: the `agent_kv.store.KVStore` that receives the attention mass, if any.

    Returns:
        `(out [1, q, Hq, D], None)`.

    Raises:
        ValueError: an explicit attention mask, dropout, or a feature in
            `UNSUPPORTED_FEATURES` was requested.
    """
    if attention_mask is not None:
        raise ValueError("agent_kv attention takes no attention mask: the store holds no padding")
    if dropout:
        raise ValueError("agent_kv attention is inference-only (dropout must be 0)")
    unsupported = [name for name in UNSUPPORTED_FEATURES if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(
            f"agent_kv attention does not implement {', '.join(unsupported)} "
            "(sliding-window layers, logit soft-capping, attention sinks)"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, mass = attention_with_mass(query, key, value, scale)
    if kv_store is not None:
        group = query.shape[1] // key.shape[1]
        kv_store.record_attention(module.layer_idx, mass, query.shape[2], group)
    return out, None


def no_mask(*args, **kwargs) -> None:
    """Mask function for the store: the attention function applies causality itself."""
    return None


def register_attention() -> None:
    """Register `store_attention` and `no_mask` under the name `"agent_kv"` (idempotent)."""
    AttentionInterface.register(NAME, store_attention)
    AttentionMaskInterface.register(NAME, no_mask)
