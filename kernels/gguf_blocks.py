"""GGUF quantized tensors read as the numbers they hold: the 4-bit block types as integer
groups with their scale and offset (exactly), every type as float32.

A GGUF tensor of shape `[N, K]` (N output rows, K inputs) is stored row by row, each row a run
of blocks along K. The 4-bit types hold, per group of 32 weights along a row, 4-bit codes
`q` in 0..15 and a weight `w = q * scale + offset` (llama.cpp's `ggml-common.h`, the
`block_q4_0`, `block_q4_1` and `block_q4_K` layouts):

- `Q4_0` (18 bytes per 32): fp16 `d`; `w = d * (q - 8)`.
- `Q4_1` (20 bytes per 32): fp16 `d`, fp16 `m`; `w = d * q + m`.
- `Q4_K` (144 bytes per 256): fp16 `d` and `dmin` for the super-block, then eight 6-bit
  scales `sc` and mins `m` packed in 12 bytes, then 128 bytes of codes (each 32 bytes give two
  groups: low nibbles the first, high nibbles the second); `w = d * sc * q - dmin * m`.

Every other type (Q5_0, Q5_1, Q8_0, the K types other than Q4_K, F16, BF16, F32) is read as
float32 through the `gguf` package's own de-quantization (`gguf.quants.dequantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
"""Weights per group of the 4-bit types."""

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF types `int4_groups` reads exactly."""

CHUNK_ROWS = 4096
"""Rows de-quantized at a time by `dequantize`."""

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


@dataclass
class Int4Groups:
    """A weight matrix as 4-bit codes in groups of `GROUP` along its rows.

    Attributes:
        codes: uint8 `[N, K]`, each in 0..15.
        scale: float32 `[N, K / GROUP]`.
        offset: float32 `[N, K / GROUP]`; weight `[n, k]` is
            `codes[n, k] * scale[n, k // GROUP] + offset[n, k // GROUP]`.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 `[N, K]`."""
        n, k = self.codes.shape
        grouped = self.codes.view(n, k // GROUP, GROUP).float()
        return (grouped * self.scale[..., None] + self.offset[..., None]).view(n, k)

    def rows(self, order: torch.Tensor) -> Int4Groups:
        """The same groups with rows taken in `order` (int64 `[N]`)."""
        return Int4Groups(self.codes[order], self.scale[order], self.offset[order])


def _fp16(raw: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block in `raw` (`[blocks, block bytes]`), as float32
    `[blocks]`."""
    pair = np.ascontiguousarray(raw[:, start : start + 2]).view(np.float16)
    return torch.from_numpy(pair).float().view(-1)


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """`qs` `[blocks, 16]` uint8 as codes `[blocks, 32]`: the low nibbles are the group's first
    16 codes and the high nibbles its last 16 (Q4_0/Q4_1)."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 15, q >> 4], dim=-1)


def _k_scales(scales: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's eight 6-bit scales and mins from its 12 packed bytes (`[blocks, 12]` uint8;
    llama.cpp's `get_scale_min_k4`), each int64 `[blocks, 8]`."""
    s = torch.from_numpy(np.ascontiguousarray(scales)).long()
    low_sc, low_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], dim=1), torch.cat([low_m, high_m], dim=1)


def int4_groups(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Groups:
    """Read a 4-bit GGUF tensor exactly.

    Args:
        raw: the tensor's bytes (uint8, `[N, bytes per row]` or flat).
        kind: its GGUF type name, one of `INT4_TYPES`.
        shape: `(N, K)`, rows and inputs.

    Returns:
        Its `Int4Groups`; `dequantize()` equals `gguf.quants.dequantize` of the same bytes.

    Raises:
        ValueError: another type, or bytes that do not match the shape.
    """
    if kind not in INT4_TYPES:
        raise ValueError(f"{kind} is not a 4-bit block type ({', '.join(INT4_TYPES)})")
    n, k = shape
    blocks = n * k // _BLOCK_WEIGHTS[kind]
    if k % _BLOCK_WEIGHTS[kind] or raw.size != blocks * _BLOCK_BYTES[kind]:
        raise ValueError(f"{raw.size} bytes of {kind} do not hold a [{n}, {k}] tensor")
    raw = raw.reshape(blocks, _BLOCK_BYTES[kind])
    if kind == "Q4_K":
        d, dmin = _fp16(raw, 0), _fp16(raw, 2)
        sc, m = _k_scales(raw[:, 4:16])
        q = torch.from_numpy(np.ascontiguousarray(raw[:, 16:])).view(blocks, 4, 32)
        codes = torch.stack([q & 15, q >> 4], dim=2).view(blocks, 8, 32)
        scale, offset = d[:, None] * sc, -dmin[:, None] * m
    else:
        d = _fp16(raw, 0)
        codes = _nibbles(raw[:, 2:] if kind == "Q4_0" else raw[:, 4:])
        scale = d[:, None]
        offset = -8 * scale if kind == "Q4_0" else _fp16(raw, 2)[:, None]
    groups = k // GROUP
    return Int4Groups(
        codes.reshape(n, k).contiguous(),
        scale.float().reshape(n, groups).contiguous(),
        offset.float().reshape(n, groups).contiguous(),
    )


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Any GGUF tensor as float32 of `shape` (`gguf.quants.dequantize`), read `CHUNK_ROWS`
    rows at a time so the package's intermediate arrays stay small.

    Raises:
        ValueError: a type the `gguf` package cannot de-quantize (its message names it).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    out = torch.empty(shape, dtype=torch.float32)
    rows = out.view(-1, shape[-1])
    raw = raw.reshape(rows.shape[0], -1)
    try:
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            part = gguf_dequantize(raw[start : start + CHUNK_ROWS], GGMLQuantizationType[kind])
            rows[start : start + CHUNK_ROWS] = torch.from_numpy(np.array(part, dtype=np.float32))
    except NotImplementedError as err:
        raise ValueError(f"the gguf package cannot read {kind} tensors: {err}") from None
    return out
