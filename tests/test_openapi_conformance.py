"""Schemathesis over `/openapi.json` of a live server: every status, header, content type and
body the server answers matches its OpenAPI document, schema-valid requests are accepted and
invalid ones refused, and nothing is a 500. Its report is printed (`pytest -s` shows the
counts).

The default run serves tiny random-weight models behind SmolLM2's tokenizer and behind the
default model's (Qwen's template, its `<tool_call>` added tokens in the tool grammars), each
ending strings and turns early as a trained model does: the same prompts, templates, grammars
and short replies, ~2,500 requests in ~30 s each on 2 busy cores; `slow` runs the same on the
real default model (the model's compute: more than 20 minutes on 2 busy cores, so its run may
take 90)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.session_store import SessionStore
from api.app import create_app
from tests.conftest import serving

pytestmark = pytest.mark.enable_socket

HERE = Path(__file__).parent / "schemathesis"
MAX_EXAMPLES = 25
SEED = 15


@pytest.mark.parametrize(
    "model", ["tiny", "tiny-qwen", pytest.param("default", marks=pytest.mark.slow)]
)
def test_schemathesis_finds_no_failure(request, tmp_path, model):
    if model == "tiny":
        served, tokenizer = (
            request.getfixturevalue("brief_tiny_llama"),
            request.getfixturevalue("smollm").tokenizer,
        )
    elif model == "tiny-qwen":
        served = request.getfixturevalue("tiny_qwen")
        tokenizer = request.getfixturevalue("qwen_tokenizer")
    else:
        loaded = request.getfixturevalue("default_model")
        served, tokenizer = loaded.model, loaded.tokenizer
    engine = Engine(served, tokenizer, make_policy("conf-kv", budget=256))
    sessions = SessionStore(engine, max_kv_bytes=200 * 2**20, idle_ttl_s=600)
    app = create_app(ChatService(engine, sessions), "smollm2-135m", allowed_hosts=["127.0.0.1"])
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "hooks", "PYTHONPATH": str(HERE)}
    with serving(app) as url:
        result = subprocess.run(
            [
                str(Path(sys.executable).parent / "st"),
                "--config-file", str(HERE / "schemathesis.toml"),
                "run", f"{url}/openapi.json",
                "--max-examples", str(MAX_EXAMPLES),
                "--seed", str(SEED),
                "--request-timeout", "120",
                "--no-color",
            ],
            capture_output=True, text=True, env=env, cwd=tmp_path,
            timeout=1200 if model.startswith("tiny") else 5400,
        )  # fmt: skip
    print(result.stdout[-4000:], result.stderr[-2000:])
    assert result.returncode == 0, result.stdout[-8000:]
    assert "No issues found" in result.stdout or "passed" in result.stdout
