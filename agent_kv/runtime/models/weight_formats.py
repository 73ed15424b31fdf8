"""How a loaded model holds its weights (`--weights`): the formats, and turning an fp32 model
into one of them.

- `fp32`: the GGUF file's weights de-quantized to float32.
- `bf16`: the model's dtype is bfloat16 (weights and activations); the KV store keeps float32
  (`KV_DTYPE_ATTRIBUTE`), so the cache's figures and precision tiers are those of every other
  format.
- `fp16`: every linear layer's weight prepacked as fp16 for fbgemm (`kernels.packed_linear`):
  activations, accumulation, embeddings, norms and the KV store stay float32.
- `int8`: every linear layer's weight INT8 with one scale per output channel, weight-only
  (`kernels.quantized_linear.Int8Linear`: activations are never quantized), and the embedding
  table INT8 per row.
- `gguf`: each tensor in the packed form nearest to how it is stored: a GGUF file's 4-bit
  blocks as packed 4-bit groups, exactly, every other tensor as `int8` (`gguf_weights`). A
  model directory's float weights have no 4-bit blocks, so there `gguf` holds `int8` rows.

A GGUF file is read straight into any format (`gguf_weights.build`); a Hugging Face model
directory loads in float32 and `apply_weight_format` converts it.

`benchmarks/weight_formats.py`, `weight_memory.py` and `weight_quality.py` measure each
(decode and prefill speed against llama.cpp and transformers, memory and load time, the
quality cost against fp32), which is how the default was chosen (docs/models.md, "Weights").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent_kv.errors import ConfigError

if TYPE_CHECKING:  # torch is imported on use: the CLI checks `--weights` before importing it
    import torch

WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "gguf")
DEFAULT_WEIGHTS = "gguf"
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


def mark_weight_format(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Mark on `model` (already holding its weights in format `name`) the format
    (`weight_format`) and the KV store's dtype, float32. Returns `model`."""
    import torch

    from agent_kv.kv.store import KV_DTYPE_ATTRIBUTE

    setattr(model, KV_DTYPE_ATTRIBUTE, torch.float32)
    setattr(model, WEIGHTS_ATTRIBUTE, check_weight_format(name))
    return model


def apply_weight_format(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Put `model` (a Hugging Face directory's model loaded in `load_dtype(name)`) into weight
    format `name`, in place, and mark it (`mark_weight_format`). Returns `model`.

    Raises:
        ConfigError: an unknown format, or `fp16`/`int8`/`gguf` on a model that is not on the
            CPU (the packed products are CPU kernels; on a GPU use `bf16`).
    """
    check_weight_format(name)
    if name in ("fp16", "int8", "gguf"):
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ConfigError(f"--weights {name} runs on the CPU only (the model is on {device})")
        _pack_linears(model, "fp16" if name == "fp16" else "int8")
    return mark_weight_format(model, name)


def _pack_linears(module: torch.nn.Module, pack: str) -> None:
    """Replace every `torch.nn.Linear` under `module` with its fp16 `PackedLinear` (`fp16`) or
    its `Int8Linear` (`int8`)."""
    import torch

    from kernels.packed_linear import PackedLinear
    from kernels.quantized_linear import Int8Linear

    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            bias = None if child.bias is None else child.bias.detach().float()
            packed = (
                PackedLinear(child, "fp16")
                if pack == "fp16"
                else Int8Linear(child.weight.detach(), bias)
            )
            setattr(module, name, packed)
        else:
            _pack_linears(child, pack)
