"""Sampling edge cases: greedy fallbacks, the nucleus, seeds, validation."""

from __future__ import annotations

import pytest
import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.sampling import SamplingParams, sample_next

LOGITS = torch.tensor([1.0, 3.0, 2.0, -1.0])


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token():
    assert sample_next(LOGITS, SamplingParams(temperature=1e-40)) == 1
    gen = torch.Generator().manual_seed(0)
    draws = {
        sample_next(LOGITS, SamplingParams(temperature=1.0, top_p=1e-30), gen) for _ in range(50)
    }
    assert draws == {1}


def test_top_p_limits_the_draw_to_the_nucleus():
    # probabilities ~ [0.09, 0.66, 0.24, 0.01]: p=0.8 keeps tokens 1 and 2 only
    gen = torch.Generator().manual_seed(0)
    draws = {
        sample_next(LOGITS, SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(300)
    }
    assert draws == {1, 2}
    wide = {sample_next(LOGITS, SamplingParams(temperature=1.0), gen) for _ in range(300)}
    assert wide == {0, 1, 2, 3}


def test_seeds_reproduce_and_differ():
    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sample_next(LOGITS, SamplingParams(temperature=2.0), gen) for _ in range(40)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": [""]}, "stop strings"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_parameters(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs).validate()
