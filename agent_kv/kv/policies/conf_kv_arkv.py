"""CONF-KV budgets with ARKV's tri-state cache inside them (`conf-kv+arkv`).

The two methods act on different axes (docs/methods.md, "ARKV and CONF-KV combined"): CONF-KV
decides how much each eviction may keep from the model's confidence; ARKV decides, within a
budget, which tokens stay Original, which are quantized and which go. Here the confidence gate
picks the eviction's budget (`n_high` when confident, `n_low` otherwise, in FP tokens of bytes per
layer) and ARKV's per-layer plan, heavy-hitter score and tri-state assignment spend it
(`agent_kv.kv.policies.arkv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.kv.policies.arkv import TriState
from agent_kv.kv.policies.conf_kv import ConfidenceGate


@dataclass
class ConfKVArkv(TriState, ConfidenceGate):
    """The confidence gate's budget, spent by ARKV's tri-state assignment.

    Parameters: the gate's `n_high` (default 512), `n_low` (default 1024), `tau` (default
    0.6) and ARKV's `protect_recent`, `gamma`, `oq_ratio`, `oq_spread`, `share_spread`,
    `quantized`, `group` (`agent_kv.kv.policies.arkv.TriState`). `--budget N` sets
    `n_low = N`, `n_high = N // 2`.
    """

    name = "conf-kv+arkv"
    order = 100
    summary = "CONF-KV's confidence-gated budget, spent by ARKV's tri-state assignment"
