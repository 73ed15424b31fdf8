"""CONF-KV-L: CONF-KV with pyramid per-layer budgets (docs/methods.md, CONF-KV-L).

Deeper layers concentrate their attention on fewer tokens, so they get smaller budgets
(PyramidKV, Cai et al. 2024). The schedule here is linear in depth: layer l of L gets

    b_l = b * (1 + pyramid * (1 - 2 l / (L - 1)))

of this eviction's CONF-KV budget b (N_high or N_low), rounded so the layers sum to exactly L * b:
the same total as `conf-kv` at the same settings, moved from deep layers to shallow ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.errors import ConfigError
from agent_kv.kv.policies.conf_kv import ConfKV


@dataclass
class ConfKVL(ConfKV):
    """CONF-KV with a linear pyramid of per-layer budgets.

    Parameters (besides CONF-KV's):
        pyramid (float, default 0.5): in [0, 1); the first layer gets (1 + pyramid) times the
            mean budget, the last (1 - pyramid) times it.
    """

    name = "conf-kv-l"
    order = 60
    summary = (
        "CONF-KV with a linear pyramid of per-layer budgets, the same total with deep layers "
        "smaller: the first layer `1 + pyramid` times the mean, the last `1 - pyramid` times it"
    )
    paper = "CONF-KV-L, after PyramidKV"
    pyramid: float = 0.5

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.pyramid < 1.0:
            raise ConfigError(f"conf-kv-l: pyramid must lie in [0, 1), got {self.pyramid}")
        smallest = int(self.n_high * (1.0 - self.pyramid))
        if smallest <= self.protect_recent:
            raise ConfigError(
                f"conf-kv-l: the deepest layer's confident budget ({smallest} tokens) cannot "
                f"hold protect_recent={self.protect_recent}; raise n_high or lower pyramid"
            )

    def layer_budgets(self, confidence: float | None, num_layers: int) -> list[int]:
        """The pyramid around `budget(confidence)`; sums to `num_layers * budget`."""
        mean = self.budget(confidence)
        if num_layers == 1:
            return [mean]
        raw = [
            mean * (1.0 + self.pyramid * (1.0 - 2.0 * layer / (num_layers - 1)))
            for layer in range(num_layers)
        ]
        budgets = [int(value) for value in raw]
        shortfall = mean * num_layers - sum(budgets)
        by_remainder = sorted(range(num_layers), key=lambda i: raw[i] - budgets[i], reverse=True)
        for layer in by_remainder[:shortfall]:
            budgets[layer] += 1
        return budgets
