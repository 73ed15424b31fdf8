"""How a loaded model holds its weights (`--weights`): the formats, and turning an fp32 model
into one of them.

- `fp32`: as loaded (the bundled GGUF files de-quantized to float32).
- `bf16`: the model's dtype is bfloat16 (weights and activations); the KV store keeps float32
  (`KV_DTYPE_ATTRIBUTE`), so the cache's figures and precision tiers are those of every other
  format.
- `fp16`: every linear layer's weight prepacked as fp16 for fbgemm (`kernels.packed_linear`):
  activations, accumulation, embeddings, norms and the KV store stay float32.
- `int8`: every linear layer's weight INT8 with one scale per output channel, and its input
  quantized to 8 bits at each call (fbgemm's dynamic quantization, `kernels.packed_linear`):
  the fastest products on a CPU without AVX-512, at a measured cost in accuracy; embeddings,
  norms, attention and the KV store stay float32.

`benchmarks/weight_formats.py` measures each against fp32 (decode and prefill speed, and the
quality cost), which is how the default was chosen (docs/models.md, "Weights").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent_kv.errors import ConfigError

if TYPE_CHECKING:  # torch is imported on use: the CLI checks `--weights` before importing it
    import torch

WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8")
DEFAULT_WEIGHTS = "fp16"
WEIGHTS_ATTRIBUTE = "agent_kv_weights"
"""The attribute naming a model's weight format (`weight_format`)."""


def check_weight_format(name: str) -> str:
    """`name` if it is one of `WEIGHT_FORMATS`.

    Raises:
        ConfigError: any other name (the message lists the formats).
    """
    if name not in WEIGHT_FORMATS:
        raise ConfigError(
            f"unknown weight format {name!r}: choose one of {', '.join(WEIGHT_FORMATS)}"
        )
    return name


def weight_format(model) -> str:
    """The weight format `apply_weight_format` put `model` in; "fp32" for a model it did not
    touch (built in code)."""
    return getattr(model, WEIGHTS_ATTRIBUTE, "fp32")


def load_dtype(name: str) -> torch.dtype:
    """The dtype to load a model in for weight format `name` (bfloat16 for `bf16`, else
    float32: the other formats convert from fp32 weights)."""
    import torch

    return torch.bfloat16 if check_weight_format(name) == "bf16" else torch.float32


def apply_weight_format(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Put `model` (loaded in `load_dtype(name)`) into weight format `name`, in place, and
    mark on it the format (`weight_format`) and the KV store's dtype, float32. Returns
    `model`.

    Raises:
        ConfigError: an unknown format, or `fp16`/`int8` on a model that is not on the CPU
            (the packed products are CPU kernels; on a GPU use `bf16`).
    """
    import torch

    from agent_kv.kv.store import KV_DTYPE_ATTRIBUTE

    check_weight_format(name)
    setattr(model, KV_DTYPE_ATTRIBUTE, torch.float32)
    setattr(model, WEIGHTS_ATTRIBUTE, name)
    if name in ("fp32", "bf16"):
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(f"--weights {name} runs on the CPU only (the model is on {device})")
    _pack_linears(model, name)
    return model


def _pack_linears(module: torch.nn.Module, pack: str) -> None:
    """Replace every `torch.nn.Linear` under `module` with its `PackedLinear` in `pack`."""
    import torch

    from kernels.packed_linear import PackedLinear

    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, PackedLinear(child, pack))
        else:
            _pack_linears(child, pack)
