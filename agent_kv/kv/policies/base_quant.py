"""ARKV's "Base Quant" baseline: every token quantized, nothing evicted (uniform quantization).

At each eviction, per layer, every unpinned FP token is moved to the quantized tier (FP8 or INT8,
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
    order = 80
    summary = "every token quantized (`fp8` or `int8`), nothing evicted: uniform quantization"
    paper = "ARKV's baselines"
    manages_precision: ClassVar[bool] = True
    quantized: str = "fp8"
    group: int = 8

    def validate(self) -> None:
        super().validate()
        check_quantized(self.name, self.quantized, self.group)

    def slot_bounds(self, store: KVStore) -> tuple[int | None, int | None]:
        """At most `group - 1` unpinned tokens wait in FP for a whole group; the quantized
        segment grows with the context."""
        return self.group - 1, None

    def quantize(self, store: KVStore, rows: range) -> int:
        """Quantize every whole group of each layer's unpinned FP tokens; returns the tokens
        moved."""
        span = slice(rows.start, rows.stop)
        return store.precision.quantize_oldest(0, self.group, self.quantized, rows=span)
