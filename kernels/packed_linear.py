"""Linear layers on prepacked weights through PyTorch's native fbgemm products (x86 CPUs),
usable inside `torch.compile`.

A decode step reads every weight once per token, so its cost is the weights' bytes, and the
packed layouts are read at a higher rate than the BLAS `mm` reads one row's product
(`benchmarks/weight_formats.py`). One pack:

- `fp16`: the fp32 weights rounded to fp16 (relative error about 2e-4 on the bundled models'
  de-quantized GGUF weights), widened in registers; activations and accumulation fp32
  (`torch.ops.quantized.linear_dynamic_fp16`).

A pack is an opaque fbgemm object, which `torch.compile` cannot trace; `PackedLinear` keeps it
in a process-wide table and, under compile, calls it through the custom op
`agent_kv::packed_linear` by its index, so a compiled decode step holds each product as one
opaque call.
"""

from __future__ import annotations

import itertools
import weakref

import torch

PACKS = ("fp16",)
_PACKED: dict[int, tuple[str, torch.ScriptObject]] = {}
"""(pack, packed weight) by handle; an entry goes when its `PackedLinear` is collected."""
_HANDLES = itertools.count()


def _product(x: torch.Tensor, handle: int) -> torch.Tensor:
    pack, packed = _PACKED[handle]
    x = x.contiguous()
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


@torch.library.custom_op("agent_kv::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """`x @ W.T + b` for the packed weight `handle` (`PackedLinear`).

    Args:
        x: float32 `[..., in_features]`.
        handle: the `PackedLinear`'s key in the table of packed weights.
        out_features: the product's last dimension (for shape inference under compile).

    Returns:
        float32 `[..., out_features]`.
    """
    return _product(x, handle)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(torch.nn.Module):
    """A `torch.nn.Linear` whose weight (and bias) are held as one fbgemm pack; the fp32
    weight is not kept.

    Args:
        linear: a float32 CPU linear layer to replace.
        pack: `fp16` (module docstring).

    Raises:
        ValueError: an unknown pack, or `linear` is not a float32 layer on the CPU (fbgemm
            runs on x86 CPUs).
    """

    def __init__(self, linear: torch.nn.Linear, pack: str):
        super().__init__()
        if pack not in PACKS:
            raise ValueError(f"unknown pack {pack!r}: choose one of {', '.join(PACKS)}")
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"packed weights take a float32 CPU layer, got {weight.dtype} on {weight.device}"
            )
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.pack = pack
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = (pack, _prepack(weight, bias, pack))
        weakref.finalize(self, _PACKED.pop, self.handle, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., in_features]` float32 in, `[..., out_features]` float32 out. Eagerly the
        fbgemm op is called directly (the custom op's dispatch costs ~0.1 ms a call, a fifth
        of a decode step's products); under `torch.compile` through the custom op."""
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.out_features)
        return _product(x, self.handle)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.pack}"


def _prepack(weight: torch.Tensor, bias: torch.Tensor | None, pack: str) -> torch.ScriptObject:
    """fbgemm's pack of `weight` `[out, in]` (and `bias` `[out]`) in format `pack`."""
    return torch.ops.quantized.linear_prepack_fp16(weight, bias)
