"""Attention over a store's live keys in PyTorch, returning the attention mass per cached token:
the CPU path of every read, and the oracle of the Triton kernels.

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
Evicted tokens are simply absent, never masked. A sliding-window layer adds a per-query mask
(`Segment.window`), and some families shape the softmax (soft-capping, sinks:
`kernels.softmax_extras`); every function here that reads segments takes both.

`attention_with_mass` is that contract over one dense FP tensor: the oracle. The store reads
through `segmented_attention`, the same contract over several segments (the INT8 segment,
then the FP segment that ends with the new tokens), rows of different lengths, and block-wise
dequantization inside an online softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kernels.int8 import dequantize
from kernels.softmax_extras import NO_EXTRAS, SoftmaxExtras

READ_BLOCK = 1024
"""Tokens read (and, for INT8, dequantized) at a time by `segmented_attention`."""


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


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[B, H, L, D]` with `cos`, `sin` `[B, L, D]` (Llama's
    rotate-half convention, Su et al., RoFormer §3.4.2)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated_half * sin[:, None]


def _visibility(segment: Segment, q_len: int, group: int) -> torch.Tensor:
    """`[B, 1, G*q, width]` bool: may each query row see each slot of the segment (slots at or
    past a row's length never; in a causal segment query i of a row of length n sees slots
    `j <= n - q + i`; with a `window`, only the slots it marks). Built from the length tensor
    and the window alone: no host synchronisation."""
    width = segment.keys.shape[2]
    device = segment.keys.device
    if segment.bias is not None:
        visible = (segment.bias == 0).expand(-1, -1, group * q_len, -1)
    else:
        lengths = segment.lengths[:, None, None]  # [B, 1, 1]
        if segment.causal:
            query_index = torch.arange(q_len, device=device).repeat(group)  # [G*q]
            limit = lengths - q_len + 1 + query_index[None, :, None]  # [B, G*q, 1]
        else:
            limit = lengths.expand(-1, group * q_len, 1)
        visible = (torch.arange(width, device=device) < limit)[:, None]
    if segment.window is not None:
        visible = visible & _grouped(segment.window, group)
    return visible


def _grouped(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A per-query mask `[B, 1, q, L]` in the grouped row order `[B, 1, G*q, L]` (row
    `g * q + i` is query i); a mask with one row `[B, 1, 1, L]` as it is (it broadcasts)."""
    return mask if mask.shape[2] == 1 else mask.repeat(1, 1, group, 1)


@dataclass
class Segment:
    """A run of stored tokens that attention reads, for a batch of rows.

    Attributes:
        keys, values: `[B, Hkv, L, D]`, floating point, or int8 with scales; `L` is the
            segment's width, what a read covers.
        lengths: int64 `[B]`, live slots per row (a list is taken too); slots at or past a
            row's length are masked.
        causal: the segment ends with the new tokens (their queries see only their past).
        key_scales, value_scales: `[B, Hkv, S, D]` float16 INT8 scales, or None.
        scale_index: `[B, L]` int64, the scale row of each slot, or None.
        cos, sin: `[B, L, D]` rotation applied to the keys after dequantization (the store's
            rerotate mode), or None.
        bias: `[B, 1, 1, L]` float32, 0 for the slots below each row's length and -inf past
            it, when the caller has it already (a non-causal segment: added to the logits,
            it saves building the mask from `lengths`).
        window: `[B, 1, 1 or q, L]` bool, the slots each query may see within its sliding
            window (a sliding-window layer: `agent_kv.kv.forward_call`), on top of the lengths
            and causality; one row when every query sees the same slots; None: no window.
    """

    keys: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    causal: bool = False
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    scale_index: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    window: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lengths, torch.Tensor):
            self.lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.keys.device)

    def last_queries(self, count: int) -> Segment:
        """The segment as the call's last `count` queries alone read it (its window's last
        `count` rows; lengths and causality count from each row's end already)."""
        if self.window is None or self.window.shape[2] == 1:
            return self
        return replace(self, window=self.window[:, :, -count:])

    def needs_conversion(self) -> bool:
        """Whether reading costs a copy (dequantization, upcast or rotation)."""
        return (
            self.scale_index is not None or self.cos is not None or self.keys.dtype != torch.float32
        )

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 keys and values of slots `[start, end)`, `[B, Hkv, end - start, D]` each."""
        keys, values = self.keys, self.values
        if start or end != keys.shape[2]:
            keys, values = keys[:, :, start:end], values[:, :, start:end]
        if self.scale_index is None:
            keys, values = _as_float(keys), _as_float(values)
        else:
            index = self.scale_index[:, start:end]  # [B, span]
            keys = dequantize(keys, _per_slot(self.key_scales, index))
            values = dequantize(values, _per_slot(self.value_scales, index))
        if self.cos is not None:
            keys = apply_rotation(keys, self.cos[:, start:end], self.sin[:, start:end])
        return keys, values


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 (itself when it is already: no operation)."""
    return x if x.dtype == torch.float32 else x.float()


def _per_slot(scales: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 scales `[B, H, span, D]` of each slot, from the table `[B, H, S, D]` and the
    slots' scale rows `index` `[B, span]` (indexing the small table, converted first)."""
    table = scales.float()
    if table.shape[0] == 1:
        return table[:, :, index[0]]
    rows = torch.arange(table.shape[0], device=table.device)[:, None]
    return table[rows, :, index].permute(0, 2, 1, 3)


def check_segments(query: torch.Tensor, segments: list[Segment]) -> int:
    """Check the segment contract of `segmented_attention` for `query` `[B, Hq, q, D]`;
    return the query heads per KV head.

    Raises:
        ValueError: head counts that do not divide, or a last segment that is not causal or
            narrower than the queries (checked on shapes alone: no host synchronisation).
    """
    q_heads, q_len = query.shape[1], query.shape[2]
    kv_heads = segments[0].keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} KV heads")
    last = segments[-1]
    if not last.causal or last.keys.shape[2] < q_len:
        raise ValueError("the last segment must be causal and hold every row's new tokens")
    return q_heads // kv_heads


def segmented_attention(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    block: int = READ_BLOCK,
    extras: SoftmaxExtras = NO_EXTRAS,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Softmax attention over several segments of stored tokens, with the mass per token.

    Blocks of `block` tokens are read in turn (INT8 dequantized on the way) and folded into an
    online softmax (Milakov & Gimelshein, 2018; FlashAttention, Dao et al. 2022, §3.1): a
    running maximum `m`, normaliser `l` and output accumulator per query row, rescaled by
    `exp(m_old - m_new)` whenever the maximum grows. No full-length float copy of the cache is
    made. Each block's unnormalised probabilities are kept with the maximum they were taken
    against, so the mass is `exp(m_block - m) / l * p` summed over queries once `m` and `l`
    are final. The last segment must be `causal` and hold the new tokens: row b's query i sees its
    slots `j <= lengths[b] - q + i`; other segments are fully visible up to each row's length;
    a segment's `window` narrows both. With sinks (`extras`), the online softmax starts from
    each row's sink logit (`m = sink`, `l = 1`, no value), so it stays in the denominator.

    Args:
        query: `[B, Hq, q, D]`.
        segments: read in order; each `[B, Hkv, L_s, D]` with `Hq % Hkv == 0`.
        scaling: softmax scale.
        block: tokens per read block.
        extras: soft-capping and sinks (`kernels.softmax_extras`).

    Returns:
        `(out [B, q, Hq, D] in the query's dtype, [mass [B, Hkv, L_s] float32 per segment])`;
        masked slots get zero mass; with sinks, the masses of a query sum to less than one.

    Raises:
        ValueError: head counts that do not divide, or a last segment that is not causal or
            holds fewer live tokens than there are queries in some row.
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    group = check_segments(query, segments)
    grouped = query.reshape(batch, kv_heads, group * q_len, head_dim).float()  # [B, Hkv, G*q, D]
    grouped = grouped * scaling
    softmax = _OnlineSoftmax.seeded(extras.sink_logits(kv_heads, q_len), grouped)
    for segment in segments:
        visible = _visibility(segment, q_len, group)  # [B, 1, G*q, width]
        width = segment.keys.shape[2]
        # float32 keys read as they are cost no copy: one block for the whole segment
        step = block if segment.needs_conversion() else max(width, 1)
        for start in range(0, width, step):
            end = min(start + step, width)
            keys, values = segment.read(start, end)
            logits = extras.cap(torch.matmul(grouped, keys.transpose(-1, -2)))  # [B, Hkv, G*q, n]
            softmax.fold(logits.masked_fill(~visible[..., start:end], float("-inf")), values)
    out = (softmax.acc / softmax.normaliser).to(query.dtype)  # [B, Hkv, G*q, D]
    out = out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2)  # [B, q, Hq, D]
    return out, softmax.masses([segment.keys.shape[2] for segment in segments])


@dataclass
class _OnlineSoftmax:
    """`segmented_attention`'s online softmax over one call's grouped query rows.

    Attributes:
        running_max: `[B, Hkv, G*q, 1]`, the largest logit folded so far (`m`), or None before
            the first block (without sinks).
        normaliser: `[B, Hkv, G*q, 1]`, the sum of `exp(logit - m)` so far (`l`), or None.
        acc: `[B, Hkv, G*q, D]`, the unnormalised output, or None.
        blocks: each block's unnormalised probabilities `[B, Hkv, G*q, n]` with the maximum
            `[B, Hkv, G*q, 1]` they were taken against.
    """

    running_max: torch.Tensor | None = None
    normaliser: torch.Tensor | None = None
    acc: torch.Tensor | None = None
    blocks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def seeded(cls, sink: torch.Tensor | None, grouped: torch.Tensor) -> _OnlineSoftmax:
        """The state before any block for the scaled grouped queries `grouped`
        `[B, Hkv, G*q, D]`: empty, or with sinks (`sink` `[1, Hkv, G*q, 1]`) a first "slot"
        of logit `sink` and no value (`m = sink`, `l = 1`, `acc = 0`)."""
        if sink is None:
            return cls()
        running_max = sink.expand(grouped.shape[0], -1, -1, -1)
        return cls(running_max, torch.ones_like(running_max), grouped.new_zeros(grouped.shape))

    def fold(self, logits: torch.Tensor, values: torch.Tensor) -> None:
        """Fold in a block of masked logits `[B, Hkv, G*q, n]` (-inf where not visible) and
        its float32 values `[B, Hkv, n, D]`, rescaling the state by `exp(m_old - m_new)`."""
        block_max = logits.amax(dim=-1, keepdim=True)
        if self.running_max is None:
            # a row that sees nothing yet has max -inf; shifting by -1e30 keeps exp at 0
            self.running_max = block_max.clamp_min(-1e30)
            probs = torch.exp(logits - self.running_max)
            self.normaliser = probs.sum(dim=-1, keepdim=True)
            self.acc = torch.matmul(probs, values)
        else:
            new_max = torch.maximum(self.running_max, block_max)
            rescale = torch.exp(self.running_max - new_max)
            probs = torch.exp(logits - new_max)
            self.normaliser = self.normaliser * rescale + probs.sum(dim=-1, keepdim=True)
            self.acc = self.acc * rescale + torch.matmul(probs, values)
            self.running_max = new_max
        self.blocks.append((probs, self.running_max))

    def masses(self, widths: list[int]) -> list[torch.Tensor]:
        """float32 mass per slot, `[B, Hkv, width]` per segment of `widths`, from the final
        `m` and `l`: `mass_j = sum over query rows of exp(shift - m) / l * probs_j`, one
        `[1, G*q] x [G*q, n]` product per block, no second exp over the logits."""
        mass = torch.cat(
            [
                torch.matmul(
                    (torch.exp(shift - self.running_max) / self.normaliser).transpose(-1, -2),
                    probs,
                )
                for probs, shift in self.blocks
            ],
            dim=-1,
        ).squeeze(-2)  # [B, Hkv, sum of widths]
        return list(mass.split(widths, dim=-1))


def single_pass_attention(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    extras: SoftmaxExtras = NO_EXTRAS,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`segmented_attention`'s contract in one softmax over every segment's logits at once, for
    calls of a few queries (decode steps): their logits are small, and one pass takes a fraction
    of the operations of the block-wise online softmax. Each segment is read whole (quantized
    codes dequantized: a transient float copy of that segment). A one-slot segment (a decode
    step's own token) is read with an elementwise product instead of a matrix product.

    Args, returns and raises: as `segmented_attention` (no `block`).
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    group = check_segments(query, segments)
    grouped = _as_float(query.reshape(batch, kv_heads, group * q_len, head_dim)) * scaling
    logits, values, widths = [], [], []
    for segment in segments:
        width = segment.keys.shape[2]
        keys, vals = segment.read(0, width)
        if width == 1:
            logit = (grouped * keys).sum(dim=-1, keepdim=True)  # [B, Hkv, G*q, 1]
        else:
            logit = torch.matmul(grouped, keys.transpose(-1, -2))  # [B, Hkv, G*q, width]
        logit = extras.cap(logit)
        if segment.bias is not None:
            logit = logit + segment.bias
            if segment.window is not None:
                logit = logit.masked_fill(~_grouped(segment.window, group), float("-inf"))
        elif width > 1 or q_len > 1 or segment.window is not None:
            logit = logit.masked_fill(~_visibility(segment, q_len, group), float("-inf"))
        logits.append(logit)
        values.append(vals)
        widths.append(width)
    probs = extras.probabilities(torch.cat(logits, dim=-1), q_len)
    parts = probs.split(widths, dim=-1)
    out = None
    for part, vals in zip(parts, values, strict=True):
        term = part * vals if vals.shape[2] == 1 else torch.matmul(part, vals)
        out = term if out is None else out + term
    if out.dtype != query.dtype:
        out = out.to(query.dtype)
    out = out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2)
    return out, [part.sum(dim=-2) for part in parts]


def read_whole(
    segments: list[Segment], q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every segment read whole (dequantized, rotated) and joined, for a call with `q_len` new
    tokens: float32 keys and values `[B, Hkv, L, D]` (a transient copy of the live cache of
    one layer) and visibility `[B, 1, q_len, L]` bool (causality and row lengths as in
    `segmented_attention`)."""
    keys, values, masks = [], [], []
    for segment in segments:
        segment_keys, segment_values = segment.read(0, segment.keys.shape[2])
        keys.append(segment_keys)
        values.append(segment_values)
        masks.append(_visibility(segment, q_len, 1))
    return torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(masks, dim=-1)


def fused_attention(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    extras: SoftmaxExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Softmax attention over the segments through torch's fused `scaled_dot_product_attention`,
    without the attention mass: for prefill chunks, where the block loop's explicit softmax
    costs ~4x more on CPU (the mass then comes from a window of queries, see
    `agent_kv.kv.attention`). Each segment is read whole (INT8 dequantized, rotated): a transient
    float copy of the live cache for one layer. Causality, row lengths and windows as in
    `segmented_attention`. The fused kernel has no soft-capping or sinks: a call with `extras`
    runs an explicit softmax instead, `SAMPLE_BLOCK` queries at a time.

    Args:
        query: `[B, Hq, q, D]`.
        segments: as for `segmented_attention`.
        scaling: softmax scale.
        whole: `read_whole(segments, q, ...)` when the caller has it already.
        extras: soft-capping and sinks (`kernels.softmax_extras`).

    Returns:
        `out [B, q, Hq, D]` in the query's dtype.
    """
    keys, values, visible = whole or read_whole(segments, query.shape[2], query.device)
    if not extras.active:
        out = F.scaled_dot_product_attention(
            query.float(), keys, values, attn_mask=visible, scale=scaling, enable_gqa=True
        )
        return out.to(query.dtype).transpose(1, 2)
    batch, q_heads, q_len, head_dim = query.shape
    outs = []
    for start in range(0, q_len, SAMPLE_BLOCK):
        chosen = torch.arange(start, min(start + SAMPLE_BLOCK, q_len), device=query.device)
        probs = _probabilities(query, chosen, keys, visible, scaling, extras)  # [B, Hkv, G*s, L]
        out = torch.matmul(probs, values)  # [B, Hkv, G*s, D]
        outs.append(out.reshape(batch, q_heads, len(chosen), head_dim))
    return torch.cat(outs, dim=2).to(query.dtype).transpose(1, 2)


SAMPLE_BLOCK = 128
"""Queries scored at a time by `sampled_mass` and by `fused_attention`'s explicit softmax
(bounds their `[B, Hq, block, L]` float logits)."""


def _probabilities(
    query: torch.Tensor,
    chosen: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    extras: SoftmaxExtras,
) -> torch.Tensor:
    """float32 `[B, Hkv, G*s, L]`: the attention probabilities of the queries `chosen` (int64
    `[s]`) of `query` `[B, Hq, q, D]` over whole keys `[B, Hkv, L, D]` with visibility
    `[B, 1, q, L]` (`read_whole`), soft-capped and with sinks as `extras` says; row `g*s + i`
    is query `chosen[i]` of the g-th query head of a KV head."""
    batch, q_heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    sample = query[:, :, chosen].float() * scaling  # [B, Hq, s, D]
    grouped = sample.reshape(batch, kv_heads, group * len(chosen), head_dim)
    logits = extras.cap(torch.matmul(grouped, keys.transpose(-1, -2)))  # [B, Hkv, G*s, L]
    seen = visible[:, :, chosen].repeat(1, 1, group, 1)
    return extras.probabilities(logits.masked_fill(~seen, float("-inf")), len(chosen))


def sampled_mass(
    query: torch.Tensor,
    offsets: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    reduce: str = "sum",
    extras: SoftmaxExtras = NO_EXTRAS,
) -> list[torch.Tensor]:
    """The attention mass per stored token from a sample of a call's queries: the mass of
    `segmented_attention`, summed over the queries at `offsets` only, each under its own
    causal limit (query i of the call sees slots `j <= lengths[b] - q + i`, within its window);
    with `reduce="max"`, the largest probability any of those queries and query heads gave the
    token instead (KVzip's importance, Kim et al. 2025, §3.2).

    Args:
        query: `[B, Hq, q, D]`, the call's queries.
        offsets: int64 `[S]`, ascending indices in `[0, q)` of the queries to score.
        segments: as for `segmented_attention`.
        scaling: softmax scale.
        whole: `read_whole(segments, q, ...)` when the caller has it already.
        reduce: `"sum"` or `"max"` over the queries and the query heads of a KV head.
        extras: soft-capping and sinks (`kernels.softmax_extras`).

    Returns:
        `[mass [B, Hkv, L_s] float32 per segment]`; masked slots get zero mass.
    """
    keys, _, visible = whole or read_whole(segments, query.shape[2], query.device)
    mass = keys.new_zeros(*keys.shape[:3])
    for start in range(0, len(offsets), SAMPLE_BLOCK):
        chosen = offsets[start : start + SAMPLE_BLOCK]
        probs = _probabilities(query, chosen, keys, visible, scaling, extras)
        if reduce == "max":
            mass = torch.maximum(mass, probs.amax(dim=-2))
        else:
            mass += probs.sum(dim=-2)
    widths = [segment.keys.shape[2] for segment in segments]
    return list(mass.split(widths, dim=-1))


def attention_profile(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    extras: SoftmaxExtras = NO_EXTRAS,
) -> torch.Tensor:
    """The shape of each query's attention distribution, the inputs of ARKV's per-layer
    Original:Quantized ratio (docs/methods.md, ARKV, "Per-layer OQ ratio").

    For query row i with `n_i` visible keys and weights `p` (a softmax over them):
    - normalised entropy `-sum p log p / log n_i`, in [0, 1] (1: uniform);
    - log concentration `log(n_i * sum p^2)`, i.e. `log(1 + n_i^2 Var(p))`, 0 when uniform,
      `log n_i` when one key takes everything: the variance of the weights, made independent
      of `n_i`;
    - log kurtosis `log(m4 / m2^2)` of the weights around their mean `1/n_i` (central moments
      over the visible keys): high when a few keys stand out from a flat rest.
    Rows that see fewer than two keys are left out. Segments are read whole, as in
    `fused_attention`. The logits are soft-capped as `extras` says; sinks are left out, so `p`
    is the distribution over the real tokens (the statistics need weights that sum to one).

    Args:
        query: `[B, Hq, q, D]`, the last `q` new tokens of the call.
        segments: as for `segmented_attention`.
        scaling: softmax scale.
        whole: `read_whole(segments, n, ...)` for the call's `n >= q` new tokens, when the
            caller has it already (the rows of the last `q` are used).
        extras: soft-capping (and sinks, unused here) of the call.

    Returns:
        `[B, Hkv, 3]` float32: the three statistics, each a mean over the `q` queries and the
        query heads of each KV head.
    """
    batch, q_heads, q_len, head_dim = query.shape
    keys, _, visible = whole or read_whole(segments, q_len, query.device)
    visible = visible[..., -q_len:, :]
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * q_len, head_dim).float() * scaling
    visible = visible.repeat(1, 1, group, 1)  # [B, 1, G*q, L], rows (head, query) as `grouped`
    logits = extras.cap(torch.matmul(grouped, keys.transpose(-1, -2)))
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [B, Hkv, G*q, L]
    n = visible.sum(dim=-1).float()  # [B, 1, G*q]
    counted = n >= 2
    n = n.clamp_min(2.0)
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1) / n.log()
    concentration = (n * probs.square().sum(dim=-1)).log()
    deviation = torch.where(visible, probs - 1.0 / n[..., None], 0.0)
    m2 = deviation.square().sum(dim=-1) / n
    m4 = deviation.pow(4).sum(dim=-1) / n
    flat = m2 <= 1e-20  # all weights equal: kurtosis is undefined, take its floor, 1
    kurtosis = torch.where(flat, 1.0, m4 / m2.square().clamp_min(1e-30)).log()
    stats = torch.stack([entropy, concentration, kurtosis], dim=-1)  # [B, Hkv, G*q, 3]
    weight = counted.float()[..., None]  # [B, 1, G*q, 1]
    return (stats * weight).sum(dim=2) / weight.sum(dim=2).clamp_min(1.0)
