"""What a tool call's grammar costs, next to the decode step it constrains, measured side by
side in one run with `--model` (smollm2-135m).

    .venv/bin/python benchmarks/tool_call_cost.py [--tools 2] [--repeats 5]

For `tool_choice` `required` and `auto` (`agent_kv.runtime.replies.tool_calls.ReplySpec`) over
`--tools` function tools with object schemas:
- `build`: compiling the reply's grammar against the tokenizer (once per turn);
- `token`: one decode step's constraint work (fill the allowed-token mask, apply it to the
  logits `[vocab]`, advance by the chosen token), median over the tokens of a call;
- `decode`: one unconstrained decode step of the model (full KV, a ~300-token prompt),
  median, interleaved with the constraint steps so both see the same machine load.
The ratio `token / decode` is the share the grammar adds to a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.tool_call_format import tool_call_format
from agent_kv.runtime.replies.tool_calls import ReplySpec, Tool, ToolCall, ToolChoice, render_calls


def tools(count: int) -> tuple[Tool, ...]:
    """`count` tools, each with a city string, a day count and an enum."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"enum": ["metric", "imperial"]},
        },
        "required": ["city", "days", "units"],
        "additionalProperties": False,
    }
    return tuple(Tool(f"tool_{i}", f"Tool number {i}.", schema) for i in range(count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    loaded = load_model(args.model)
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("full"))
    offered = tools(args.tools)
    call = ToolCall("call_0", "tool_0", '{"city": "Oslo", "days": 2, "units": "metric"}')
    calls = tool_call_format(loaded.tokenizer)
    tokens = loaded.tokenizer(render_calls([call], calls), add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "What is the weather in Oslo for two days?"}]
    prompt = render_chat(loaded.tokenizer, messages, offered, generation_prompt=True)
    sequence = engine.new_sequence()
    engine.prefill(sequence, loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    logits = torch.randn(engine.grammars.vocab_size)
    seen = sequence.store.seen_tokens
    print(f"{args.tools} tools, a call of {len(tokens)} tokens, prompt {seen} tokens")
    print("| tool_choice | build (ms) | token (ms) | decode step (ms) | token / decode |")
    print("| --- | --- | --- | --- | --- |")
    for mode in ("required", "auto"):
        spec = ReplySpec(offered, ToolChoice(mode))
        builds, steps, decodes = [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            matcher = engine.grammars.matcher(spec.grammar(calls))
            builds.append(time.perf_counter() - start)
            for token in tokens:
                start = time.perf_counter()
                matcher.constrain(logits)
                matcher.advance(token)
                steps.append(time.perf_counter() - start)
                start = time.perf_counter()
                engine.prefill(sequence, [token])
                decodes.append(time.perf_counter() - start)
        token_ms = statistics.median(steps) * 1e3
        decode_ms = statistics.median(decodes) * 1e3
        print(
            f"| {mode} | {statistics.median(builds) * 1e3:.2f} | {token_ms:.3f} | "
            f"{decode_ms:.1f} | {token_ms / decode_ms:.1%} |"
        )


if __name__ == "__main__":
    main()
