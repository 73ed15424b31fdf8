"""Byte budgets: parsing sizes, converting to tokens, and the CLI's policy spec."""

from __future__ import annotations

import pytest

from agent_kv.budgets import parse_bytes, tokens_for_bytes
from agent_kv.cli import PolicySpec
from agent_kv.errors import ConfigError

SMOLLM_FP32_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


@pytest.mark.parametrize(
    "text,size",
    [
        ("38MB", 38_000_000),
        ("512KiB", 524_288),
        ("1.5 GB", 1_500_000_000),
        ("4096", 4096),
        ("2gib", 2 * 2**30),
    ],
)
def test_sizes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["abc", "12 parsecs", "-5MB", "0MB", ""])
def test_bad_sizes(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_tokens_for_bytes():
    assert tokens_for_bytes(38_000_000, SMOLLM_FP32_BYTES_PER_TOKEN) == 824
    with pytest.raises(ConfigError, match="holds no token"):
        tokens_for_bytes(1000, SMOLLM_FP32_BYTES_PER_TOKEN)


def test_byte_budget_becomes_the_policy_budget():
    spec = PolicySpec.parse("conf-kv", None, "38MB", 0.7, None)
    policy = spec.build(SMOLLM_FP32_BYTES_PER_TOKEN)
    assert (policy.n_low, policy.n_high, policy.tau) == (824, 412, 0.7)
    window = PolicySpec.parse("window", None, "38MB", None, None).build(SMOLLM_FP32_BYTES_PER_TOKEN)
    assert window.window == 824
    with pytest.raises(ConfigError, match="not both"):
        PolicySpec.parse("conf-kv", 100, "38MB", None, None)
    with pytest.raises(ConfigError, match="no parameter 'tau'"):
        PolicySpec.parse("window", None, "38MB", 0.5, None)
