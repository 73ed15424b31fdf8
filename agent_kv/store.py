"""The KV store: dense per-layer buffers, per-token scores, pins, compaction and exact accounting.

Layout (architecture.md, "Layout"): each layer holds keys and values in dense buffers
`[batch=1, kv_heads, capacity, head_dim]` whose first `length` slots are live, in the order
the tokens arrived. Eviction gathers the kept slots into the front of the same buffers
(contiguous compaction, CONF-KV §4), so attention always reads a dense prefix and never an
indirection table. Keys are stored after RoPE at their original positions.

Per slot the store also keeps the token's original position and its attention score per KV
head (an exponential moving average of the normalised attention mass the token received, see
`record_attention`). Pins are kept per position for the whole episode.

This version holds one precision (the model's dtype). The FP16/INT8 mixed-precision segment
is a second pair of buffers in front of this one; accounting already goes through
`LayerStore.nbytes`, so it will count both.
"""

from __future__ import annotations

import torch

CAPACITY_STEP = 256  # tokens; capacities are multiples of this, grown by doubling


def _round_up(n: int, step: int = CAPACITY_STEP) -> int:
    return max(step, -(-n // step) * step)


class LayerStore:
    """One layer's live tokens.

    Attributes:
        keys, values: `[1, kv_heads, capacity, head_dim]` buffers; slots `[:length]` are live.
        positions: `[capacity]` int64, original position of each live slot (increasing).
        scores: `[kv_heads, capacity]` float32, EMA of normalised attention mass per KV head.
        accumulated: `[kv_heads, capacity]` float32, attention mass summed over every query
            since the token arrived (H2O's accumulated score; favours old tokens by design).
        length: live tokens.
        appended: tokens ever appended to this layer (the next token's position).
    """

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.length = 0
        self.appended = 0
        self._allocate(CAPACITY_STEP)

    def _allocate(self, capacity: int) -> None:
        shape = (1, self.kv_heads, capacity, self.head_dim)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        positions = torch.empty(capacity, dtype=torch.long, device=self.device)
        scores = torch.zeros(self.kv_heads, capacity, dtype=torch.float32, device=self.device)
        accumulated = torch.zeros_like(scores)
        n = self.length
        if n and hasattr(self, "keys"):
            keys[:, :, :n] = self.keys[:, :, :n]
            values[:, :, :n] = self.values[:, :, :n]
            positions[:n] = self.positions[:n]
            scores[:, :n] = self.scores[:, :n]
            accumulated[:, :n] = self.accumulated[:, :n]
        self.keys, self.values, self.positions = keys, values, positions
        self.scores, self.accumulated = scores, accumulated

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append new tokens. `keys`, `values`: `[1, kv_heads, n, head_dim]`."""
        n = keys.shape[2]
        if self.length + n > self.capacity:
            self._allocate(_round_up(max(self.length + n, 2 * self.capacity)))
        end = self.length + n
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.positions[self.length : end] = torch.arange(
            self.appended, self.appended + n, device=self.device
        )
        self.scores[:, self.length : end] = 0.0
        self.accumulated[:, self.length : end] = 0.0
        self.length = end
        self.appended += n

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the live keys and values, `[1, kv_heads, length, head_dim]` each."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the slots `keep` (int64 `[k]`, increasing), gathered into the front.

        Buffers shrink when fewer than a quarter of their capacity stays live.
        """
        k = keep.numel()
        self.keys[:, :, :k] = self.keys[:, :, keep]
        self.values[:, :, :k] = self.values[:, :, keep]
        self.positions[:k] = self.positions[keep]
        self.scores[:, :k] = self.scores[:, keep]
        self.accumulated[:, :k] = self.accumulated[:, keep]
        self.length = k
        if self.capacity > CAPACITY_STEP and k < self.capacity // 4:
            self._allocate(_round_up(2 * k))

    def nbytes(self) -> int:
        """Bytes of the live keys and values (what a KV cache of `length` tokens holds)."""
        keys, values = self.live()
        return keys.nbytes + values.nbytes

    def allocated_nbytes(self) -> int:
        """Bytes of the key and value buffers including unused capacity."""
        return self.keys.nbytes + self.values.nbytes


class KVStore:
    """The KV cache of one sequence (batch 1) across all layers of a model.

    Args:
        num_layers: decoder layers.
        kv_heads: key/value heads per layer (GQA: fewer than query heads).
        head_dim: channels per head.
        dtype: storage dtype of keys and values.
        device: where the buffers live.
        ema_decay: weight of the old score in the attention-mass EMA, per forward call.

    Raises:
        ValueError: non-positive sizes or an `ema_decay` outside [0, 1).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ema_decay: float = 0.9,
    ):
        if min(num_layers, kv_heads, head_dim) <= 0:
            raise ValueError("num_layers, kv_heads and head_dim must be positive")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must lie in [0, 1), got {ema_decay}")
        device = torch.device(device)
        self.layers = [LayerStore(kv_heads, head_dim, dtype, device) for _ in range(num_layers)]
        self.ema_decay = ema_decay
        self._pinned = torch.zeros(0, dtype=torch.bool, device=device)
        self.peak_bytes = 0
        self.evicted_tokens = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, **kwargs) -> KVStore:
        """A store shaped for a transformers causal LM (reads `model.config`)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        param = next(model.parameters())
        kwargs.setdefault("dtype", param.dtype)
        kwargs.setdefault("device", param.device)
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, **kwargs)

    @property
    def seen_tokens(self) -> int:
        """Tokens appended so far (the position the next token takes)."""
        return self.layers[0].appended

    def bytes_per_token(self) -> int:
        """Key + value bytes one token costs across all layers at full precision."""
        layer = self.layers[0]
        return 2 * len(self.layers) * layer.kv_heads * layer.head_dim * layer.keys.element_size()

    def append(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens to one layer and return the layer's live keys and values.

        Args:
            keys, values: `[1, kv_heads, n, head_dim]`, keys already rotated (RoPE).

        Returns:
            Views `[1, kv_heads, length, head_dim]`; the last `n` slots are the new tokens.

        Raises:
            ValueError: batch size other than 1, or a head shape that does not match.
        """
        layer = self.layers[layer_idx]
        if keys.shape[0] != 1:
            raise ValueError(f"KVStore holds one sequence; got batch size {keys.shape[0]}")
        if keys.shape[1] != layer.kv_heads or keys.shape[3] != layer.head_dim:
            raise ValueError(
                f"expected keys [1, {layer.kv_heads}, n, {layer.head_dim}], got {list(keys.shape)}"
            )
        layer.append(keys, values)
        if layer_idx == len(self.layers) - 1:
            self._note_peak()
        return layer.live()

    def record_attention(
        self, layer_idx: int, mass: torch.Tensor, query_len: int, group: int
    ) -> None:
        """Fold one forward call's attention into the layer's scores.

        Args:
            mass: `[1, kv_heads, length]`, attention probability each live token received,
                summed over the `query_len` queries and the `group` query heads of its KV head.
            query_len: queries in this call (1 in decode, the chunk size in prefill).
            group: query heads per KV head.

        The step's mean attention per query `a_j = mass_j / (group * n_j)`, where `n_j` counts
        the queries that could see token j under the causal mask, removes the bias toward old
        tokens (architecture.md, "Score bias"). Tokens already scored update as
        `s <- d*s + (1-d)*a`; the `query_len` new tokens start at `a`. The raw mass is also
        added to `accumulated` (H2O's score).
        """
        layer = self.layers[layer_idx]
        n = layer.length
        visible = torch.full((n,), float(query_len), device=mass.device)
        first_new = n - query_len
        visible[first_new:] = torch.arange(
            query_len, 0, -1, device=mass.device, dtype=torch.float32
        )
        step = mass[0].float() / (visible * group)  # [kv_heads, length]
        scores = layer.scores[:, :n]
        scores[:, :first_new].mul_(self.ema_decay).add_(
            step[:, :first_new], alpha=1 - self.ema_decay
        )
        scores[:, first_new:] = step[:, first_new:]
        layer.accumulated[:, :n] += mass[0].float()

    def pin(self, start: int, end: int) -> None:
        """Pin positions `[start, end)`: exempt from eviction until `unpin`.

        Raises:
            ValueError: `start < 0` or `end < start`.
        """
        self._check_span(start, end)
        self._grow_pins(end)
        self._pinned[start:end] = True

    def unpin(self, start: int, end: int) -> None:
        """Release the pin on positions `[start, end)`.

        Raises:
            ValueError: `start < 0` or `end < start`.
        """
        self._check_span(start, end)
        self._grow_pins(end)
        self._pinned[start:end] = False

    @staticmethod
    def _check_span(start: int, end: int) -> None:
        if start < 0 or end < start:
            raise ValueError(f"invalid position span [{start}, {end})")

    def pinned_mask(self, layer_idx: int) -> torch.Tensor:
        """`[length]` bool: which live slots of the layer are pinned."""
        layer = self.layers[layer_idx]
        self._grow_pins(layer.appended)
        return self._pinned[layer.positions[: layer.length]]

    def _grow_pins(self, size: int) -> None:
        if size > self._pinned.numel():
            extra = torch.zeros(
                size - self._pinned.numel(), dtype=torch.bool, device=self._pinned.device
            )
            self._pinned = torch.cat([self._pinned, extra])

    def compact(self, layer_idx: int, keep: torch.Tensor) -> None:
        """Evict every live slot of the layer not in `keep` (int64 `[k]`, increasing)."""
        layer = self.layers[layer_idx]
        self.evicted_tokens += layer.length - keep.numel()
        layer.compact(keep)

    def lengths(self) -> list[int]:
        """Live tokens per layer."""
        return [layer.length for layer in self.layers]

    def nbytes(self) -> int:
        """Exact bytes of live keys and values over all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes of all key/value buffers including spare capacity."""
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def full_kv_nbytes(self) -> int:
        """Bytes a full KV cache would hold for the tokens seen so far, at the same dtype."""
        return self.seen_tokens * self.bytes_per_token()

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
