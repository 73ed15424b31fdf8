"""Where joined bundled GGUF files, their config and tokenizer files and their fp32 conversions
are kept: the cache directory, and a GGUF file's directories in it, keyed by the file's
content. No torch here: the command line's model listing reads it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """Directory holding joined bundled GGUF files (`gguf/`), GGUF models' config and tokenizer
    files (`files/`), compiled decode steps (`compile/`) and the fp32 conversions only
    transformers' own path reads (`models/`): `$AGENT_KV_CACHE` or the user cache dir."""
    return Path(os.environ.get("AGENT_KV_CACHE") or platformdirs.user_cache_dir("agent-kv"))


FINGERPRINT_BYTES = 2**20
"""Bytes read from each end of a GGUF file for its cache key."""


def converted_dir(gguf: Path) -> Path:
    """The cache directory of `gguf`'s conversion, keyed by the file's content (its size and
    first and last MiB, which hold the header, the tensor index and the end of the weights),
    not its path: the same model file in another clone or virtual environment reuses one
    conversion."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(size - FINGERPRINT_BYTES, 0))
        digest.update(f.read(FINGERPRINT_BYTES))
    return cache_root() / "models" / f"{gguf.stem}-{digest.hexdigest()[:12]}"


def model_files_dir(gguf: Path) -> Path:
    """The cache directory of `gguf`'s config and tokenizer files (no weights), keyed by the
    file's content like `converted_dir`."""
    return cache_root() / "files" / converted_dir(gguf).name


def prune_stale(target: Path) -> None:
    """Remove the other conversions of a file named like `target`'s GGUF (earlier versions of
    that model file), so the cache holds one per model name."""
    stem = target.name.rsplit("-", 1)[0]
    for other in target.parent.glob(f"{stem}-*"):
        if other != target and other.is_dir() and "." not in other.name[len(stem) :]:
            shutil.rmtree(other, ignore_errors=True)


def cached_conversion(gguf: Path) -> Path | None:
    """The converted safetensors directory of `gguf` in the cache, None when it has not been
    converted (looked up by the file's content: `converted_dir`)."""
    target = converted_dir(gguf)
    return target if target.is_dir() else None
