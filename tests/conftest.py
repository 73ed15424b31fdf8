"""Shared fixtures: the default model is loaded once per test session."""

from __future__ import annotations

import pytest

from agent_kv.model_loading import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct (fp32, CPU), attention through the KV store."""
    return load_model()
