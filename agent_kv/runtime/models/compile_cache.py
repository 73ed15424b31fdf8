"""Where compiled decode steps are kept across starts: inductor's cache directory, under the
project's cache root.

Compiling the decode step (`agent_kv.runtime.engine.decode_graph`, `torch.compile` on CPU) takes
minutes on a 2-core machine. Inductor keeps what it generates and builds (the FX graph cache:
the generated C++ and the shared objects compiled from it) in `$TORCHINDUCTOR_CACHE_DIR`, by
default a directory under /tmp that a reboot or a cleaner empties. `use_compile_cache` points
it at `cache_root()/compile/torch-VERSION/KEY` before the first compile, with inductor's FX
graph cache on, so a later start of the same model, weight format and torch finds its
kernels there and skips their code generation and C++ builds; Dynamo still traces the model
and AOTAutograd still lowers it on every start (`kernels.cpu_compile.backend` keeps
AOTAutograd's own cache off: its key misses the backend's decompositions). A new torch
version, model or weight format starts a fresh directory (inductor's keys cover the graph and
torch anyway: the directories keep one model's entries apart, so that they can be cleared
alone). Deleting the directory clears the cache; `$AGENT_KV_CACHE` moves it with the rest of
the cache root.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch
from torch._inductor import config as inductor_config

from agent_kv.runtime.models.model_cache import cache_root


def compile_cache_dir(key: str, torch_version: str) -> Path:
    """The compile cache directory of `key` (a model and weight format, `use_compile_cache`)
    under torch `torch_version`: `cache_root()/compile/torch-VERSION/NAME-HASH`, NAME the
    key's letters, digits, dots and dashes, HASH from the whole key (a path in it stays
    apart from a like-named one)."""
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", key).strip("_")[-64:]
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return cache_root() / "compile" / f"torch-{torch_version}" / f"{name}-{digest}"


def use_compile_cache(key: str) -> Path:
    """Point inductor's cache at `compile_cache_dir(key, torch.__version__)` (through
    `$TORCHINDUCTOR_CACHE_DIR`, which torch's compile workers inherit) and turn its FX graph
    cache on; call before the first compile of the process. Returns the directory."""
    directory = compile_cache_dir(key, torch.__version__)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    inductor_config.fx_graph_cache = True
    return directory
