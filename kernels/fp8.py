"""FP8 (`float8_e4m3fn`) storage of keys and values: scaled per channel over token groups.

The layout is `kernels.int8`'s, with FP8 codes instead of integers: a run of `group` tokens
quantized together shares, per KV head and channel, one float16 scale
`scale = max_t |x[t, c]| / 448` (448 is e4m3's largest finite value), and each value is stored
as `x / scale` rounded to the nearest e4m3 number. E4m3 keeps 3 mantissa bits at every
magnitude, so small values inside a run with one large outlier lose less than under INT8's
uniform grid; dequantization is the same product, `code * scale` (`kernels.int8.dequantize`).
ARKV keeps its quantized tier in FP8 (docs/methods.md, ARKV, "Tri-state cache").
"""

from __future__ import annotations

import torch

from kernels.int8 import scale_groups

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` `[H, n, D]` to FP8 in runs of `group` tokens.

    Returns:
        `(q [H, n, D] float8_e4m3fn, scales [H, n // group, D] float16)`; token t of `x` uses
        `scales[:, t // group]`.

    Raises:
        ValueError: `n` is not a multiple of `group`.
    """
    scaled, scales = scale_groups(x, group, FP8_MAX)
    return scaled.to(FP8_DTYPE), scales
