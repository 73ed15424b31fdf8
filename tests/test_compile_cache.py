"""The compile cache directory: under the cache root, apart per model and weight format and per
torch version, and the one inductor uses once `use_compile_cache` ran; a graph compiled with
the CPU backend (`kernels.cpu_compile`) is read back from it."""

from __future__ import annotations

import pickle

import torch
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir

from agent_kv.runtime.models.compile_cache import compile_cache_dir, use_compile_cache
from kernels import cpu_compile


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


def test_the_backends_decompositions_pickle_as_their_source_for_inductors_key():
    table = cpu_compile._table()
    assert pickle.loads(pickle.dumps(table)) is table
    assert cpu_compile._SOURCE_DIGEST.encode() in pickle.dumps(table)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b).relu()  # a few rows: the backend's own decomposition of `mm`


def test_a_graph_compiled_with_the_backend_is_read_back_from_inductors_cache(tmp_path, monkeypatch):
    """Without a key for its decomposition table, inductor bypassed its FX graph cache: every
    start compiled every graph anew."""
    monkeypatch.setenv("AGENT_KV_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    use_compile_cache("a-product")
    a, b = torch.randn(2, 8), torch.randn(8, 16)
    seen = []
    for _ in range(2):  # the second as a new process would: nothing compiled in memory
        torch._dynamo.reset()
        before = _cache_counts()
        step = torch.compile(_product, backend=cpu_compile.backend, fullgraph=True)
        torch.testing.assert_close(step(a, b), _product(a, b))
        seen.append(tuple(after - was for after, was in zip(_cache_counts(), before, strict=True)))
    assert seen == [(1, 0), (0, 1)]  # (misses, hits) of inductor's FX graph cache


def _cache_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_miss"], counters["fxgraph_cache_hit"]
