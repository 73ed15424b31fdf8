"""Which implementation runs the store's attention read for decode and short chunks, and its
quantize-on-append.

`AGENT_KV_KERNELS` (read at every call) chooses:
- `auto` (default): the Triton kernels (`kernels.triton_attention`) for CUDA tensors, the
  PyTorch path (`kernels.torch_attention.single_pass_attention`) elsewhere;
- `triton`: the Triton kernels on any device (CPU tensors need `TRITON_INTERPRET=1` set
  before `kernels.triton_attention` is imported, see `kernels.triton_device`);
- `torch`: the PyTorch path everywhere.
Calls the Triton kernel refuses (`kernels.triton_attention.unsupported`: rerotate mode, more
than 16 queries, a sliding-window mask, logit soft-capping, attention sinks) use the PyTorch
path under every setting: the Triton kernel implements none of the three model-family
features (`kernels.softmax_extras`), and falls back rather than approximating them. The
Triton modules (and so the compilation of their kernels) are imported at the first call that
uses them.
"""

from __future__ import annotations

import os

import torch

from kernels.formats import QuantFormat
from kernels.softmax_extras import NO_EXTRAS, SoftmaxExtras
from kernels.torch_attention import Segment, single_pass_attention

ENV = "AGENT_KV_KERNELS"
MODES = ("auto", "triton", "torch")


def kernel_mode() -> str:
    """The `AGENT_KV_KERNELS` setting, `auto` when unset.

    Raises:
        ValueError: a value other than `auto`, `triton` or `torch`.
    """
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use one of {', '.join(MODES)}")
    return mode


def decode_attention(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    extras: SoftmaxExtras = NO_EXTRAS,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`kernels.torch_attention.segmented_attention`'s contract, run by the implementation
    `kernel_mode()` picks for these tensors (the PyTorch path for a call the Triton kernel
    refuses).

    Args:
        query: `[B, Hq, q, D]`.
        segments: as for `kernels.torch_attention.segmented_attention`.
        scaling: softmax scale.
        extras: soft-capping and sinks (`kernels.softmax_extras`).

    Returns:
        `(out [B, q, Hq, D] in the query's dtype, [mass [B, Hkv, L_s] float32 per segment])`.

    Raises:
        ValueError: an unknown `AGENT_KV_KERNELS`, the implementation's own errors, or
            `triton` forced on CPU tensors without the interpreter.
    """
    if _use_triton(query):
        from kernels import triton_attention

        if triton_attention.unsupported(query, segments, extras) is None:
            return triton_attention.segmented_attention(query, segments, scaling)
    return single_pass_attention(query, segments, scaling, extras)


def _use_triton(tensor: torch.Tensor) -> bool:
    mode = kernel_mode()
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


def quantize_groups(
    x: torch.Tensor, group: int, fmt: QuantFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fmt.quantize(x, group)` (`[H, n, D]` -> codes `[H, n, D]`, float16 scales
    `[H, n // group, D]`), by `kernels.triton_store_ops.quantize_groups` when `kernel_mode()`
    picks Triton for `x`; both give the same bits.

    Raises:
        ValueError: `n` not a multiple of `group`, or (Triton) a device it cannot run on.
    """
    if _use_triton(x):
        from kernels import triton_store_ops

        return triton_store_ops.quantize_groups(x, group, fmt.dtype)
    return fmt.quantize(x, group)
