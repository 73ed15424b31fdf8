"""Rotary position embeddings for the store's rerotate mode (StreamingLLM-style re-indexing).

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023), §3.2: a cache
that outlives the model's trained context assigns positions by place in the cache rather
than in the original text. In that mode the store keeps keys without rotation (`unrotate`
undoes the rotation the model applied) and rotates them at every read to their rank among
the live tokens, so the distance between a query and a key is the number of live tokens
between them.
"""

from __future__ import annotations

import inspect

import torch

from agent_kv.errors import ConfigError
from kernels.torch_attention import apply_rotation


class Rotary:
    """cos/sin tables of a model's rotary embedding.

    Args:
        rotary_emb: the model's rotary module, called as `rotary_emb(x, position_ids)` and
            returning `(cos, sin)` `[B, L, D]` (transformers' Llama, Qwen2/3, Mistral...).
        halved: the module returns tables over half the channels, `[B, L, D/2]` (gpt-oss:
            channels `i` and `i + D/2` turn by one angle, which is the rotate-half rotation
            with the tables repeated, so `cos_sin` repeats them).
    """

    def __init__(self, rotary_emb: torch.nn.Module, halved: bool = False):
        self.rotary_emb = rotary_emb
        self.halved = halved

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> Rotary:
        """The rotary embedding of a transformers causal LM.

        Raises:
            ConfigError: the model has no rotary embedding (e.g. GPT-2's learned positions),
                or one per layer type (Gemma-3's local and global RoPE bases), where rerotate
                mode turns every layer's keys with one table.
        """
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        if rotary is None:
            raise ConfigError(
                f"positions 'rerotate' needs a rotary-embedding model; "
                f"{type(model).__name__} has none"
            )
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            raise ConfigError(
                f"positions 'rerotate' needs one rotary embedding for every layer; "
                f"{type(model).__name__} has one per layer type: use original positions"
            )
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        device = next(model.parameters()).device
        probe = cls(rotary).cos_sin(torch.zeros(1, 1, dtype=torch.long, device=device))[0]
        return cls(rotary, halved=probe.shape[-1] * 2 == head_dim)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 `(cos, sin)`, each `[B, L, D]`, for integer `positions` `[B, L]`."""
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        cos, sin = self.rotary_emb(probe, positions)
        if self.halved:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos.float(), sin.float()

    @staticmethod
    def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Undo `apply_rotation(x, cos, sin)` for `x` `[B, H, L, D]` (also when the tables
        carry an attention scaling `a`: `cos^2 + sin^2 = a^2`)."""
        norm = (cos * cos + sin * sin)[:, None]
        return apply_rotation(x, cos, -sin) / norm
