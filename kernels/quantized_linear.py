"""Weight-only quantized linear layers and embeddings for the CPU, on PyTorch's own packed
products: the weights stay in their integer form in memory, decode reads them packed, and a
prefill chunk de-quantizes them on the fly.

- `Int4Linear`: 4-bit codes in groups of 32 along each row, one scale and offset per group
  (the GGUF 4-bit block types read exactly, `kernels.gguf_blocks.int4_groups`). Decode calls
  `torch.ops.aten._weight_int4pack_mm_for_cpu` (activations rounded to bf16, whose weight
  de-quantization is `(q - 8) * scale + zero` with scale and zero in bf16).
- `Int8Linear`: INT8 weights with one scale per output row (absmax / 127: weight-only
  per-channel quantization; the activations are never quantized). Decode calls
  `torch.ops.aten._weight_int8pack_mm` (activations rounded to bf16).
- `Int8Embedding`: an embedding table in INT8 rows with one scale per row.

Why two paths: measured on this project's CPU (AVX-512 with AMX) at one thread for a
4864x896 product, the packed products take 0.68 ms (int4) and 0.94 ms (int8) for one row
against 1.51 ms for fp32 `mm` and 1.32 ms for fbgemm's fp16, but 29.5 and 30.9 ms for a
128-row prefill chunk against 20.0 ms (fp32) and 3.2 ms (bf16 `mm`, on AMX). So a call with
at most `PACKED_ROWS` rows (decode, a batch of decode rows) takes the packed product, and a
longer one de-quantizes the weight into `prefill_dtype()` and calls `F.linear`: bf16 where
the CPU has AMX tiles, float32 elsewhere (on the AVX2-only CPU this project had before, a
bf16 `mm` ran ~6x slower than fp32: docs/models.md, "Weights"). Every layer returns
float32.

Under `torch.compile` the packed products are custom ops (`agent_kv::int4_weight_mm`,
`agent_kv::int8_weight_mm`), one opaque call each; eagerly the aten product is called
directly (a custom op's dispatch costs ~0.1 ms a call).
"""

from __future__ import annotations

import abc
import functools

import torch
import torch.nn.functional as F

from kernels.gguf_blocks import GROUP, Int4Groups

PACKED_ROWS = 32
"""A call with at most this many rows uses the packed product; more rows de-quantize."""


@functools.cache
def prefill_dtype() -> torch.dtype:
    """bf16 on a CPU with AMX tiles, else float32 (module docstring)."""
    return torch.bfloat16 if torch.cpu._is_amx_tile_supported() else torch.float32


@functools.cache
def int4_block_rows() -> int:
    """Rows per block of `_convert_weight_to_int4pack_for_cpu`'s layout on this CPU: 64 under
    AVX-512, 32 under AVX2. The pack is `[N / B, K, B / 2]` bytes whose low nibble holds row
    `j` and high nibble row `j + B / 2` of each block of `B` rows; the layout is checked
    against a packed probe, not assumed.

    Raises:
        RuntimeError: this build packs in another layout (the CPU has neither AVX2 nor
            AVX-512, or PyTorch changed it): the int4 format cannot run here.
    """
    probe = torch.randint(0, 16, (64, 64), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for rows in (64, 32):
        if torch.equal(_unpack(packed, rows, 64, 64), probe.to(torch.uint8)):
            return rows
    raise RuntimeError(
        "this PyTorch build packs int4 weights in a layout agent_kv cannot read "
        f"(CPU capability {torch.backends.cpu.get_cpu_capability()}): use --weights int8"
    )


def _unpack(packed: torch.Tensor, rows: int, n: int, k: int) -> torch.Tensor:
    """Codes uint8 `[n, k]` from the CPU int4 pack in blocks of `rows` rows."""
    blocks = packed.view(n // rows, k, rows // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2).reshape(n, k)


def _int4_product(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scale_zero)
    return y.float().view(*x.shape[:-1], scale_zero.shape[1])


def _int8_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(flat, codes, scale.bfloat16())
    return y.float().view(*x.shape[:-1], codes.shape[0])


@torch.library.custom_op("agent_kv::int4_weight_mm", mutates_args=())
def int4_weight_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` for an `Int4Linear`'s packed weight, as one opaque call under `torch.compile`
    (inductor cannot lower the aten product's bf16 input conversion into it).

    Args:
        x: float32 `[..., in_features]`.
        packed: the CPU int4 pack, uint8 `[out_features, in_features / 2]`.
        scale_zero: bf16 `[in_features / 32, out_features, 2]`.

    Returns:
        float32 `[..., out_features]`.
    """
    return _int4_product(x, packed, scale_zero)


@int4_weight_mm.register_fake
def _(x, packed, scale_zero):
    return x.new_empty(*x.shape[:-1], scale_zero.shape[1])


@torch.library.custom_op("agent_kv::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` for an `Int8Linear`'s weight, as one opaque call under `torch.compile`.

    Args:
        x: float32 `[..., in_features]`.
        codes: int8 `[out_features, in_features]`.
        scale: float32 `[out_features]`.

    Returns:
        float32 `[..., out_features]`.
    """
    return _int8_product(x, codes, scale)


@int8_weight_mm.register_fake
def _(x, codes, scale):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


class _WeightOnlyLinear(torch.nn.Module, abc.ABC):
    """What `Int4Linear` and `Int8Linear` share: the choice between the packed product (at
    most `PACKED_ROWS` rows: `packed_product`) and a de-quantized `F.linear` (`dequantized`),
    and the bias. Subclasses set `in_features`, `out_features`, `bias` and `kind`."""

    kind = ""

    @abc.abstractmethod
    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        """float32 `[..., in_features]` times the packed weight, float32 out."""

    @abc.abstractmethod
    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight de-quantized into `dtype`, `[out_features, in_features]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 `[..., in_features]` in, float32 `[..., out_features]` out."""
        if _rows(x) <= PACKED_ROWS:
            y = self.packed_product(x)
        else:
            dtype = prefill_dtype()
            y = F.linear(x.to(dtype), self.dequantized(dtype)).float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int4Linear(_WeightOnlyLinear):
    """A linear layer holding its weight as packed 4-bit groups (module docstring).

    Args:
        groups: the weight `[out_features, in_features]` as `Int4Groups`; `out_features` a
            multiple of `int4_block_rows()` and `in_features` of `GROUP`.
        bias: float32 `[out_features]` or None.

    Raises:
        ValueError: shapes the packed layout cannot hold.
        RuntimeError: the CPU's int4 pack layout is unknown (`int4_block_rows`).
    """

    kind = "int4"

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None):
        super().__init__()
        n, k = groups.codes.shape
        if n % int4_block_rows() or k % GROUP:
            raise ValueError(
                f"an int4 weight needs rows in multiples of {int4_block_rows()} and inputs "
                f"in multiples of {GROUP}, got [{n}, {k}]"
            )
        self.in_features, self.out_features = k, n
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.int(), 1)
        )
        zero = groups.offset + 8 * groups.scale
        self.register_buffer(
            "scale_zero", torch.stack([groups.scale.t(), zero.t()], dim=-1).bfloat16()
        )
        self.register_buffer("bias", bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight de-quantized into `dtype`, `[out_features, in_features]`."""
        n, k = self.out_features, self.in_features
        codes = _unpack(self.packed, int4_block_rows(), n, k).view(n, k // GROUP, GROUP)
        scale = self.scale_zero[..., 0].t().to(dtype)[..., None]
        zero = self.scale_zero[..., 1].t().to(dtype)[..., None]
        return ((codes.to(dtype) - 8) * scale + zero).view(n, k)

    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` through `_weight_int4pack_mm_for_cpu` (the custom op under compile)."""
        product = int4_weight_mm if torch.compiler.is_compiling() else _int4_product
        return product(x, self.packed, self.scale_zero)


def int8_rows(weight: torch.Tensor, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric INT8 of a float weight `[N, K]`: (int8 `[N, K]`, float32 scale `[N]`),
    `weight ~ q * scale[:, None]`, scale = row absmax / 127; `chunk_rows` rows at a time, so
    the float temporaries stay small."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk_rows):
        rows = weight[start : start + chunk_rows].float()
        row_scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        codes[start : start + chunk_rows] = torch.round(rows / row_scale[:, None]).clamp(-127, 127)
        scale[start : start + chunk_rows] = row_scale
    return codes, scale


class Int8Linear(_WeightOnlyLinear):
    """A linear layer holding its weight as INT8 rows with one scale each (module docstring).

    Args:
        weight: the float weight `[out_features, in_features]` (quantized here).
        bias: float32 `[out_features]` or None.
    """

    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        codes, scale = int8_rows(weight)
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight de-quantized into `dtype`, `[out_features, in_features]`."""
        return self.codes.to(dtype) * self.scale.to(dtype)[:, None]

    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` through `_weight_int8pack_mm` (the custom op under compile)."""
        product = int8_weight_mm if torch.compiler.is_compiling() else _int8_product
        return product(x, self.codes, self.scale)


class Int8Embedding(torch.nn.Module):
    """An embedding table as INT8 rows with one scale each (`int8_rows`).

    Args:
        weight: the float table `[vocabulary, hidden]`.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        codes, scale = int8_rows(weight)
        self.num_embeddings, self.embedding_dim = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ids `[...]` in, float32 `[..., hidden]` out."""
        return self.codes[ids].float() * self.scale[ids][..., None]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"
