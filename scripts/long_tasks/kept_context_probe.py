"""When a budgeted cache keeps the agent's note, why does the answer still miss it?

A scripted episode's trace (`recall.json`, written by `bench --mode scripted`) is rebuilt into
the token sequence the scripted runner fed (system turn and examples, each page as an
observation turn, each reply as the assistant's turn, the assistant header, `stop [` and the
task's answer prefix) and run on Hugging Face's own model (the default model's converted
directory, float32, `model_loading.transformers_directory`) in one of five ways, each ending
in a greedy answer:

- `subset`: only some tokens, encoded without the rest of the history, at their original
  positions (or renumbered from 0 with `--renumber`): the system turn and examples, the latest
  page and the question always, plus `--keep` parts (`note`: the reply that carries the note,
  its turn's template tokens included; `note-tokens`: the note's own tokens alone;
  `replies`: every reply; `fact-page`: the page the note was written on; `recent`: the 256
  tokens before the latest page);
- `incremental`: every token fed in the runner's order (pages in 512-token chunks, replies one
  token per call), and after each call a sliding window evicts down to the attention sinks
  (the first 4 positions), the pinned tokens (system turn and examples, the latest page, the
  notes) and the newest `--budget` other tokens: the window policy with `--pin-replies notes`;
- `posthoc`: every token fed with nothing evicted, then the same eviction once, just before
  the question;
- `full`: every token fed in the runner's order, nothing evicted: full KV on transformers'
  own path, the reference for the harness's full-KV answer;
- `reencode`: as `incremental`, then the tokens the window kept are encoded again, alone, at
  their original positions, in a fresh cache before the question (what a policy that
  re-encodes its kept tokens would read).

    .venv/bin/python -m scripts.long_tasks.kept_context_probe TRACE --mode subset --keep note

It prints one JSON line: the mode, what was kept, the tokens live at the question, the
answer decoded and the seconds taken.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from agent_kv.harness.action_formats import TEXT_ACTIONS
from agent_kv.harness.agent import OBSERVATION_TEMPLATE
from agent_kv.harness.scripted_episode import DEFAULT_FORMAT, NOTE, STOP_PREFIX
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.models.model_loading import transformers_directory
from envs.tasks import load_task
from scripts.long_tasks.build import default_tokenizer

SINKS = 4
"""Attention sinks the window keeps (the first positions)."""
CHUNK = 512
"""Prefill chunk of the pages (tokens), as the sweep's `--prefill-chunk`."""
RECENT = 256
"""Tokens before the latest page that `--keep recent` keeps."""
ANSWER_TOKENS = 16


@dataclass
class Part:
    """One message's tokens (or the question's) in the rebuilt sequence."""

    kind: str  # "system", "page", "reply" or "question"
    start: int
    ids: list[int]
    note: range = range(0)  # a reply's positions that carry its note (after the turn's header)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + len(self.ids))


def rebuild(trace: dict, tokenizer, answer_prefix: str) -> list[Part]:
    """The scripted runner's token sequence for `trace`, message by message (each message's
    tokens are the new text of the chat template's rendering)."""
    intent = trace["intent"]
    messages = [{"role": "system", "content": TEXT_ACTIONS.system_prompt.format(intent=intent)}]
    kinds = ["system"]
    for example, action in DEFAULT_FORMAT.few_shot:
        messages += [{"role": "user", "content": example}, {"role": "assistant", "content": action}]
        kinds += ["system", "system"]
    for page in trace["pages"]:
        text = OBSERVATION_TEMPLATE.format(observation=page["observation"], intent=intent)
        messages.append({"role": "user", "content": text})
        kinds.append("page")
        if "action" in page:
            messages.append({"role": "assistant", "content": page["action"]})
            kinds.append("reply")
    parts, rendered, start = [], "", 0

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def add(kind: str, text: str, note: range = range(0)) -> None:
        nonlocal start
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        parts.append(Part(kind, start, ids, note))
        start += len(ids)

    for i, kind in enumerate(kinds):
        text = render_chat(tokenizer, messages[: i + 1], (), False)
        delta, content = text[len(rendered) :], messages[i]["content"]
        note = NOTE.match(content) if kind == "reply" else None
        span = range(0)
        if note:
            first = start + count(delta[: delta.index(content)])  # after the turn's header
            span = range(first, first + count(note[0].rstrip()))
        add(kind, delta, span)
        rendered = text
    question = render_chat(tokenizer, messages, (), True)[len(rendered) :]
    add("question", question + STOP_PREFIX + answer_prefix)
    return parts


class Probe:
    """Hugging Face's model over a rebuilt sequence, with an explicit position per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model = AutoModelForCausalLM.from_pretrained(
            transformers_directory(), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.cache = DynamicCache()
        self.live = torch.zeros(0, dtype=torch.long)  # original positions of the cached tokens
        self.logits: torch.Tensor | None = None

    @torch.no_grad()
    def feed(self, ids: list[int], positions: list[int]) -> None:
        out = self.model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.logits = out.logits[0, -1]
        self.live = torch.cat([self.live, torch.tensor(positions)])

    def evict(self, pinned: set[int], budget: int) -> None:
        """Keep the sinks, the pinned positions and the newest `budget` others."""
        keep = torch.tensor([p < SINKS or p in pinned for p in self.live.tolist()])
        others = (~keep).nonzero().squeeze(1)
        keep[others[len(others) - budget :] if budget else others[:0]] = True
        if keep.all():
            return
        index = keep.nonzero().squeeze(1)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
        self.live = self.live[index]

    def answer(self, next_position: int) -> str:
        generated: list[int] = []
        for _ in range(ANSWER_TOKENS):
            generated.append(int(self.logits.argmax()))
            if "]" in self.tokenizer.decode(generated):
                break
            self.feed(generated[-1:], [next_position])
            next_position += 1
        return self.tokenizer.decode(generated)


def subset(probe: Probe, parts: list[Part], keep: set[str], renumber: bool) -> int:
    """Feed only the kept parts (`--mode subset`); returns the next position."""
    latest = max(i for i, part in enumerate(parts) if part.kind == "page")
    noted = [i for i, part in enumerate(parts) if part.note]
    positions: set[int] = set()
    for i, part in enumerate(parts):
        always = part.kind in ("system", "question") or i == latest
        note = "note" in keep and i in noted
        if "note-tokens" in keep and i in noted:
            positions.update(part.note)
        fact_page = "fact-page" in keep and noted and i == noted[0] - 1
        if always or note or fact_page or ("replies" in keep and part.kind == "reply"):
            positions.update(part.positions)
    if "recent" in keep:
        positions.update(range(parts[latest].start - RECENT, parts[latest].start))
    kept = sorted(positions)
    ids = [token for part in parts for token in part.ids]
    fed = list(range(len(kept))) if renumber else kept
    probe.feed([ids[p] for p in kept], fed)
    return fed[-1] + 1


def evicting(
    probe: Probe, parts: list[Part], budget: int | None, once: bool, reencode: bool = False
) -> int:
    """Feed every token in the runner's order, evicting after each call (`incremental`) or
    once before the question (`posthoc`), or never (`budget` None: `full`), and with
    `reencode` encode the kept tokens again in a fresh cache; returns the next position."""
    pinned: set[int] = set()
    latest: range | None = None
    for part in parts:
        if part.kind == "question":
            if budget is not None:
                probe.evict(pinned, budget)
            if reencode:
                kept = probe.live.tolist()
                ids = [token for part in parts for token in part.ids]
                probe.cache, probe.live = DynamicCache(), torch.zeros(0, dtype=torch.long)
                probe.feed([ids[p] for p in kept], kept)
            probe.feed(part.ids, list(part.positions))
            return part.positions.stop
        if part.kind == "system":
            pinned.update(part.positions)
        if part.kind == "page":
            if latest is not None:
                pinned.difference_update(latest)
            latest = part.positions
            pinned.update(latest)
        pinned.update(part.note)
        step = CHUNK if part.kind != "reply" else 1
        for offset in range(0, len(part.ids), step):
            piece = part.ids[offset : offset + step]
            probe.feed(piece, list(range(part.start + offset, part.start + offset + len(piece))))
            if budget is not None and not once:
                probe.evict(pinned, budget)
    raise ValueError("the rebuilt sequence has no question")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a scripted episode's recall.json")
    parser.add_argument(
        "--mode", choices=("subset", "incremental", "posthoc", "reencode", "full"), required=True
    )
    parser.add_argument(
        "--keep", default="", help="subset: note,note-tokens,replies,fact-page,recent"
    )
    parser.add_argument("--renumber", action="store_true", help="subset: positions from 0")
    parser.add_argument("--budget", type=int, default=256, help="the window's unpinned tokens")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trace = json.loads(args.trace.read_text())
    task = load_task(trace["record"]["task_id"])
    tokenizer = default_tokenizer()
    parts = rebuild(trace, tokenizer, task.answer_prefix)
    probe = Probe(tokenizer)
    started = time.perf_counter()
    if args.mode == "subset":
        keep = {name for name in args.keep.split(",") if name}
        following = subset(probe, parts, keep, args.renumber)
    else:
        once, reencode = args.mode == "posthoc", args.mode == "reencode"
        budget = None if args.mode == "full" else args.budget
        following = evicting(probe, parts, budget, once, reencode)
    answer = task.answer_prefix + probe.answer(following)
    print(
        json.dumps(
            {
                "task": task.task_id,
                "mode": args.mode,
                "keep": {"subset": args.keep, "full": "everything"}.get(
                    args.mode, f"window {args.budget} + notes"
                ),
                "renumber": args.renumber,
                "live_tokens": int(probe.live.numel()),
                "history_tokens": parts[-1].positions.stop,
                "answer": answer,
                "seconds": round(time.perf_counter() - started),
            }
        )
    )


if __name__ == "__main__":
    main()
