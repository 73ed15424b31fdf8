"""The compile cache directory: under the cache root, apart per model and weight format and per
torch version, and the one inductor uses once `use_compile_cache` ran (nothing compiled)."""

from __future__ import annotations

import torch
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir

from agent_kv.runtime.compile_cache import compile_cache_dir, use_compile_cache


def test_a_model_weight_format_or_torch_version_of_its_own_has_a_directory_of_its_own(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("AGENT_KV_CACHE", str(tmp_path))
    chosen = compile_cache_dir("qwen2.5-coder-0.5b-fp16", "2.13.0+cpu")
    assert chosen.parent == tmp_path / "compile" / "torch-2.13.0+cpu"
    assert chosen.name.startswith("qwen2.5-coder-0.5b-fp16-")
    assert chosen == compile_cache_dir("qwen2.5-coder-0.5b-fp16", "2.13.0+cpu")
    others = {
        compile_cache_dir("qwen2.5-coder-0.5b-int8", "2.13.0+cpu"),
        compile_cache_dir("smollm2-135m-fp16", "2.13.0+cpu"),
        compile_cache_dir("qwen2.5-coder-0.5b-fp16", "2.14.0+cpu"),
        compile_cache_dir("/models/a b-fp16", "2.13.0+cpu"),
        compile_cache_dir("/models/a_b-fp16", "2.13.0+cpu"),  # the same name once cleaned
    }
    assert len(others) == 5 and chosen not in others
    assert all(path.parent.parent == tmp_path / "compile" for path in others)


def test_use_compile_cache_points_inductor_at_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_KV_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    chosen = use_compile_cache("smollm2-135m-fp16")
    assert chosen == compile_cache_dir("smollm2-135m-fp16", torch.__version__)
    assert cache_dir() == str(chosen)  # what inductor reads before it writes
    assert inductor_config.fx_graph_cache
