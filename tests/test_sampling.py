"""Sampling edge cases: greedy fallbacks, the nucleus, seeds, validation."""

from __future__ import annotations

import pytest
import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.reply_decoding import ReplyDecoder
from agent_kv.runtime.sampling import SamplingParams, penalized, sample_next

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
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias values"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token -1"),
        ({"logit_bias": {10: 1.0}}, "logit_bias token 10 is not in the model's vocabulary of 10"),
    ],
)
def test_invalid_parameters(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs).validate(vocab_size=10)


def test_penalties_and_bias_follow_openais_formula():
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j], c counting the reply's own
    tokens."""
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={0: -100.0})
    out = penalized(logits, params, generated=[3, 3, 2])
    assert torch.allclose(out, torch.tensor([-99.0, 2.0, 2.25, 2.75]))
    assert torch.equal(logits, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # the input is untouched
    assert penalized(logits, SamplingParams(frequency_penalty=1.0), []) is logits
    assert sample_next(penalized(logits, params, [3, 3, 3, 3]), params) == 2


class CharTokenizer:
    """Token i is the i-th character of `ALPHABET`."""

    ALPHABET = "<tool_call>{}ab\n"

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.ALPHABET[i] for i in ids)

    def encode(self, text):
        return [self.ALPHABET.index(c) for c in text]


def decode(text: str, params: SamplingParams) -> str:
    """Decode `text` greedily, one forced token at a time, as `ReplyDecoder` ends it."""
    tokenizer = CharTokenizer()
    decoder = ReplyDecoder(params, None, tokenizer, eos_ids=set())
    for token in tokenizer.encode(text):
        logits = torch.full((len(CharTokenizer.ALPHABET),), -1.0)
        logits[token] = 1.0
        if decoder.choose(logits) is None:
            break
        decoder.fed()
    return decoder.generation(prompt_tokens=1).text


def test_a_stop_string_cuts_free_text_and_never_a_call():
    text = decode("ab{a}b", SamplingParams(max_new_tokens=20, stop=["a}"], call_open="<tool_call>"))
    assert text == "ab{"
    call = "<tool_call>{a}b"
    assert (
        decode(call, SamplingParams(max_new_tokens=15, stop=["a}"], call_open="<tool_call>"))
        == call
    )
    assert decode(call, SamplingParams(max_new_tokens=15, stop=["a}"])) == "<tool_call>{"
