"""ARKV's "Base Quant" baseline: every token quantized, nothing evicted (uniform quantization).

Each step, per layer, every unpinned FP token is moved to the quantized tier (FP8 or INT8,
per-channel scales over groups of `group` tokens, `kernels.formats`) as soon as a whole group
has arrived, so at most `group - 1` tokens wait in FP. Pinned tokens stay in the model's dtype,
as under every policy. The memory saving is fixed by the format and the group (a 4-byte
float32 value becomes a byte and its share of a float16 scale, 1.25 bytes at groups of 8:
3.2x; from bfloat16 1.6x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agent_kv.kv.policies.base import check_quantized
from agent_kv.kv.policies.full import FullKV
from agent_kv.kv.store import KVStore


@dataclass
class BaseQuant(FullKV):
    """Uniform quantization of every token, no eviction (full KV, quantized).

    Parameters:
        quantized (str, default "fp8"): the format, "fp8" or "int8".
        group (int, default 8): tokens quantized together (one scale per KV head and
            channel); ARKV's default, so both quantize alike.
    """

    name = "base-quant"
    manages_precision: ClassVar[bool] = True
    quantized: str = "fp8"
    group: int = 8

    def validate(self) -> None:
        super().validate()
        check_quantized(self.name, self.quantized, self.group)

    def quantize(self, store: KVStore, idx: int, row: int) -> int:
        """Quantize every whole group of the layer's unpinned FP tokens; returns the tokens
        moved."""
        layer = store.layers[idx]
        if layer.fp_len[row] < self.group:
            return 0
        q_len = layer.q_len[row]
        fp_unpinned = (~store.pinned_mask(idx, row)[q_len:]).nonzero().squeeze(1)
        whole = fp_unpinned[: fp_unpinned.numel() // self.group * self.group]
        return store.quantize_slots(idx, row, q_len + whole, self.group, self.quantized)
