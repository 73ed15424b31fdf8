"""Build a transformers causal LM straight from a GGUF file, one tensor at a time, in a weight
format (`weight_formats.WEIGHT_FORMATS`): no fp32 copy of the model on disk, and none in memory
beyond the one tensor being read.

The model's skeleton is built from its config on the `meta` device (no memory), each GGUF
tensor is mapped to its transformers name (transformers' own map, `get_gguf_hf_weights_map`,
with its per-architecture row permutation for Llama's query and key weights), and every linear
layer, embedding and norm is put in place in the format:

- `fp32`, `bf16`: float weights in that dtype;
- `fp16`: linear weights as fbgemm fp16 packs (`kernels.packed_linear`);
- `int8`: linear weights INT8 per output row, weight-only (`kernels.quantized_linear`),
  the embedding table INT8 per row;
- `gguf`: each tensor in the packed form nearest to how the file stores it: the 4-bit block
  types (Q4_0, Q4_1, Q4_K) as their own 4-bit groups, exactly (`Int4Linear`); every other
  type INT8 per output row (`Int8Linear`); the embedding table INT8 per row.

A GGUF model whose file has no `output.weight` ties its output layer to the token embedding:
the float formats share the tensor; the quantized ones build the output layer from the same
GGUF tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from agent_kv.errors import ConfigError, ModelNotFoundError
from kernels.gguf_blocks import INT4_TYPES, dequantize, int4_groups
from kernels.gguf_file import GGUFTensor, read_tensors

QUANTIZED_FORMATS = ("int8", "gguf")
"""Formats whose linear layers hold integer weights (and an INT8 embedding table)."""


def _row_order(processor, gguf_name: str, rows: int) -> torch.Tensor | None:
    """The row permutation transformers' tensor processor applies to `gguf_name` (None when it
    keeps the rows), found by running it on the row indices.

    Raises:
        ConfigError: the processor changes the tensor in a way other than reordering rows.
    """
    index = np.arange(rows, dtype=np.float64)[:, None]
    processed = np.asarray(processor.process(index, gguf_name).weights)
    if processed.shape != index.shape or not np.array_equal(np.sort(processed[:, 0]), index[:, 0]):
        raise ConfigError(
            f"{gguf_name}: transformers rewrites this tensor beyond a row order, which the "
            "integer weight formats cannot follow: use --weights fp32"
        )
    if np.array_equal(processed, index):
        return None
    return torch.from_numpy(processed[:, 0].astype(np.int64))


def _float(processor, name: str, tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32 in transformers' layout."""
    values = dequantize(tensor.raw, tensor.kind, tensor.shape).numpy()
    return torch.from_numpy(np.ascontiguousarray(processor.process(values, name).weights))


def _linear(processor, name: str, tensor: GGUFTensor, bias, weights: str) -> torch.nn.Module:
    """The linear layer of GGUF tensor `name` in format `weights`."""
    from kernels.packed_linear import PackedLinear
    from kernels.quantized_linear import Int4Linear, Int8Linear, int4_block_rows

    if weights == "gguf" and tensor.kind in INT4_TYPES and tensor.shape[0] % int4_block_rows() == 0:
        groups = int4_groups(tensor.raw, tensor.kind, tensor.shape)
        order = _row_order(processor, name, tensor.shape[0])
        return Int4Linear(groups if order is None else groups.rows(order), bias)
    weight = _float(processor, name, tensor)
    if weights in QUANTIZED_FORMATS:
        return Int8Linear(weight, bias)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    if weights == "fp16":
        return PackedLinear(linear, "fp16")
    return linear.to(torch.bfloat16) if weights == "bf16" else linear


def _gguf_names(model: torch.nn.Module, processor) -> dict[str, str]:
    """transformers parameter name -> GGUF tensor name, from the `gguf` package's tensor name
    map for the model's architecture (the map `transformers.modeling_gguf_pytorch_utils.
    get_gguf_hf_weights_map` builds, built here once instead of once per submodule).

    Raises:
        ConfigError: the `gguf` package does not know the architecture.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_type = model.config.model_type
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == model_type), None)
    if arch is None:
        raise ConfigError(f"the gguf package does not know the {model_type} architecture")
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for hf_name, _ in model.named_parameters():
        stem, _, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            names[hf_name] = f"{gguf_name}.{suffix}"
    return names


def _parent(model: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = dotted.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def build(gguf: Path, config, weights: str, attention: str) -> torch.nn.Module:
    """The causal LM of `gguf` in weight format `weights`, in eval mode.

    Args:
        gguf: the GGUF file.
        config: its transformers config (`AutoConfig.from_pretrained(..., gguf_file=...)`).
        weights: a weight format (`weight_formats.WEIGHT_FORMATS`).
        attention: the attention implementation to build with.

    Raises:
        ModelNotFoundError: the file lacks a tensor the model needs, or cannot be read.
        ConfigError: a tensor type the `gguf` package cannot read, named with its tensor; or
            an architecture whose tensors transformers rewrites beyond a row order, under an
            integer format.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from kernels.quantized_linear import Int8Embedding

    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    processor = TENSOR_PROCESSORS.get(config.model_type, TensorProcessor)(config=config.to_dict())
    names = _gguf_names(model, processor)
    try:
        tensors = read_tensors(gguf)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(f"cannot read the GGUF file {gguf}: {err}") from None

    def tensor(hf_name: str) -> tuple[str, GGUFTensor]:
        gguf_name = names.get(hf_name)
        if gguf_name not in tensors:
            raise ModelNotFoundError(f"{gguf} has no tensor for {hf_name}")
        return gguf_name, tensors[gguf_name]

    def read(hf_name: str) -> torch.Tensor:
        try:
            return _float(processor, *tensor(hf_name))
        except ValueError as err:
            raise ConfigError(f"{gguf.name}, tensor {names[hf_name]}: {err}") from None

    embedding = model.get_input_embeddings()
    embedding_name = next(n for n, m in model.named_modules() if m is embedding)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    tied = f"{head_name}.weight" not in names or names[f"{head_name}.weight"] not in tensors
    for module_name, module in list(model.named_modules()):
        if module is head and tied and weights not in QUANTIZED_FORMATS:
            continue  # tied to the embedding below
        if isinstance(module, torch.nn.Linear):
            source = (
                f"{embedding_name}.weight" if module is head and tied else f"{module_name}.weight"
            )
            bias = read(f"{module_name}.bias") if module.bias is not None else None
            try:
                replacement = _linear(processor, *tensor(source), bias, weights)
            except ValueError as err:
                raise ConfigError(f"{gguf.name}, tensor {names[source]}: {err}") from None
            parent, leaf = _parent(model, module_name)
            setattr(parent, leaf, replacement)
        elif module is embedding:
            parent, leaf = _parent(model, module_name)
            if weights in QUANTIZED_FORMATS:
                setattr(parent, leaf, Int8Embedding(read(f"{module_name}.weight")))
            else:
                table = read(f"{module_name}.weight").to(dtype)
                module.weight = torch.nn.Parameter(table, requires_grad=False)
        else:
            for param_name in [n for n, _ in module.named_parameters(recurse=False)]:
                value = read(f"{module_name}.{param_name}").to(dtype)
                module._parameters[param_name] = torch.nn.Parameter(value, requires_grad=False)
    if tied and weights not in QUANTIZED_FORMATS:
        _tie_head(model, head_name, weights)
    _rebuild_meta_buffers(model, config)
    return model.eval()


def _tie_head(model: torch.nn.Module, head_name: str, weights: str) -> None:
    """Give the output layer the embedding table as its weight (float formats; under `fp16`
    the output layer is packed from it)."""
    from kernels.packed_linear import PackedLinear

    table = model.get_input_embeddings().weight
    head = torch.nn.Linear(table.shape[1], table.shape[0], bias=False, dtype=table.dtype)
    head.weight = table
    parent, leaf = _parent(model, head_name)
    setattr(parent, leaf, PackedLinear(head, "fp16") if weights == "fp16" else head)


def _rebuild_meta_buffers(model: torch.nn.Module, config) -> None:
    """Build again on the CPU each module that still holds `meta` buffers (the rotary
    embedding's `inv_freq`, computed from the config at construction).

    Raises:
        ModelNotFoundError: such a module cannot be built from the config alone.
    """
    for module_name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            try:
                rebuilt = type(module)(config=config)
            except TypeError as err:
                raise ModelNotFoundError(
                    f"cannot build {module_name} ({type(module).__name__}) outside its model: {err}"
                ) from None
            parent, leaf = _parent(model, module_name)
            setattr(parent, leaf, rebuilt)
