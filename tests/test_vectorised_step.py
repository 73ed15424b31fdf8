"""The shared policy eviction, vectorised over layers, rows and slots, keeps exactly the tokens a
plain per-layer, per-row step keeps (the loop the store ran before: protect, rank, take the
top `pinned + budget - slack`, ties to the older slot)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import append_tokens

from agent_kv.kv.policies import make_policy
from agent_kv.kv.policies.arkv import RelativeAttentionMoments
from agent_kv.kv.policies.conf_kv import AttentionEma
from agent_kv.kv.policies.h2o import AccumulatedMass
from agent_kv.kv.policies.snapkv import ObservationMass
from agent_kv.kv.store import Int8Config, KVStore

STATISTICS = (AttentionEma(), AccumulatedMass(), ObservationMass(), RelativeAttentionMoments())
"""Every statistic the policies compared here rank by."""


def random_store(int8: bool, seed: int) -> KVStore:
    """3 layers, 2 rows of different lengths, random statistics, some pins; with `int8`, a
    quantized segment in front of the FP one."""
    torch.manual_seed(seed)
    store = KVStore(3, 2, 4, batch=2, int8=Int8Config(fp_window=40, group=8) if int8 else None)
    append_tokens(store, torch.randn(2, 2, 300, 4), torch.randn(2, 2, 300, 4), rows=range(2))
    append_tokens(store, torch.randn(1, 2, 37, 4), torch.randn(1, 2, 37, 4), rows=range(1, 2))
    store.pins.pin(10, 30, row=0)
    store.pins.pin(200, 205, row=1)
    store.pins.pin(330, 400, row=1)  # part of it ahead of the tokens seen
    store.ensure_columns(STATISTICS)
    for table in (store.fp, store.q):
        for name in store.segments.columns:
            table[name].copy_(torch.rand_like(table[name]))
    store.precision.quantize_stale()
    store.observed_from = [250, 320]
    return store


def reference_ranks(policy, store: KVStore, layer: int, row: int, candidates) -> torch.Tensor:
    """`[length]`: each policy's rank of one layer's row, computed on its own."""
    positions = store.live_positions(layer, row)
    if policy.name == "h2o":
        return store.live_meta("accumulated", layer, row).mean(dim=0)
    if policy.name == "conf-kv":
        mass = store.live_meta("scores", layer, row).mean(dim=0)

        def pct(values):
            ranks = torch.zeros_like(values)
            sorted_values = torch.sort(values[candidates]).values
            below = torch.searchsorted(sorted_values, values[candidates])
            ranks[candidates] = below.float() / max(int(candidates.sum()) - 1, 1)
            return ranks

        w = policy.recency_weight
        return (1 - w) * pct(mass) + w * pct(positions.float())
    if policy.name == "snapkv":
        order = torch.argsort(positions)
        scored = order[: int((positions < store.observed_from[row]).sum())]
        ranks = torch.empty(positions.numel())
        mass = store.live_meta("observation_mass", layer, row)[:, scored]
        pooled = F.max_pool1d(mass[None], policy.kernel, stride=1, padding=policy.kernel // 2)
        ranks[scored] = pooled[0].mean(dim=0)
        top = float(ranks[scored].max()) + 1.0
        newer = order[scored.numel() :]
        ranks[newer] = top + torch.arange(newer.numel()).float()
        return ranks
    return positions.float()  # recency: the window


def reference_kept(policy, store: KVStore, confidences: list) -> list[list[set[int]]]:
    """Per layer and row, the positions a plain per-layer, per-row step keeps."""
    kept = []
    for layer in range(store.num_layers):
        per_row = []
        for row in range(store.batch):
            budget = policy.layer_budgets(confidences[row], store.num_layers)[layer]
            positions = store.live_positions(layer, row)
            pinned = store.pins.mask(layer, row)
            n, n_pinned = positions.numel(), int(pinned.sum())
            if n - n_pinned <= budget:
                per_row.append(set(positions.tolist()))
                continue
            protected = pinned | (positions < policy.sinks)
            unpinned = (~pinned).nonzero().squeeze(1)
            newest = torch.topk(positions[unpinned], min(policy.protect_recent, len(unpinned)))
            protected[unpinned[newest.indices]] = True
            ranks = reference_ranks(policy, store, layer, row, ~protected)
            ranks[protected] = float("inf")
            slack = min(policy.evict_slack, budget // 2)
            keep_count = max(n_pinned + budget - slack, int(protected.sum()))
            order = sorted(range(n), key=lambda i: (-float(ranks[i]), i))[:keep_count]
            per_row.append(set(positions[order].tolist()))
        kept.append(per_row)
    return kept


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(
    "name,params",
    [
        ("conf-kv", {"budget": 120, "protect_recent": 16}),
        ("h2o", {"budget": 100}),
        ("window", {"budget": 90}),
        ("snapkv", {"budget": 150, "observation_window": 8}),
    ],
)
def test_the_vectorised_step_keeps_the_per_row_step_s_tokens(name, params, int8):
    for seed in range(3):
        store = random_store(int8, seed)
        policy = make_policy(name, **params)
        confidences = [0.9, 0.1]  # row 0 confident (a tighter conf-kv budget), row 1 not
        expected = reference_kept(policy, store, confidences)
        stepped = copy.deepcopy(store)
        evicted = policy.evict(stepped, confidences)
        kept = [
            [set(stepped.live_positions(layer, row).tolist()) for row in range(store.batch)]
            for layer in range(store.num_layers)
        ]
        assert kept == expected, (name, seed)
        assert evicted == sum(
            store.length(layer, row) - len(expected[layer][row])
            for layer in range(store.num_layers)
            for row in range(store.batch)
        )
        assert evicted > 0  # the budgets are tight enough that every case evicts
        for layer in range(store.num_layers):  # what was kept kept its keys
            for row in range(store.batch):
                positions = store.live_positions(layer, row).tolist()
                before = {position: slot for slot, position in enumerate(positions)}
                after = stepped.live_positions(layer, row).tolist()
                slots = torch.tensor([before[p] for p in after])
                old_keys, _ = store.segments.read_slots(layer, row, slots)
                new_keys, _ = stepped.segments.read_slots(layer, row, torch.arange(len(after)))
                torch.testing.assert_close(new_keys, old_keys)


def test_a_step_with_nothing_over_budget_moves_nothing():
    store = random_store(False, 0)
    policy = make_policy("window", budget=400)
    before = copy.deepcopy(store)
    assert policy.evict(store, [0.5, 0.5]) == 0
    for layer in range(store.num_layers):
        for row in range(store.batch):
            assert torch.equal(store.live_positions(layer, row), before.live_positions(layer, row))
