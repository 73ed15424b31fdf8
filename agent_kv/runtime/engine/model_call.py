"""The model-call ritual, written once: a call opened over the store (`ForwardCall.open`, or
several packed into one row: `PackedCall`), the model run with the call as its `kv_call`, the
call closed (its tokens and statistics written, the store moved on)."""

from __future__ import annotations

import torch

from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.packed_call import PackedCall


def run_call(
    model: torch.nn.Module,
    cache,
    call: ForwardCall | PackedCall,
    input_ids: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 1,
) -> torch.Tensor:
    """Run `model` over an open `call` and close it.

    Args:
        model: a causal LM loaded with the store's attention (`agent_kv.kv.attention`).
        cache: the transformers `Cache` adapter the model is given (`agent_kv.kv.cache`).
        call: the open call (its rotary positions are the model's `position_ids`).
        input_ids: `[R, n]` token ids (`[1, tokens]` for a packed call).
        logits_to_keep: transformers' `logits_to_keep`: the last `k` positions (0: all), or
            the positions to keep as an int64 tensor.

    Returns:
        The model's logits, `[R, kept, vocab]`, in the model's dtype.
    """
    out = model(
        input_ids=input_ids,
        position_ids=call.position_ids(),
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        kv_call=call,
    )
    call.close()
    return out.logits
