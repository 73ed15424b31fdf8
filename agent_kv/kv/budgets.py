"""Memory budgets given in bytes: parsing (`38MB`, `1.5GiB`) and conversion to tokens."""

from __future__ import annotations

import re

from agent_kv.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`"38MB"` -> 38_000_000; units B, KB, MB, GB (powers of 1000) and KiB, MiB, GiB (1024).

    Raises:
        ConfigError: not a positive size with a known unit.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size: use e.g. 38MB, 512KiB or 2GB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"a memory budget must be positive, got {text!r}")
    return size


def tokens_for_bytes(
    budget_bytes: int,
    bytes_per_token: int,
    int8_bytes_per_token: float | None = None,
    fp_tokens: int = 0,
) -> int:
    """Tokens per layer whose keys and values, over all layers, fit in `budget_bytes`.

    Args:
        budget_bytes: the budget in bytes.
        bytes_per_token: key + value bytes of one full-precision token over all layers
            (`KVStore.bytes_per_token`; 46,080 for SmolLM2-135M in fp32).
        int8_bytes_per_token: the same for an INT8 token with its share of the scales
            (`KVStore.int8_bytes_per_token`), when mixed precision is on.
        fp_tokens: with INT8 on, how many tokens stay at full precision (the FP window plus
            up to a group waiting to be quantized); the rest cost `int8_bytes_per_token`.

    Raises:
        ConfigError: the budget holds less than one token.
    """
    tokens = budget_bytes // bytes_per_token
    if int8_bytes_per_token is not None and tokens > fp_tokens:
        rest = budget_bytes - fp_tokens * bytes_per_token
        tokens = fp_tokens + int(rest // int8_bytes_per_token)
    if tokens < 1:
        raise ConfigError(
            f"a budget of {budget_bytes} bytes holds no token ({bytes_per_token} bytes each)"
        )
    return tokens
