"""Does the default model recall a noted fact across pages that show facts of the same kind?

The probe behind the carry family (`carry.py`): on Hugging Face's own full-KV path (the
model's converted directory, float32, sdpa, chunked prefill into a `DynamicCache`), it
answers from the scripted history of task 506 (a listing's seller noted on page 3) after `k`
later pages that are either

- "same": the next pages of 506 itself, classifieds listings, each with its own seller; or
- "other": pages of task 512, forum posts, which show no seller,

each page with its reference action as the assistant's turn, as the scripted runner builds
them, then one last user turn asking for the answer, and `stop [` forced. It prints one JSON
line per run: kind, k, history tokens, the answer decoded, and whether it names the seller.

    .venv/bin/python -m scripts.long_tasks.distractor_probe --k 6,12
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from envs.browser_env import BrowserEnv
from envs.server import SiteServers
from envs.tasks import load_task
from scripts.long_tasks.build import default_tokenizer, replay

FACT_TASK, OTHER_TASK = 506, 512
FACT_PAGE = 3
"""Task 506 notes the seller on page 3 (its third action carries the note)."""
ASK = "Goal: {intent}\nAll pages are done. Answer now from your notes."


def history(
    fact: tuple[list[dict], list[int]],
    other: tuple[list[dict], list[int]],
    kind: str,
    k: int,
    intents: tuple[str, str],
) -> list[dict]:
    """The chat: 506's system turn, examples and pages up to the note, then `k` pages of
    `kind` with their actions (the other task's goal lines replaced by 506's), then the
    question. `fact` and `other` are `replay`'s (messages, page indices); `intents` 506's
    and 512's goals."""
    (messages, pages), (other_messages, other_pages) = fact, other
    end = pages[FACT_PAGE - 1] + 2  # the fact's page and the action with its note
    if kind == "same":
        later = messages[end : pages[FACT_PAGE - 1 + k] + 2]
    else:
        later = [
            {**turn, "content": turn["content"].replace(intents[1], intents[0])}
            for turn in other_messages[other_pages[0] : other_pages[k - 1] + 2]
        ]
    return [*messages[:end], *later, {"role": "user", "content": ASK.format(intent=intents[0])}]


def answer(model, tokenizer, messages: list[dict], chunk: int = 1024) -> tuple[int, str]:
    """Prefill the chat and `stop [` in chunks of `chunk` tokens, decode greedily up to `]`
    (at most 16 tokens); returns the history's tokens and the answer."""
    from transformers import DynamicCache

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text + "stop [", add_special_tokens=False, return_tensors="pt").input_ids
    cache, decoded = DynamicCache(), []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            logits = model(ids[:, start : start + chunk], past_key_values=cache).logits
        for _ in range(16):
            token = logits[0, -1].argmax()
            decoded.append(int(token))
            if "]" in tokenizer.decode(decoded):
                break
            logits = model(token.view(1, 1), past_key_values=cache).logits
    return ids.shape[1], tokenizer.decode(decoded).split("]")[0]


def main() -> None:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", default="6,12", help="comma-separated page counts")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = default_tokenizer()
    fact_task, other_task = load_task(FACT_TASK), load_task(OTHER_TASK)
    with SiteServers(sorted({*fact_task.sites, *other_task.sites})) as servers:
        with BrowserEnv(servers, screenshots=False) as env:
            fact = replay(env, fact_task, tokenizer)[:2]
            other = replay(env, other_task, tokenizer)[:2]
    model = AutoModelForCausalLM.from_pretrained(
        tokenizer.name_or_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    (seller,) = fact_task.eval.reference_answers.must_include
    for k in (int(part) for part in args.k.split(",")):
        for kind in ("same", "other"):
            intents = (fact_task.intent, other_task.intent)
            messages = history(fact, other, kind, k, intents)
            started = time.perf_counter()
            tokens, said = answer(model, tokenizer, messages)
            print(json.dumps({
                "kind": kind, "k": k, "history_tokens": tokens, "answer": said,
                "recalled": seller in said, "s": round(time.perf_counter() - started),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
