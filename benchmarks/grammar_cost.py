"""What grammar-constrained decoding costs per token, for the three maintained libraries,
with `--model`'s tokenizer (smollm2-135m), on the action grammar of one observation.

    .venv/bin/pip install -e ".[grammar-bench]"   # xgrammar and outlines-core
    .venv/bin/python benchmarks/grammar_cost.py [--ids 120] [--repeats 5]

For each library (llguidance, xgrammar, outlines-core), measured side by side, interleaved:
- `setup`: adapting the tokenizer (once per process);
- `build`: compiling one observation's action grammar (once per agent step: ids change);
- `token`: one decode step's constraint work — fill the allowed-token mask, apply it to the
  logits `[vocab]`, advance the matcher by the chosen token — median over the tokens of a few
  actions, EOS included.
The libraries are optional here (they are not all dependencies): a missing one is skipped.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.grammar import Grammar, GrammarCompiler
from envs.action_grammar import TEXT_CHARS, URL_CHARS, action_grammar

ACTIONS = ["click [{a}]", "type [{b}] [blue road bike] [1]", "stop [$18.95]", "scroll [down]"]


def ebnf_grammar(ids: list[int]) -> str:
    """`envs.action_grammar`'s grammar (one tab) in xgrammar's EBNF, keys left out."""
    id_alt = " | ".join(f'"{i}"' for i in ids)
    return f"""
root ::= "click [" eid "]" | "hover [" eid "]" | "type [" eid "] [" text "] [" ("0" | "1") "]"
    | "scroll [" ("up" | "down") "]" | "go_back" | "go_forward" | "new_tab" | "close_tab"
    | "tab_focus [0]" | "goto [" url "]" | "stop [" text "]"
eid ::= {id_alt}
text ::= [^\\]\\n]{{0,{TEXT_CHARS}}}
url ::= [^\\]\\n ]{{1,{URL_CHARS}}}
"""


def regex_grammar(ids: list[int]) -> str:
    """The same grammar as one regular expression (outlines-core), with unbounded free text:
    bounded repetitions (`{0,64}`) exceed outlines-core's DFA state limit after minutes."""
    eid = "(" + "|".join(str(i) for i in ids) + ")"
    text = r"[^\]\n]*"
    url = r"[^\]\n ]+"
    return (
        rf"(click \[{eid}\]|hover \[{eid}\]|type \[{eid}\] \[{text}\] \[[01]\]"
        rf"|scroll \[(up|down)\]|go_back|go_forward|new_tab|close_tab|tab_focus \[0\]"
        rf"|goto \[{url}\]|stop \[{text}\])"
    )


class Llguidance:
    """The shipped path: `agent_kv.runtime.replies.grammar` on `envs.action_grammar`'s grammar."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, eos_id):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_id)

    def build(self, ids):
        return self.compiler.matcher(Grammar("lark", action_grammar(ids, tabs=1).lark))

    def step(self, matcher, logits, token):
        logits.copy_(matcher.constrain(logits[0]))
        if token != self.compiler.eos_id:
            matcher.advance(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def build(self, ids):
        return self.xgr.GrammarMatcher(self.compiler.compile_grammar(ebnf_grammar(ids)))

    def step(self, matcher, logits, token):
        matcher.fill_next_token_bitmask(self.mask)
        self.xgr.apply_token_bitmask_inplace(logits, self.mask)
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, eos_id):
        import outlines_core
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc = outlines_core
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        table: dict[bytes, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id == eos_id:
                continue
            if token in tokenizer.all_special_tokens:
                continue
            table.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos_id, table)
        self.eos_id = eos_id

    def build(self, ids):
        return self.oc.Guide(self.oc.Index(regex_grammar(ids), self.vocabulary))

    def step(self, guide, logits, token):
        allowed = torch.tensor(guide.get_tokens())
        masked = torch.full_like(logits, float("-inf"))
        masked[0, allowed] = logits[0, allowed]
        logits.copy_(masked)
        if token == self.eos_id:  # the final state allows only EOS; advancing past it fails
            assert guide.is_finished()
        else:
            guide.advance(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=120, help="element ids on the page")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    vocab = loaded.model.config.vocab_size
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = sorted(random.Random(0).sample(range(1, 2000), args.ids))
    actions = [a.format(a=ids[3], b=ids[7]) for a in ACTIONS]
    sequences = [tokenizer(a, add_special_tokens=False)["input_ids"] + [eos] for a in actions]
    libraries = []
    for make in (
        lambda: Llguidance(tokenizer, vocab, eos),
        lambda: Xgrammar(tokenizer, vocab),
        lambda: OutlinesCore(tokenizer, eos),
    ):
        started = time.perf_counter()
        try:
            library = make()
        except ImportError as err:
            print(f"skipped: {err}")
            continue
        libraries.append((library, time.perf_counter() - started))
    builds = {lib.name: [] for lib, _ in libraries}
    tokens = {lib.name: [] for lib, _ in libraries}
    for _ in range(args.repeats):
        for library, _ in libraries:
            for sequence in sequences:
                started = time.perf_counter()
                matcher = library.build(ids)
                builds[library.name].append(time.perf_counter() - started)
                for token in sequence:
                    logits = torch.randn(1, vocab)
                    started = time.perf_counter()
                    library.step(matcher, logits, token)
                    tokens[library.name].append(time.perf_counter() - started)
                    assert torch.isfinite(logits[0, token])
    print(f"vocab {vocab}, {args.ids} element ids, {sum(map(len, sequences))} tokens per round")
    print(f"{'library':15} {'setup s':>8} {'build ms':>9} {'token ms':>9} {'token p90':>9}")
    for library, setup in libraries:
        per_token = sorted(tokens[library.name])
        p90 = per_token[int(0.9 * (len(per_token) - 1))]
        print(
            f"{library.name:15} {setup:8.2f} {statistics.median(builds[library.name]) * 1e3:9.2f}"
            f" {statistics.median(per_token) * 1e3:9.3f} {p90 * 1e3:9.3f}"
        )


if __name__ == "__main__":
    main()
