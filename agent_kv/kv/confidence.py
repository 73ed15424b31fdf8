"""CONF-KV's confidence score (docs/methods.md, CONF-KV §1).

    c = w_H * (1 - H_norm) + w_m * sigmoid(m) + w_p * p_top1

with H_norm the next-token entropy divided by log(vocab), m = log p1 - log p2 the top-2
log-probability margin, p_top1 the top probability, and (w_H, w_m, w_p) = (0.4, 0.3, 0.3).
"""

from __future__ import annotations

import math

import torch

DEFAULT_WEIGHTS = (0.4, 0.3, 0.3)


def confidence(
    logits: torch.Tensor, weights: tuple[float, float, float] = DEFAULT_WEIGHTS
) -> torch.Tensor:
    """Confidence of each next-token distribution.

    Args:
        logits: `[..., vocab]` raw logits (any float dtype; computed in float32).
        weights: `(w_H, w_m, w_p)`, the CONF-KV weights.

    Returns:
        `[...]` float32 tensor in [0, 1].

    Raises:
        ValueError: the vocabulary has fewer than two entries.
    """
    vocab = logits.shape[-1]
    if vocab < 2:
        raise ValueError(f"confidence needs a vocabulary of at least 2 tokens, got {vocab}")
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1)  # [...]
    h_norm = (entropy / math.log(vocab)).clamp(0.0, 1.0)
    top2 = log_probs.topk(2, dim=-1).values  # [..., 2]
    margin = top2[..., 0] - top2[..., 1]
    p_top1 = top2[..., 0].exp()
    w_h, w_m, w_p = weights
    return w_h * (1.0 - h_norm) + w_m * torch.sigmoid(margin) + w_p * p_top1
