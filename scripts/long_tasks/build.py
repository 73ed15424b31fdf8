"""Build the long-horizon suite (`tasks/long/`): replay every task of the family modules in the
real browser, measure its scripted history with the default model's tokenizer, check it, and
write one JSON file per task.

    .venv/bin/python -m scripts.long_tasks.build            # every family
    .venv/bin/python -m scripts.long_tasks.build --only 501,502 --dry-run

What is measured is the history the scripted runner (`agent_kv.harness.scripted_episode`, the notes
format) builds: the pinned system prompt and example episodes, each page truncated to 1,200
tokens in the observation template, each reference action with its note as the assistant's
turn, rendered with the model's chat template and tokenized as one text. A fact's `tokens` is
the distance from its first token on its page to its use (the answer point, after the last
page and the assistant header, for the answer; the start of the action's turn otherwise).

A task is written only when its replay succeeds (score 1.0, and 0.0 for a wrong answer), each
fact is on its page as the agent sees it, and it is long enough: 15-60 actions and 12K-32K
tokens. A carry task (`distractors` set) must also carry its fact: no page after the fact's
shows the fact again, and its pages up to the answer show another fact of the same kind
(`kinds.shown`) when, and only when, `distractors` says so (the goal shows none either).
Every check that fails is printed with the task and the step; the script then exits
with status 1 and writes nothing for that task.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import json
import statistics
import sys
from typing import Any

from agent_kv.harness.action_formats import TEXT_ACTIONS
from agent_kv.harness.agent import OBSERVATION_TEMPLATE, AgentConfig, truncate_tokens
from agent_kv.harness.scripted_episode import DEFAULT_FORMAT
from agent_kv.runtime.chat.rendering import render_chat
from envs.browser_env import ActionError, BrowserEnv
from envs.evaluators import evaluate
from envs.server import SiteServers
from envs.tasks import TASKS_DIR, Task
from scripts.long_tasks.carry import SHOWN_AGAIN
from scripts.long_tasks.kinds import shown as kind_shown

FAMILIES = ("classifieds", "forum", "shopping", "cross", "carry", "carry_more")
"""The modules of this package whose `tasks()` return the suite's task objects."""
SUITE_DIR = TASKS_DIR / "long"
STEPS = (15, 60)
TOKENS = (12_000, 32_000)
WRONG_ANSWER = "N/A"


class BuildError(Exception):
    """A task that does not replay, or is not long enough; the message names task and step."""


def default_tokenizer():
    """The default bundled model's tokenizer, without its weights."""
    from agent_kv.runtime.models.model_loading import load_tokenizer

    return load_tokenizer()


def family_tasks(names: tuple[str, ...] = FAMILIES) -> list[dict[str, Any]]:
    """The task objects of the family modules `names`, in id order."""
    tasks = []
    for name in names:
        tasks.extend(importlib.import_module(f"scripts.long_tasks.{name}").tasks())
    return sorted(tasks, key=lambda task: task["task_id"])


def replay(env: BrowserEnv, task: Task, tokenizer) -> tuple[list[dict], list[int], list[str]]:
    """Replay `task` as the scripted runner would and return its chat messages (system,
    examples, then each page and its action), the message index of each page and each page's
    text as the agent sees it (truncated).

    Raises:
        BuildError: an action fails, the episode ends early, or the answer does not score 1.0
            (or a wrong one scores above 0).
    """
    fmt, config = DEFAULT_FORMAT, AgentConfig(max_obs_tokens=DEFAULT_FORMAT.max_obs_tokens)
    messages = [
        {"role": "system", "content": TEXT_ACTIONS.system_prompt.format(intent=task.intent)}
    ]
    for example, action in fmt.few_shot:
        messages += [{"role": "user", "content": example}, {"role": "assistant", "content": action}]
    observation, pages, texts = env.reset(task), [], []
    for number, action in enumerate(task.reference_actions, start=1):
        shown = truncate_tokens(
            tokenizer, fmt.page_text(observation["text"]), config.max_obs_tokens
        )
        pages.append(len(messages))
        texts.append(shown)
        content = OBSERVATION_TEMPLATE.format(observation=shown, intent=task.intent)
        messages.append({"role": "user", "content": content})
        try:
            concrete = env.concrete_action(action)
        except ActionError as error:
            raise BuildError(f"task {task.task_id} step {number} {action!r}: {error}") from None
        result = env.step(concrete)
        if number < len(task.reference_actions):
            messages.append({"role": "assistant", "content": fmt.reply(action, concrete)})
            if result.observation["error"] is not None or result.done:
                why = result.observation["error"] or result.info.get("reason")
                raise BuildError(f"task {task.task_id} step {number} {action!r}: {why}")
            observation = result.observation
    verdict = evaluate(task, result.answer, env.url, env.servers, env.read_page)
    if verdict.score != 1.0:
        raise BuildError(f"task {task.task_id}: the reference answer scores {verdict.details}")
    if evaluate(task, WRONG_ANSWER, env.url, env.servers, env.read_page).score != 0.0:
        raise BuildError(f"task {task.task_id}: the answer {WRONG_ANSWER!r} scores above 0")
    return messages, pages, texts


def check_carried(task: Task, texts: list[str]) -> None:
    """For a carry task (`distractors` set): the pages after its fact's, up to the answer
    (`texts`: each page as the agent sees it), never show the fact again (but on the page
    `carry.SHOWN_AGAIN` allows), and show a fact of its kind when, and only when,
    `distractors` is true; the goal shows none.

    Raises:
        BuildError: the first page that breaks this, or `distractors` true and no page shows
            such a fact.
    """
    if task.distractors is None:
        return
    (fact,) = task.facts
    if kind_shown(fact.kind, task.intent):
        raise BuildError(f"task {task.task_id}: the goal shows a {fact.kind}")
    seen = []
    for number in range(fact.page + 1, fact.used_on + 1):
        text = texts[number - 1]
        if fact.text in text and SHOWN_AGAIN.get(task.task_id) != number:
            raise BuildError(f"task {task.task_id}: fact {fact.text!r} again on page {number}")
        found = kind_shown(fact.kind, text)
        if found and not task.distractors:
            raise BuildError(f"task {task.task_id}: page {number} shows the {fact.kind} {found}")
        seen += found
    if task.distractors and not seen:
        raise BuildError(f"task {task.task_id}: no page after the fact shows a {fact.kind}")


def measure(task: Task, messages: list[dict], pages: list[int], tokenizer) -> dict[str, Any]:
    """`history_tokens` and each fact's `tokens` (module docstring).

    Raises:
        BuildError: a fact is not on its page as the agent sees it.
    """
    text = render_chat(tokenizer, messages, generation_prompt=True)
    offsets = [start for start, _ in tokenizer(text, return_offsets_mapping=True)["offset_mapping"]]

    def token_at(char: int) -> int:
        return bisect.bisect_right(offsets, char) - 1

    def message_start(index: int) -> int:
        return len(render_chat(tokenizer, messages[:index])) if index else 0

    facts = []
    for fact in task.facts:
        start, end = message_start(pages[fact.page - 1]), message_start(pages[fact.page - 1] + 1)
        found = text.find(fact.text, start, end)
        if found < 0:
            raise BuildError(f"task {task.task_id}: fact {fact.text!r} is not on page {fact.page}")
        last = fact.used_on == len(task.reference_actions)
        use = len(offsets) if last else token_at(message_start(pages[fact.used_on - 1] + 1))
        facts.append({**fact.model_dump(exclude_none=True), "tokens": use - token_at(found)})
    return {"history_tokens": len(offsets), "facts": facts}


def check_length(task: Task, history_tokens: int) -> None:
    """Raises BuildError when `task` is shorter or longer than the suite's bounds."""
    steps = len(task.reference_actions)
    if not STEPS[0] <= steps <= STEPS[1]:
        raise BuildError(f"task {task.task_id}: {steps} actions, outside {STEPS}")
    if not TOKENS[0] <= history_tokens <= TOKENS[1]:
        raise BuildError(f"task {task.task_id}: {history_tokens} tokens, outside {TOKENS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated task ids (default: all)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dry-run", action="store_true", help="check and print, write nothing")
    args = parser.parse_args()
    objects = family_tasks(tuple(args.families.split(",")))
    if args.only:
        wanted = {int(part) for part in args.only.split(",")}
        objects = [task for task in objects if task["task_id"] in wanted]
    tokenizer, failed, written = default_tokenizer(), 0, []
    sites = sorted({site for task in objects for site in task["sites"]})
    SUITE_DIR.mkdir(exist_ok=True)
    with SiteServers(sites) as servers, BrowserEnv(servers, screenshots=False) as env:
        for raw in objects:
            task = Task.model_validate(raw)
            try:
                messages, pages, texts = replay(env, task, tokenizer)
                check_carried(task, texts)
                measured = measure(task, messages, pages, tokenizer)
                check_length(task, measured["history_tokens"])
            except BuildError as error:
                failed += 1
                print(f"FAILED {error}", flush=True)
                continue
            written.append(measured["history_tokens"])
            distances = [
                (fact["used_on"] - fact["page"], fact["tokens"]) for fact in measured["facts"]
            ]
            print(
                f"task {task.task_id}: {len(task.reference_actions)} actions, "
                f"{measured['history_tokens']} tokens, facts (steps, tokens) {distances}",
                flush=True,
            )
            if not args.dry_run:
                path = SUITE_DIR / f"{task.task_id}.json"
                path.write_text(json.dumps({**raw, **measured}, indent=2) + "\n", encoding="utf-8")
    if written:
        print(f"{len(written)} tasks, median {statistics.median(written):.0f} tokens")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
