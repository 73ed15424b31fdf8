"""INT8 storage of keys and values: symmetric per-channel quantization over token groups.

Layout (CONF-KV §4, "mixed precision", as this project reads it): a run of `group` tokens
that leaves the FP window together is quantized together. For each KV head and each channel
the run shares one scale, `scale = max_t |x[t, c]| / 127` over the run's tokens, stored in
float16; values are `round(x / scale)` clamped to [-127, 127]. Per-channel scales follow
KIVI (Liu et al., 2024, §3): a few key channels carry outliers an order of magnitude larger
than the rest, and a per-token scale would spend the whole int8 range on them. Each stored
token remembers the index of its group's scale, so eviction moves tokens without touching
(or re-quantizing) the others of its group.
"""

from __future__ import annotations

import torch

QMAX = 127
MIN_SCALE = 2.0**-14
"""Smallest scale stored (float16's smallest normal number); all-zero channels use it."""
SCALE_DTYPE = torch.float16


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` `[H, n, D]` in runs of `group` tokens.

    Returns:
        `(q [H, n, D] int8, scales [H, n // group, D] float16)`; token t of `x` uses
        `scales[:, t // group]`.

    Raises:
        ValueError: `n` is not a multiple of `group`.
    """
    scaled, scales = scale_groups(x, group, QMAX)
    return torch.round(scaled).to(torch.int8), scales


def scale_groups(x: torch.Tensor, group: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split `x` `[H, n, D]` into runs of `group` tokens and scale each run's channels into
    `[-qmax, qmax]`, sharing one scale per head and channel per run.

    Returns:
        `(x / scale [H, n, D] float32, clamped to +-qmax; scales [H, n // group, D] float16)`.

    Raises:
        ValueError: `n` is not a multiple of `group`.
    """
    heads, n, dim = x.shape
    if n % group:
        raise ValueError(f"{n} tokens do not split into groups of {group}")
    runs = x.float().reshape(heads, n // group, group, dim)
    scales = (runs.abs().amax(dim=2) / qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    scaled = (runs / scales.float()[:, :, None]).clamp_(-qmax, qmax)
    return scaled.reshape(heads, n, dim), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of `q` `[..., L, D]` int8 given each token's scales `[..., L, D]`."""
    return q.float() * scales.float()
