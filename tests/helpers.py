"""Shared helpers for tests that drive a KVStore directly, without a model, and for tests of
records written with the KV figures' old names."""

from __future__ import annotations

import torch

from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.forward_call import ForwardCall, append_kv
from agent_kv.kv.policies.arkv import RelativeAttentionMoments
from agent_kv.kv.policies.conf_kv import AttentionEma
from agent_kv.kv.policies.h2o import AccumulatedMass
from agent_kv.kv.policies.kvzip import ReconstructionMax
from agent_kv.kv.policies.snapkv import ObservationMass
from agent_kv.kv.store import KVStore
from agent_kv.renamed_fields import RENAMED

OLD_NAMES = {new: old for old, new in RENAMED.items()}
EVERY_STATISTIC = (
    AttentionEma(), AccumulatedMass(), RelativeAttentionMoments(), ObservationMass(),
    ReconstructionMax(),
)  # fmt: skip
"""The statistics of the bundled policies: the stores these helpers fill hold all their columns,
and a `recorded_call` folds them all unless its plan says otherwise."""
EVERY_STATISTIC_PLAN = CallPlan(statistics=EVERY_STATISTIC)


def with_old_names(record: dict) -> dict:
    """`record` with its KV figures under the names used before the rename
    (`agent_kv.renamed_fields`), as records written then have them."""
    return {OLD_NAMES.get(key, key): value for key, value in record.items()}


def append_tokens(
    store: KVStore, keys: torch.Tensor, values: torch.Tensor | None = None, rows: range = range(1)
) -> None:
    """Append `keys`/`values` `[len(rows), H, n, D]` to every layer, as one forward call; the
    store then holds the columns of `EVERY_STATISTIC` (0 for tokens appended so)."""
    append_kv(store, keys, -keys if values is None else values, rows)
    store.ensure_columns(EVERY_STATISTIC)


def random_tokens(store: KVStore, n: int, rows: range = range(1)) -> None:
    """Append `n` random tokens to every layer of `rows`."""
    shape = (len(rows), store.kv_heads, n, store.head_dim)
    append_tokens(store, torch.randn(shape), torch.randn(shape), rows)


def kept_positions(store: KVStore, layer_idx: int = 0, row: int = 0) -> list[int]:
    """Original positions of a layer's live tokens, in logical order."""
    return store.live_positions(layer_idx, row).tolist()


def split_mass(call: ForwardCall, layer: int, mass: torch.Tensor) -> list[torch.Tensor]:
    """`mass` `[R, H, length + n]`, for each row of the call its layer's live tokens in logical
    order and then the call's `n` new tokens, as `ForwardCall.record_*` takes it: one
    `[R, H, width]` per segment `call.segments(layer)` reads (zeros past a row's length), then
    `[R, H, n]` for the new tokens."""
    offsets = [0] * mass.shape[0]
    parts = []
    for segment in call.segments(layer):
        part = mass.new_zeros(*mass.shape[:2], segment.keys.shape[2])
        for i, length in enumerate(segment.lengths.tolist()):
            part[i, :, :length] = mass[i, :, offsets[i] : offsets[i] + length]
            offsets[i] += length
        parts.append(part)
    parts.append(torch.stack([mass[i, :, o : o + call.n] for i, o in enumerate(offsets)]))
    return parts


def recorded_call(
    store: KVStore,
    keys: torch.Tensor,
    values: torch.Tensor | None = None,
    rows: range = range(1),
    masses: torch.Tensor | None = None,
    window: torch.Tensor | None = None,
    observed: int = 0,
    plan: CallPlan = EVERY_STATISTIC_PLAN,
) -> None:
    """One forward call of `keys`/`values` `[len(rows), H, n, D]` in every layer, without a
    model: in each layer it reads the stored segments, stages the tokens and records `masses`
    as the attention mass (group of 1) and `window` as the attention of the last `observed`
    queries, each `[len(rows), H, length + n]` in logical order and then the new tokens
    (`split_mass`); then it commits. Masses that are None are not recorded. `plan`: what the
    call measures (`CallPlan`)."""
    call = ForwardCall.open(store, rows, keys.shape[2], plan)
    for layer in range(store.num_layers):
        call.segments(layer)  # before recording: the segments the layer read
        call.stage(layer, keys, -keys if values is None else values)
        if masses is not None:
            call.record_attention(layer, split_mass(call, layer, masses), group=1)
        if window is not None:
            call.record_observation_window(layer, split_mass(call, layer, window), observed)
    call.close()
