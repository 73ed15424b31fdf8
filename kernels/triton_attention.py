"""The store's attention read for decode as fused Triton kernels, with the attention mass per
token: the GPU path of `kernels.torch_attention.segmented_attention`, with its arguments and return
contract (that function stays the CPU path and this module's test oracle).

Three launches per call (split-KV "flash-decoding": Dao, Haziza, Massa & Sizov, 2023,
"Flash-Decoding for long-context inference"), for the `R = q * Hq/Hkv` query rows that share
a KV head (GQA: query head h reads KV head h // (Hq/Hkv)):

1. `_split_kernel`, one program per (batch row, KV head, split of a segment's slots): reads
   the split's keys and values in blocks of `BLOCK_N` slots (quantized codes are dequantized
   in registers, `code * scale` with each slot's scale row gathered through `scale_index`)
   and folds them into an online softmax (Milakov & Gimelshein, 2018; FlashAttention, Dao et
   al. 2022, §3.1): running maximum `m`, normaliser `l` and output accumulator per query row,
   rescaled by `exp(m_old - m_new)` when the maximum grows. It writes its partial
   `(acc, m, l)` and the scaled scores `s_j` of its slots: float32, `8 R` bytes per slot and
   KV head written and read back, against the `D` (INT8) or `2 D` (bf16) bytes of a second
   read of the keys (32 against 128 or 256 bytes for Llama-3-8B at q=1).
2. `_combine_kernel`, one program per (batch row, KV head): merges the partials of every
   split of every segment, `m = max_s m_s`, `l = sum_s exp(m_s - m) l_s`,
   `out = sum_s exp(m_s - m) acc_s / l`, and writes the output and the final `(m, l)`.
3. `_mass_kernel`, one program per (batch row, KV head, block of slots) of each segment:
   `mass_j = sum_r exp(s_rj - m_r) / l_r` over the query rows that see slot j, 0 elsewhere.

Keys and values are read once; the mass costs the scores' write and read, no second pass.
Scores, softmax and sums are float32. The two matrix products run in IEEE float32 for float32
queries, and on TF32 tensor cores for half-precision models (bf16, fp16: TF32's 10 mantissa
bits are more than their inputs carry).

Refused (`unsupported` says why; `kernels.dispatch` then uses `kernels.torch_attention`): more than
`MAX_QUERIES` queries or `MAX_ROWS` query rows per KV head, segments with `cos`/`sin` (the
store's rerotate mode, which rotates keys at read), FP8 codes on CUDA devices older than
compute capability 8.9, and the model-family features the kernels do not implement: a
sliding-window mask (`Segment.window`; Mistral, Gemma-2/3, gpt-oss sliding layers), logit
soft-capping and attention sinks (`kernels.softmax_extras`; Gemma-2, gpt-oss).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE
from kernels.softmax_extras import NO_EXTRAS, SoftmaxExtras
from kernels.torch_attention import Segment, check_segments
from kernels.triton_device import require_launchable

BLOCK_N = 64
"""Slots per block inside a split (and the granularity of split sizes)."""
BLOCK_L = 256
"""Slots per program of the mass kernel."""
MAX_QUERIES = 16
"""Most new tokens per call the kernel takes (decode is 1)."""
MAX_ROWS = 128
"""Most query rows (new tokens x query heads per KV head) one program holds in registers."""
PROGRAMS_PER_SM = 4
"""Split programs per streaming multiprocessor the default split size aims for on CUDA."""
SPLIT_WARPS = 8
"""Warps per split program: with 8, ptxas fits a 64-slot INT8 block at D=128 in registers on
sm_90 (244 registers, no spill); with 4 it spills. Found by compiling ahead of time, not yet
timed on a GPU, like `BLOCK_N` and `PROGRAMS_PER_SM`."""


def unsupported(
    query: torch.Tensor, segments: list[Segment], extras: SoftmaxExtras = NO_EXTRAS
) -> str | None:
    """Why the Triton kernel does not take this call, or None when it does.

    Args:
        query: `[B, Hq, q, D]`.
        segments: as for `kernels.torch_attention.segmented_attention`.
        extras: the call's soft-capping and sinks (`kernels.softmax_extras`).
    """
    q_heads, q_len = query.shape[1], query.shape[2]
    kv_heads = segments[0].keys.shape[1]
    if q_len > MAX_QUERIES:
        return f"{q_len} queries per call (at most {MAX_QUERIES})"
    if q_heads % kv_heads == 0 and q_heads // kv_heads * q_len > MAX_ROWS:
        return f"{q_heads // kv_heads * q_len} query rows per KV head (at most {MAX_ROWS})"
    if any(segment.cos is not None for segment in segments):
        return "keys rotated at read (rerotate mode)"
    if any(segment.window is not None for segment in segments):
        return "a sliding-window mask"
    if extras.softcap is not None:
        return "logit soft-capping"
    if extras.sinks is not None:
        return "attention sinks"
    fp8 = any(segment.keys.dtype == FP8_DTYPE for segment in segments)
    if fp8 and query.is_cuda and torch.cuda.get_device_capability(query.device) < (8, 9):
        return "FP8 codes on a GPU older than compute capability 8.9"
    return None


def segmented_attention(
    query: torch.Tensor, segments: list[Segment], scaling: float, split: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Softmax attention over the segments with the mass per token, as
    `kernels.torch_attention.segmented_attention`: the last segment is causal and holds the new
    tokens (row b's query i sees its slots `j <= lengths[b] - q + i`), the others are visible
    up to each row's length.

    Args:
        query: `[B, Hq, q, D]` float32, float16 or bfloat16, `q <= MAX_QUERIES`.
        segments: read in order; each `[B, Hkv, L_s, D]`, floating point or int8 /
            float8_e4m3fn codes with `key_scales`, `value_scales` `[B, Hkv, S, D]` float16 and
            `scale_index` `[B, L_s]` int64; no `cos`/`sin`.
        scaling: softmax scale.
        split: slots per split program, a multiple of `BLOCK_N`; None: enough splits to give
            every SM `PROGRAMS_PER_SM` programs on CUDA, one split per row and head elsewhere.

    Returns:
        `(out [B, q, Hq, D] in the query's dtype, [mass [B, Hkv, L_s] float32 per segment])`;
        masked slots get zero mass.

    Raises:
        ValueError: head counts that do not divide, a last segment that is not causal or holds
            fewer live tokens than queries in some row, a call `unsupported` refuses, a split
            that is not a positive multiple of `BLOCK_N`, or tensors the kernels cannot run on
            (`kernels.triton_device.require_launchable`).
    """
    _check_call(query, segments, split)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    device = query.device
    rows = q_heads // kv_heads * q_len
    programs = batch * kv_heads
    shape = {
        "ROWS": rows,
        "BLOCK_M": max(16, triton.next_power_of_2(rows)),
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
    }
    # the lengths are device tensors already: no host copy, no synchronisation; the grid
    # follows the segments' widths (static), programs past a row's length mask everything
    lengths = torch.stack([s.lengths.to(torch.int32) for s in segments])  # [segments, B]
    widths = [s.keys.shape[2] for s in segments]
    splits = [split or _split_tokens(width, programs, device) for width in widths]
    counts = [triton.cdiv(width, size) for width, size in zip(widths, splits, strict=True)]
    total = sum(counts)
    partial_acc = torch.empty(programs, total, shape["BLOCK_M"], shape["BLOCK_D"], device=device)
    partial_max = torch.empty(programs, total, shape["BLOCK_M"], device=device)
    partials = (partial_acc, partial_max, torch.empty_like(partial_max))  # (acc, m, l)
    scores = [torch.empty(programs, rows, s.keys.shape[2], device=device) for s in segments]
    offset = 0
    for segment, seg_lengths, size, count, seg_scores in zip(
        segments, lengths, splits, counts, scores, strict=True
    ):
        if count:
            _launch_split(
                query, segment, seg_lengths, seg_scores, partials, scaling,
                kv_heads=kv_heads, size=size, count=count, offset=offset, total=total,
                shape=shape,
            )  # fmt: skip
        offset += count
    out = torch.empty(batch, q_len, q_heads, head_dim, dtype=query.dtype, device=device)
    final_max = torch.empty(programs, shape["BLOCK_M"], device=device)
    final_sum = torch.empty_like(final_max)
    _combine_kernel[(programs,)](
        *partials, out, final_max, final_sum,
        *out.stride(), kv_heads, q_len, head_dim, total, **shape,
    )  # fmt: skip
    return out, _masses(query, segments, lengths, scores, final_max, final_sum, shape)


def _check_call(query: torch.Tensor, segments: list[Segment], split: int | None) -> None:
    """Refuse what `segmented_attention` cannot run (its Raises)."""
    check_segments(query, segments)
    reason = unsupported(query, segments)
    if reason is not None:
        raise ValueError(f"the Triton decode kernel does not take {reason}")
    if split is not None and (split <= 0 or split % BLOCK_N):
        raise ValueError(f"split must be a positive multiple of {BLOCK_N}, got {split}")
    require_launchable(_split_kernel, query, *(s.keys for s in segments))


def _launch_split(
    query: torch.Tensor,
    segment: Segment,
    seg_lengths: torch.Tensor,
    seg_scores: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scaling: float,
    *,
    kv_heads: int,
    size: int,
    count: int,
    offset: int,
    total: int,
    shape: dict[str, int],
) -> None:
    """Launch `_split_kernel` over one segment: `count` splits of `size` slots for each
    (batch row, KV head), writing partials `(acc, m, l)` at splits `offset` to
    `offset + count` of `total`, and the segment's scores `seg_scores` `[B * Hkv, ROWS, L_s]`.
    `seg_lengths` is int32 `[B]`; `shape` the kernel's `ROWS`, `BLOCK_M` and `BLOCK_D`."""
    batch, _, q_len, head_dim = query.shape
    quantized = segment.scale_index is not None
    tables = (
        (segment.key_scales, segment.value_scales, segment.scale_index)
        if quantized
        else (segment.keys, segment.values, seg_lengths)  # unread placeholders
    )
    table_strides = (
        (*segment.key_scales.stride(), *segment.value_scales.stride()) if quantized else (0,) * 8
    )
    _split_kernel[(batch * kv_heads, count)](
        query, segment.keys, segment.values, *tables, seg_lengths, *partials, seg_scores,
        *query.stride(), *segment.keys.stride(), *segment.values.stride(),
        *table_strides, *(segment.scale_index.stride() if quantized else (0, 0)),
        kv_heads, q_len, head_dim, segment.keys.shape[2], size, offset, total, scaling,
        CAUSAL=segment.causal, QUANTIZED=quantized,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_N=BLOCK_N, **shape, num_warps=SPLIT_WARPS,
    )  # fmt: skip


def _masses(
    query: torch.Tensor,
    segments: list[Segment],
    lengths: torch.Tensor,
    scores: list[torch.Tensor],
    final_max: torch.Tensor,
    final_sum: torch.Tensor,
    shape: dict[str, int],
) -> list[torch.Tensor]:
    """Launch `_mass_kernel` over each segment for `query` `[B, Hq, q, D]`: its mass
    `[B, Hkv, L_s]` float32 from its scores and the final `(m, l)` `[B * Hkv, BLOCK_M]` per
    query row; `lengths` is int32 `[segments, B]`."""
    batch, q_len = query.shape[0], query.shape[2]
    kv_heads = segments[0].keys.shape[1]
    masses = []
    for segment, seg_lengths, seg_scores in zip(segments, lengths, scores, strict=True):
        width = segment.keys.shape[2]
        mass = torch.empty(batch, kv_heads, width, device=query.device)
        if width:
            _mass_kernel[(batch * kv_heads, triton.cdiv(width, BLOCK_L))](
                seg_scores, final_max, final_sum, seg_lengths, mass, *mass.stride(),
                kv_heads, q_len, width, CAUSAL=segment.causal, BLOCK_L=BLOCK_L,
                ROWS=shape["ROWS"], BLOCK_M=shape["BLOCK_M"],
            )  # fmt: skip
        masses.append(mass)
    return masses


def _split_tokens(live: int, programs: int, device: torch.device) -> int:
    """Slots per split program for a segment `live` slots wide, read by
    `programs` (batch rows x KV heads): on CUDA enough splits for `PROGRAMS_PER_SM` programs
    per SM, elsewhere (the interpreter) one split per row and head."""
    splits = 1
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = max(
            1, min(triton.cdiv(live, BLOCK_N), triton.cdiv(PROGRAMS_PER_SM * sms, programs))
        )
    return max(1, triton.cdiv(triton.cdiv(live, splits), BLOCK_N)) * BLOCK_N


@triton.jit
def _visible_limit(len_ptr, b, token, q_len, CAUSAL: tl.constexpr):
    """Per query row (token index `token` among the q new ones), the first slot of the row's
    segment it may not see: `length - q + 1 + token` in the causal segment, `length` else."""
    length = tl.load(len_ptr + b)
    if CAUSAL:
        return length - q_len + 1 + token
    return length + token * 0


@triton.jit
def _load_tile(base, slots, stride_slot, dims, stride_dim, mask):
    """The float32 tile `[len(slots), len(dims)]` at `base + slot * stride_slot +
    dim * stride_dim`, 0 where `mask` is False."""
    return tl.load(
        base + slots[:, None] * stride_slot + dims[None, :] * stride_dim, mask=mask, other=0.0
    ).to(tl.float32)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, idx_ptr, len_ptr,
    acc_ptr, max_ptr, sum_ptr, score_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ksb, stride_ksh, stride_kss, stride_ksd,
    stride_vsb, stride_vsh, stride_vss, stride_vsd,
    stride_ib, stride_il,
    kv_heads, q_len, head_dim, width, split, split_offset, total_splits, scaling,
    CAUSAL: tl.constexpr, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Online softmax of one (batch row, KV head)'s query rows over one split of a segment;
    writes the partial `(acc [BLOCK_M, BLOCK_D], m, l [BLOCK_M])` and the scaled scores."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    b = (pid // kv_heads).to(tl.int64)
    kvh = pid % kv_heads
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < ROWS
    dim_ok = dims < head_dim
    token = rows % q_len
    head = (kvh * (ROWS // q_len) + rows // q_len).to(tl.int64)
    q_rows = q_ptr + b * stride_qb + head * stride_qh + token * stride_qt
    query = tl.load(
        q_rows[:, None] + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    query = query * scaling
    limit = _visible_limit(len_ptr, b, token, q_len, CAUSAL)
    start = part * split
    stop = tl.minimum(start + split, tl.load(len_ptr + b))
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    ks_base = ks_ptr + b * stride_ksb + kvh * stride_ksh
    vs_base = vs_ptr + b * stride_vsb + kvh * stride_vsh
    score_base = score_ptr + pid.to(tl.int64) * ROWS * width
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < stop
        tile = col_ok[:, None] & dim_ok[None, :]
        keys = _load_tile(k_base, cols, stride_kl, dims, stride_kd, tile)
        values = _load_tile(v_base, cols, stride_vl, dims, stride_vd, tile)
        if QUANTIZED:
            scale_row = tl.load(idx_ptr + b * stride_ib + cols * stride_il, mask=col_ok, other=0)
            scale_row = scale_row.to(tl.int32)  # 32-bit offsets into the small scale table
            keys *= _load_tile(ks_base, scale_row, stride_kss, dims, stride_ksd, tile)
            values *= _load_tile(vs_base, scale_row, stride_vss, dims, stride_vsd, tile)
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        tl.store(
            score_base + rows[:, None] * width + cols[None, :],
            scores,
            mask=row_ok[:, None] & col_ok[None, :],
        )
        visible = (cols[None, :] < limit[:, None]) & col_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that see nothing yet
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(run_max - shift)
        run_sum = run_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs, values, input_precision=PRECISION)
        run_max = new_max
    slot = pid.to(tl.int64) * total_splits + split_offset + part
    tl.store(max_ptr + slot * BLOCK_M + rows, run_max)
    tl.store(sum_ptr + slot * BLOCK_M + rows, run_sum)
    tl.store(acc_ptr + slot * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + dims[None, :], acc)


@triton.jit
def _combine_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr, final_max_ptr, final_sum_ptr,
    stride_ob, stride_ot, stride_oh, stride_od,
    kv_heads, q_len, head_dim, total_splits,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge one (batch row, KV head)'s split partials into the output rows and the final
    `(m, l)` per query row."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    base = pid.to(tl.int64) * total_splits
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for part in range(total_splits):
        run_max = tl.maximum(run_max, tl.load(max_ptr + (base + part) * BLOCK_M + rows))
    shift = tl.where(run_max == float("-inf"), 0.0, run_max)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for part in range(total_splits):
        slot = base + part
        weight = tl.exp(tl.load(max_ptr + slot * BLOCK_M + rows) - shift)
        run_sum += weight * tl.load(sum_ptr + slot * BLOCK_M + rows)
        partial = tl.load(acc_ptr + slot * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + dims)
        acc += weight[:, None] * partial
    out = acc / run_sum[:, None]
    b = (pid // kv_heads).to(tl.int64)
    token = rows % q_len
    head = (pid % kv_heads * (ROWS // q_len) + rows // q_len).to(tl.int64)
    out_rows = out_ptr + b * stride_ob + token * stride_ot + head * stride_oh
    tl.store(
        out_rows[:, None] + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=(rows < ROWS)[:, None] & (dims < head_dim)[None, :],
    )
    tl.store(final_max_ptr + pid * BLOCK_M + rows, run_max)
    tl.store(final_sum_ptr + pid * BLOCK_M + rows, run_sum)


@triton.jit
def _mass_kernel(
    score_ptr, final_max_ptr, final_sum_ptr, len_ptr, mass_ptr,
    stride_mb, stride_mh, stride_ml,
    kv_heads, q_len, width,
    CAUSAL: tl.constexpr, BLOCK_L: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Attention mass of a block of one segment's slots for one (batch row, KV head): the
    probability each slot received, summed over the query rows that see it."""
    pid = tl.program_id(0)
    b = pid // kv_heads
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    limit = _visible_limit(len_ptr, b, rows % q_len, q_len, CAUSAL)
    visible = (rows < ROWS)[:, None] & (cols[None, :] < limit[:, None])
    scores = tl.load(
        score_ptr + pid.to(tl.int64) * ROWS * width + rows[:, None] * width + cols[None, :],
        mask=visible,
        other=float("-inf"),
    )
    row_max = tl.load(final_max_ptr + pid * BLOCK_M + rows)
    row_sum = tl.load(final_sum_ptr + pid * BLOCK_M + rows)
    probs = tl.where(visible, tl.exp(scores - row_max[:, None]) / row_sum[:, None], 0.0)
    mass_at = mass_ptr + b.to(tl.int64) * stride_mb + (pid % kv_heads) * stride_mh
    tl.store(mass_at + cols * stride_ml, tl.sum(probs, axis=0), mask=cols < width)
