"""Sampling edge cases: greedy fallbacks, the nucleus, seeds, validation."""

from __future__ import annotations

import pytest
import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.replies.decoding import ReplyDecoder
from agent_kv.runtime.replies.sampling import SamplingParams, penalized, sample_next

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


def test_top_k_of_one_is_greedy_and_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([0.5, 3.0, 2.9, 2.8, -1.0])
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=2.0, top_k=1)
    assert {sample_next(logits, one, gen) for _ in range(100)} == {1}
    two = {sample_next(logits, SamplingParams(temperature=2.0, top_k=2), gen) for _ in range(300)}
    assert two == {1, 2}
    for off in (0, -1):  # vLLM's and llama.cpp's "every token"
        draws = {
            sample_next(logits, SamplingParams(temperature=2.0, top_k=off), gen) for _ in range(300)
        }
        assert draws == {0, 1, 2, 3, 4}


def test_min_p_masks_exactly_the_tokens_below_min_p_times_the_top_probability():
    # probabilities [0.1, 0.4, 0.3, 0.2]: min_p 0.45 keeps p >= 0.18 (tokens 1, 2, 3)
    logits = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, min_p=0.45)
    draws = [sample_next(logits, params, gen) for _ in range(2000)]
    assert set(draws) == {1, 2, 3}
    # the kept tokens keep their relative odds: 0.4 : 0.3 : 0.2 of 0.9
    for token, share in ((1, 4 / 9), (2, 3 / 9), (3, 2 / 9)):
        assert abs(draws.count(token) / len(draws) - share) < 0.04
    for min_p, kept in ((0.55, {1, 2}), (0.8, {1}), (1.0, {1})):  # 0.22, 0.32, 0.4
        params = SamplingParams(temperature=1.0, min_p=min_p)
        assert {sample_next(logits, params, gen) for _ in range(300)} == kept


def test_top_p_reads_the_distribution_top_k_left_and_min_p_comes_last():
    # [0.4, 0.3, 0.2, 0.1]; top_k 3 renormalizes to [4/9, 3/9, 2/9]: top_p 0.7 keeps 2 tokens
    # (mass before the third, 7/9, reaches 0.7), where without top_k it keeps 3 (0.7 < 0.9)
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    gen = torch.Generator().manual_seed(0)

    def draws(**kwargs):
        params = SamplingParams(temperature=1.0, **kwargs)
        return {sample_next(logits, params, gen) for _ in range(500)}

    assert draws(top_p=0.75) == {0, 1, 2}
    assert draws(top_k=3, top_p=0.75) == {0, 1}
    assert draws(top_p=0.75, min_p=0.6) == {0, 1}  # 0.2 < 0.6 * 0.4


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once():
    """CTRL's rule as vLLM applies it: a token of the prompt or the reply, counted once."""
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0)
    out = penalized(logits, params, generated=[2, 2], prompt=[0, 1, 0])
    assert torch.equal(out, torch.tensor([1.0, -2.0, 1.5, -2.0, 1.0]))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 3.0, -2.0, 1.0]))
    assert penalized(logits, SamplingParams(), [1], [0]) is logits  # 1 changes nothing
    # below 1 it favours repeats; it applies before OpenAI's penalties and after the bias
    both = SamplingParams(repetition_penalty=0.5, frequency_penalty=1.0, logit_bias={4: 1.0})
    out = penalized(logits, both, generated=[4], prompt=[])
    assert torch.equal(out, torch.tensor([2.0, -1.0, 3.0, -2.0, 3.0]))  # (1 + 1) / 0.5 - 1


def test_extreme_repetition_penalties_leave_no_nan_even_when_one_token_survives():
    logits = torch.tensor([5.0, -5.0, 1.0, 0.0])
    # 1e-38 sends 5 and 1 past float32's range (clamped), 1e38 sends -5 there and the rest
    # to about 0, so tokens 0, 2 and 3 tie
    for penalty, top in ((1e-38, {0}), (1e38, {0, 2, 3})):
        out = penalized(logits, SamplingParams(repetition_penalty=penalty), [], [0, 1, 2, 3])
        assert out.isfinite().all()
        masked = out.clone()
        masked[1:] = float("-inf")  # a grammar allowing one token
        params = SamplingParams(temperature=0.7, top_k=3, top_p=0.5, min_p=0.9)
        gen = torch.Generator().manual_seed(1)
        assert {sample_next(masked, params, gen) for _ in range(20)} == {0}
        params = SamplingParams(temperature=1e-3, min_p=1.0)
        assert {sample_next(out, params, gen) for _ in range(50)} == top


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_invalid_filter_parameters(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs).validate()


def test_the_decoder_counts_the_prompt_for_the_repetition_penalty():
    tokenizer = CharTokenizer()  # "a" is token 12, "b" token 13
    logits = torch.full((len(CharTokenizer.ALPHABET),), -5.0)
    logits[12], logits[13] = 2.0, 1.5
    params = SamplingParams(max_new_tokens=1, repetition_penalty=2.0)
    seen_a = ReplyDecoder(params, None, tokenizer, eos_ids=set(), prompt_ids=[12, 0, 12])
    assert seen_a.choose(logits) == 13  # 2.0 / 2 < 1.5
    fresh = ReplyDecoder(params, None, tokenizer, eos_ids=set())
    assert fresh.choose(logits) == 12
