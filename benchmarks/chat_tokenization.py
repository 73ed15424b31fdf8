"""A long agent chat's turn prompt, tokenized whole against only from the generation prompt on
of the last prompt it extends (`agent_kv.runtime.chat.layout.placed_chat` with `previous`, what
the server does for a session's next turn, `agent_kv.serving.last_prompts`), side by side in
one run: the median of
`--repeats` alternating timings of each, with their ratio. The chat is a system message, then
`--turns` turns of a page observation and a one-line action, then the next observation.

    .venv/bin/python benchmarks/chat_tokenization.py --turns 12
"""

from __future__ import annotations

import argparse
import statistics
import time

from agent_kv.runtime.chat.layout import placed_chat, render_placed
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models.model_loading import load_tokenizer


def agent_chat(turns: int) -> list[dict]:
    """A system message, `turns` observation/action pairs, and one more observation."""
    page = " ".join(f"[{i}] link 'Item {i}' price ${i * 3}.99" for i in range(400))
    messages = [{"role": "system", "content": "You are a web agent."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}. {page}"})
        messages.append({"role": "assistant", "content": f"click [{turn}]"})
    messages.append({"role": "user", "content": f"Step {turns}. {page}"})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    messages = agent_chat(args.turns)
    for name in ("smollm2-135m", bundled_models.DEFAULT_MODEL):
        tokenizer = load_tokenizer(name)
        previous = render_placed(tokenizer, messages[:-2])  # the last turn's prompt
        text = render_chat(tokenizer, messages, (), generation_prompt=True)
        whole = placed_chat(tokenizer, messages, (), text)
        past = placed_chat(tokenizer, messages, (), text, previous)
        times = {"whole": [], "past previous": []}
        for _ in range(args.repeats):
            for label, given in (("whole", None), ("past previous", previous)):
                started = time.perf_counter()
                placed_chat(tokenizer, messages, (), text, given)
                times[label].append(time.perf_counter() - started)
        whole_ms, past_ms = (statistics.median(times[k]) * 1e3 for k in times)
        new_tokens = len(whole.token_ids) - len(previous.token_ids)
        print(
            f"{name}: {len(whole.token_ids)} tokens ({new_tokens}"
            f" past the last prompt; same tokens: {past.token_ids == whole.token_ids}): "
            f"whole {whole_ms:.1f} ms, from the last generation prompt {past_ms:.1f} ms, "
            f"ratio {whole_ms / past_ms:.1f}x"
        )


if __name__ == "__main__":
    main()
