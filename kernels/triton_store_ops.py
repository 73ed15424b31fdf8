"""The store's quantize-on-append as a Triton kernel.

`quantize_groups` is `kernels.int8.quantize_groups` / `kernels.fp8.quantize_groups` in one
launch (one program per KV head, group of tokens and block of channels); its codes and scales
are bit-identical to theirs. (Compaction is one gather per field over every layer and row at
once, `agent_kv.kv.slot_table.SlotTable.gather`, a single torch kernel on either device.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, FP8_MAX
from kernels.int8 import MIN_SCALE, QMAX, SCALE_DTYPE
from kernels.triton_device import require_launchable

BLOCK_D = 64
"""Channels per program of `quantize_groups`."""


def quantize_groups(
    x: torch.Tensor, group: int, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` `[H, n, D]` in runs of `group` tokens, per KV head and channel
    (`kernels.int8` describes the layout): `scale = max(amax / qmax, MIN_SCALE)` stored in
    float16, codes `x / scale` clamped to `[-qmax, qmax]` and rounded to nearest, ties to even
    (INT8: qmax 127, integers; FP8: qmax 448, the e4m3 grid).

    Args:
        x: `[H, n, D]` floating point (float32, float16, bfloat16), on CUDA (or on the CPU
            under `TRITON_INTERPRET=1`).
        group: tokens per run, `n % group == 0`.
        dtype: `torch.int8` or `torch.float8_e4m3fn`.

    Returns:
        `(codes [H, n, D] dtype, scales [H, n // group, D] float16)`, equal to
        `kernels.int8.quantize_groups` (int8) or `kernels.fp8.quantize_groups` (fp8).

    Raises:
        ValueError: `n` not a multiple of `group`, another code dtype, or a device the kernel
            cannot run on.
    """
    heads, n, dim = x.shape
    if group < 1 or n % group:
        raise ValueError(f"{n} tokens do not split into groups of {group}")
    if dtype not in (torch.int8, FP8_DTYPE):
        raise ValueError(f"codes are int8 or float8_e4m3fn, not {dtype}")
    require_launchable(_quantize_kernel, x)
    codes = torch.empty(heads, n, dim, dtype=dtype, device=x.device)
    scales = torch.empty(heads, n // group, dim, dtype=SCALE_DTYPE, device=x.device)
    if codes.numel():
        fp8 = dtype == FP8_DTYPE
        _quantize_kernel[(heads, n // group, triton.cdiv(dim, BLOCK_D))](
            x, codes, scales, *x.stride(), *codes.stride(), *scales.stride(), group, dim,
            QMAX=FP8_MAX if fp8 else float(QMAX), MIN_SCALE=MIN_SCALE, FP8=fp8,
            BLOCK_T=triton.next_power_of_2(group), BLOCK_D=BLOCK_D,
        )  # fmt: skip
    return codes, scales


@triton.jit
def _round_half_even(x):
    """`x` float32 rounded to the nearest integer, ties to even (as `torch.round`); exact for
    `|x| < 2**23` (`x - floor(x)` is exact there)."""
    low = tl.floor(x)
    frac = x - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)


@triton.jit
def _round_e4m3(x):
    """`x` float32, `|x| <= 448`, rounded to the nearest float8_e4m3fn value (ties to even),
    still as float32: the step is `2**(e - 3)` in the binade `[2**e, 2**(e+1))` (3 mantissa
    bits) and `2**-9` below `2**-6` (subnormals). Rounding here leaves the conversion to e4m3
    exact, which Triton 3.9's interpreter gets wrong at binade edges and subnormals. The sign
    is kept apart, so small negatives round to -0 as in torch."""
    bits = x.to(tl.int32, bitcast=True)
    step = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    up = ((127 - step) << 23).to(tl.float32, bitcast=True)  # 2**-step, exact
    down = ((127 + step) << 23).to(tl.float32, bitcast=True)  # 2**step
    magnitude = _round_half_even(tl.abs(x) * up) * down
    return tl.where(bits < 0, -magnitude, magnitude)


@triton.jit
def _quantize_kernel(
    x_ptr, code_ptr, scale_ptr,
    stride_xh, stride_xn, stride_xd,
    stride_ch, stride_cn, stride_cd,
    stride_sh, stride_sg, stride_sd,
    group, dim,
    QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Quantize one run of `group` tokens of one head, for a block of channels."""
    head = tl.program_id(0).to(tl.int64)
    run = tl.program_id(1)
    steps = tl.arange(0, BLOCK_T)
    tokens = (run * group + steps).to(tl.int64)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = (steps < group)[:, None] & (dims < dim)[None, :]
    x = tl.load(
        x_ptr + head * stride_xh + tokens[:, None] * stride_xn + dims[None, :] * stride_xd,
        mask=tile,
        other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE).to(tl.float16)
    scaled = tl.math.div_rn(x, scale.to(tl.float32)[None, :])
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    if FP8:
        codes = _round_e4m3(scaled).to(tl.float8e4nv)
    else:
        codes = _round_half_even(scaled).to(tl.int8)
    tl.store(
        code_ptr + head * stride_ch + tokens[:, None] * stride_cn + dims[None, :] * stride_cd,
        codes,
        mask=tile,
    )
    tl.store(
        scale_ptr + head * stride_sh + run * stride_sg + dims * stride_sd,
        scale,
        mask=dims < dim,
    )
