"""Route a transformers model's attention through the KV store.

`register_attention()` registers, under the name `"agent_kv"`:
- an attention function (transformers `AttentionInterface`) that reads the layer's stored
  segments through the call given as the `kv_call` keyword of the model call
  (`ForwardCall.open`: shared prefix views, quantized segment, FP segment, then the call's
  own new tokens, which it stages for the call's commit) — decode steps and chunks of up to
  `SCORED_QUERIES` tokens through `kernels.dispatch.decode_attention` (Triton kernels on
  CUDA, `kernels.torch_attention.segmented_attention` elsewhere), longer prefill chunks through
  torch's fused attention with the mass from a strided sample of the chunk's queries
  (`scored_offsets`) — and hands the attention mass back to the store (and in prefill
  calls, when the call's plan asks, the shape of the attention:
  `kernels.torch_attention.attention_profile`, and the mass from the last `observation_window`
  queries: `ForwardCall.record_observation_window`);
- before reading, when the call's plan recalls and a recall is due (never in a static call),
  the best cold pages of the layer back into the hot store (`ForwardCall.recall`,
  `agent_kv.kv.policies.cold_recall`); in a vote pass, only the cold pages' scores and the
  layer's votes (`ForwardCall.vote`) and the output, nothing recorded or kept;
- a mask function (`AttentionMaskInterface`) that builds no mask: causality is positional
  inside the store (see `kernels.torch_attention`), so no `[q, L]` mask is materialised.

Model-family keywords of transformers' attention interface:
- `sliding_window` (Mistral, Phi-3, Qwen2/3, Gemma-2/3, gpt-oss): the layer's window, which must
  be the store's (`KVStore.attention_windows`, from the config:
  `agent_kv.kv.attention_windows`); the call's segments carry each query's window mask
  (`ForwardCall.segments`) and the store keeps the window only
  (`KVStore.trim_attention_windows`);
- `softcap` (Gemma-2) and `s_aux` (gpt-oss's per-head sinks): applied in every read path
  (`kernels.softmax_extras`); the Triton decode kernel implements neither, nor windows, so
  such calls take the PyTorch path (`kernels.dispatch`).

Load a model with `attn_implementation="agent_kv"` (done by
`agent_kv.runtime.models.model_loading`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.packed_call import PackedCall
from kernels.dispatch import decode_attention
from kernels.softmax_extras import SoftmaxExtras
from kernels.torch_attention import (
    Segment,
    attention_profile,
    fused_attention,
    read_whole,
    sampled_mass,
    segmented_attention,
)

NAME = "agent_kv"
SCORED_QUERIES = 64
"""A forward call of at most this many queries (a decode step, a short chunk) measures the
attention mass over all of them, in the block-wise read that computes its output."""
SCORE_STRIDE = 4
"""A longer prefill chunk, whose output comes from torch's fused kernel (`fused_attention`),
measures the mass over every `SCORE_STRIDE`-th query counted back from its last one
(`scored_offsets`), so that every part of the chunk is scored and the kept set does not
depend on where chunk boundaries fall (`benchmarks/chunk_scoring.py` measures the cost)."""
PROFILED_QUERIES = 64
"""ARKV's attention profile of a prefill call is taken over its last `PROFILED_QUERIES`
queries."""


def scored_offsets(query_len: int, device: torch.device) -> torch.Tensor:
    """int64 `[S]`, ascending: the queries of a call of `query_len` whose attention mass is
    measured — all of them up to `SCORED_QUERIES`, otherwise every `SCORE_STRIDE`-th counted
    back from the last (`query_len - 1`, `query_len - 1 - SCORE_STRIDE`, ...). Counted from
    the end, a chunk size that is a multiple of the stride samples the same absolute
    positions however a prompt is chunked."""
    stride = 1 if query_len <= SCORED_QUERIES else SCORE_STRIDE
    return torch.arange(query_len - 1, -1, -stride, device=device).flip(0)


def store_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_call: ForwardCall | PackedCall | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the store.

    Args:
        module: the attention module; `module.layer_idx` names the layer.
        query: `[R, Hq, q, D]`; key, value: `[R, Hkv, q, D]`, the call's new tokens (the
            cache adapter hands them through: `agent_kv.kv.cache`).
        attention_mask: must be None (the store's causality and row lengths apply); a 4D mask
            is refused, since the store never holds padding.
        scaling: softmax scale, default `D ** -0.5`.
        kv_call: the call (`agent_kv.kv.forward_call.ForwardCall`, from `ForwardCall.open`):
            read, given the new tokens and the attention mass; or a `PackedCall` of several
            sequences packed into one row (`R = 1`), each span of `q` run through its own
            call.
        sliding_window: the layer's window in tokens (a query at `p` sees keys at
            `p - window < k <= p`), or None for full attention.
        softcap: Gemma-2's attention logit soft-cap, or None.
        s_aux: gpt-oss's sink logits `[Hq]`, or None.

    Returns:
        `(out [R, q, Hq, D], None)`, in `query`'s dtype; the attention itself runs in the
        store's dtype (float32 under bfloat16 weights: `KV_DTYPE_ATTRIBUTE`).

    Raises:
        ValueError: no `kv_call`, an explicit attention mask, dropout, or a `sliding_window`
            other than the store's for this layer (a config the store was not made from).
    """
    if kv_call is None:
        raise ValueError("agent_kv attention reads the store: call the model with kv_call=")
    if attention_mask is not None:
        raise ValueError("agent_kv attention takes no attention mask: the store holds no padding")
    if dropout:
        raise ValueError("agent_kv attention is inference-only (dropout must be 0)")
    features = {"sliding_window": sliding_window, "softcap": softcap, "s_aux": s_aux}
    if isinstance(kv_call, PackedCall):
        return _packed_attention(module, query, key, value, scaling, kv_call, features), None
    call = kv_call
    store = call.store
    if query.dtype != store.dtype:  # bfloat16 weights over a float32 cache: compute in its dtype
        return _widened_attention(module, query, key, value, scaling, call, features), None
    layer = module.layer_idx
    if sliding_window != store.attention_windows[layer]:
        raise _window_mismatch(layer, sliding_window, store.attention_windows[layer])
    extras = SoftmaxExtras(softcap, s_aux)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if call.plan.maxima_pass:
        return _maxima_attention(call, layer, query, key, value, scale, extras), None
    if call.plan.vote:
        call.vote(layer, query, scale)
        segments = [*call.segments(layer), call.new_segment(key, value, layer)]
        whole = read_whole(segments, query.shape[2], query.device)
        return fused_attention(query, segments, scale, whole, extras), None
    return _recorded_attention(call, layer, query, key, value, scale, extras), None


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    packed: PackedCall,
    features: dict,
) -> torch.Tensor:
    """`store_attention` of a `PackedCall`: each sequence's span of the packed row
    (`query` `[1, Hq, q, D]`, `key`, `value` `[1, Hkv, q, D]`) through its own call, the
    outputs `[1, q_s, Hq, D]` joined along the tokens into `[1, q, Hq, D]`."""
    outs = [
        store_attention(
            module, *(t[:, :, start:end] for t in (query, key, value)), None, scaling,
            kv_call=call, **features,
        )[0]
        for call, (start, end) in zip(packed.calls, packed.spans, strict=True)
    ]  # fmt: skip
    return torch.cat(outs, dim=1)


def _widened_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    call: ForwardCall,
    features: dict,
) -> torch.Tensor:
    """`store_attention` of a call whose tensors are narrower than the store's dtype
    (bfloat16 weights over a float32 cache): query, key, value and the sinks (`s_aux`)
    widened to the store's dtype, the output `[R, q, Hq, D]` cast back to `query`'s."""
    dtype = call.store.dtype
    widened = [t.to(dtype) for t in (query, key, value)]
    if features["s_aux"] is not None:
        features["s_aux"] = features["s_aux"].to(dtype)
    out, _ = store_attention(module, *widened, None, scaling, kv_call=call, **features)
    return out.to(query.dtype)


def _window_mismatch(layer: int, window: int | None, stored: int | None) -> ValueError:
    """The error for a layer that attends through `window` tokens over a store made for
    `stored`."""
    return ValueError(
        f"layer {layer} attends through a sliding window of {window} tokens, but its "
        f"store was made for {stored}: make the store with "
        "KVStore.for_model(model) (windows from the config: agent_kv.kv.attention_windows)"
    )


def _recorded_attention(
    call: ForwardCall,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    extras: SoftmaxExtras,
) -> torch.Tensor:
    """An ordinary call's attention (neither a maxima nor a vote pass): recall cold pages when
    one is due, stage the new tokens, read the store and return the output `[R, q, Hq, D]`,
    handing the store the attention mass (every query's up to `SCORED_QUERIES`, a strided
    sample's beyond: `scored_offsets`) and, for a prefill call, what its plan asks
    (`_record_prefill_statistics`)."""
    call.recall(layer, query, scale)
    call.stage(layer, key, value)
    segments = [*call.segments(layer), call.new_segment(key, value, layer)]
    query_len = query.shape[2]
    whole = None  # the segments read whole, shared by the fused read, the mass and the profile
    offsets = None  # every query scored (the store's default)
    if query_len > SCORED_QUERIES:
        offsets = scored_offsets(query_len, query.device)
        whole = read_whole(segments, query_len, query.device)
        out = fused_attention(query, segments, scale, whole, extras)
        masses = sampled_mass(query, offsets, segments, scale, whole, extras=extras)
    else:
        out, masses = decode_attention(query, segments, scale, extras)
    call.record_attention(layer, masses, query.shape[1] // key.shape[1], offsets)
    if query_len > 1:
        _record_prefill_statistics(call, layer, query, segments, masses, scale, whole, extras)
    return out


def _record_prefill_statistics(
    call: ForwardCall,
    layer: int,
    query: torch.Tensor,
    segments: list[Segment],
    masses: list[torch.Tensor],
    scale: float,
    whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    extras: SoftmaxExtras,
) -> None:
    """What a prefill call's plan asks for beyond the mass: the mass from the last
    `observation_window` queries (`ForwardCall.record_observation_window`; `masses`, the
    call's mass per segment, when it covers exactly those queries) and the attention profile
    of the last `PROFILED_QUERIES` (`attention_profile`, `KVStore.record_profile`). `whole` is
    the segments read whole, or None when the call did not read them so."""
    query_len = query.shape[2]
    if call.plan.observation_window:
        observed = min(query_len, call.plan.observation_window)
        if observed != query_len or query_len > SCORED_QUERIES:
            last = [segment.last_queries(observed) for segment in segments]
            _, masses = segmented_attention(query[:, :, -observed:], last, scale, extras=extras)
        call.record_observation_window(layer, masses, observed)
    if call.plan.profile:
        window = query[:, :, -PROFILED_QUERIES:]
        stats = attention_profile(window, segments, scale, whole, extras)
        call.store.record_profile(layer, stats)


def _maxima_attention(
    call: ForwardCall,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    extras: SoftmaxExtras,
) -> torch.Tensor:
    """A maxima pass's attention (`CallPlan.maxima_pass`): the output, and for the store
    every stored token's largest attention probability over all the call's queries and query
    heads (`ForwardCall.record_maxima`); no other measurement, no recall, and the call's own
    tokens are not kept."""
    segments = [*call.segments(layer), call.new_segment(key, value, layer)]
    query_len = query.shape[2]
    whole = read_whole(segments, query_len, query.device)
    out = fused_attention(query, segments, scale, whole, extras)
    offsets = torch.arange(query_len, device=query.device)
    maxes = sampled_mass(query, offsets, segments, scale, whole, reduce="max", extras=extras)
    call.record_maxima(layer, maxes)
    return out


def no_mask(*args, **kwargs) -> None:
    """Mask function for the store: the attention function applies causality itself."""
    return None


def register_attention() -> None:
    """Register `store_attention` and `no_mask` under the name `"agent_kv"` (idempotent)."""
    AttentionInterface.register(NAME, store_attention)
    AttentionMaskInterface.register(NAME, no_mask)
