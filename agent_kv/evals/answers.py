"""Scoring a retrieval answer against the number it should contain."""

from __future__ import annotations

import re


def is_right(answer: str, key: str) -> bool:
    """Whether the first run of digits in `answer` is `key`, exactly (for key 58213:
    " 58213. Remember" is right; " 582130", " 5821" and " 1. 58213" are not)."""
    digits = re.search(r"\d+", answer)
    return digits is not None and digits.group() == key
