"""Byte budgets: parsing sizes, converting to tokens, and the CLI's policy spec."""

from __future__ import annotations

import pytest

from agent_kv.errors import ConfigError
from agent_kv.kv.budgets import parse_bytes, tokens_for_bytes
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.store import KVStore

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


def test_byte_budget_with_int8_counts_the_fp_window_at_full_cost():
    int8_cost = 2 * 30 * 3 * 64 * (1 + 2 / 32)  # SmolLM2: int8 values + float16 scales / 32
    assert KVStore(30, 3, 64).int8_bytes_per_token(32) == int8_cost == 12_240
    # 128 + 31 tokens at 46,080 bytes, the rest at 12,240
    assert tokens_for_bytes(38_000_000, SMOLLM_FP32_BYTES_PER_TOKEN, int8_cost, 159) == 2664
    spec = PolicySpec.parse("window", None, "38MB", int8=True, fp_window=128)
    assert spec.build(SMOLLM_FP32_BYTES_PER_TOKEN, int8_cost).window == 2664
    # a budget smaller than the FP window is all full precision
    assert tokens_for_bytes(4_608_000, SMOLLM_FP32_BYTES_PER_TOKEN, int8_cost, 159) == 100
    with pytest.raises(ConfigError, match="positions"):
        PolicySpec.parse("window", 100, None, positions="sideways")
    with pytest.raises(ConfigError, match="fp_window"):
        PolicySpec.parse("window", 100, None, int8=True, fp_window=-1)


def test_byte_budgets_are_checked_once_converted():
    # 1 GB holds ~21,700 tokens: protect_recent=600 is fine once converted
    spec = PolicySpec.parse("conf-kv", None, "1GB", protect_recent=600)
    assert spec.build(SMOLLM_FP32_BYTES_PER_TOKEN).n_high == 1_000_000_000 // 46_080 // 2
    with pytest.raises(ConfigError, match="takes no budget"):
        PolicySpec.parse("full", None, "38MB")
    with pytest.raises(ConfigError, match="cannot read ''"):
        PolicySpec.parse("window", None, "")
    with pytest.raises(ConfigError, match="needs --int8"):
        PolicySpec.parse("window", 100, None, fp_window=64)


def test_policy_params_from_the_command_line():
    spec = PolicySpec.parse("arkv", 256, None, extra=["quantized=int8", "gamma=0.5", "group=16"])
    assert spec.params == {"quantized": "int8", "gamma": 0.5, "group": 16}
    policy = spec.build(SMOLLM_FP32_BYTES_PER_TOKEN)
    assert (policy.quantized, policy.gamma, policy.group, policy.budget_tokens) == (
        "int8",
        0.5,
        16,
        256,
    )
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        PolicySpec.parse("arkv", 256, None, extra=["gamma"])
    with pytest.raises(ConfigError, match="has no parameter 'colour'"):
        PolicySpec.parse("arkv", 256, None, extra=["colour=red"])
    with pytest.raises(ConfigError, match="gamma' must be float"):
        PolicySpec.parse("arkv", 256, None, extra=["gamma=high"])
    with pytest.raises(ConfigError, match="without --int8"):
        PolicySpec.parse("arkv", 256, None, int8=True)


def test_an_arkv_byte_budget_counts_full_precision_tokens():
    spec = PolicySpec.parse("arkv", None, "38MB")
    assert spec.build(SMOLLM_FP32_BYTES_PER_TOKEN).budget_tokens == 38_000_000 // 46_080
