"""The quantized formats the store can hold its quantized tier in, by name.

Both share one layout (codes `[H, n, D]`, one float16 scale per KV head and channel per group
of tokens) and one dequantization, `code * scale` (`kernels.int8.dequantize`); they differ in
the code dtype and the rounding grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import fp8, int8


@dataclass(frozen=True)
class QuantFormat:
    """A quantized storage format.

    Attributes:
        name: `"int8"` or `"fp8"`.
        dtype: the code dtype (1 byte per value).
        quantize: `(x [H, n, D], group) -> (codes [H, n, D], scales [H, n // group, D])`.
    """

    name: str
    dtype: torch.dtype
    quantize: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


QUANT_FORMATS = {
    "int8": QuantFormat("int8", torch.int8, int8.quantize_groups),
    "fp8": QuantFormat("fp8", fp8.FP8_DTYPE, fp8.quantize_groups),
}


def format_name(dtype: torch.dtype) -> str:
    """The name of the format whose codes have `dtype`.

    Raises:
        KeyError: no format stores `dtype`.
    """
    for fmt in QUANT_FORMATS.values():
        if fmt.dtype == dtype:
            return fmt.name
    raise KeyError(f"no quantized format stores {dtype}")
