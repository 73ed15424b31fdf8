"""Writing a long-horizon task: its trajectory page by page, with the facts it reads.

A family module (`classifieds.py`, `forum.py`, `shopping.py`, `cross.py`) computes each
task's answer from the sites' seeded data and writes the trajectory with a `Script`:

    script = Script()
    script.act(f"click {element('link', 'Bikes')}")
    price = script.fact("$120")  # shown on the current page
    script.act("click [link 'Electronics']", note=f"Blue road bike: {price}")
    script.stop(f"Blue road bike: {price}")
    task = long_task(301, ["classifieds"], "__CLASSIFIEDS__/", intent, script, ...)

Pages are numbered as in `envs.tasks.Fact`: page 1 is the start page, page n + 1 follows
action n; a fact is used on the page of the stop action unless `Script.use` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def element(role: str, name: str) -> str:
    """The reference `[role 'name']` of an element (tasks/README.md), quoted as Python's
    `repr` quotes: double quotes when the name holds a `'`."""
    return f"[{role} {name!r}]"


@dataclass
class Script:
    """A reference trajectory being written, with the facts it reads.

    Attributes:
        actions: the reference actions so far (the agent's note before the action, if any).
        facts: `envs.tasks.Fact` fields of each fact read (`used_on` None until used).
    """

    actions: list[str] = field(default_factory=list)
    facts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def page(self) -> int:
        """The page the next action is taken on (1 before any action)."""
        return len(self.actions) + 1

    def act(self, action: str, note: str | None = None) -> None:
        """Append `action`, after the agent's `note [...]` when given (the note convention of
        the recall suite: the agent writes down what it found where it found it)."""
        if note is not None and ("[" in note or "]" in note):
            raise ValueError(f"a note cannot hold brackets: {note!r}")
        self.actions.append(f"note [{note}] {action}" if note else action)

    def fact(self, text: str) -> str:
        """Record that the current page shows `text`, a fact the task needs; returns it."""
        self.facts.append({"text": text, "page": self.page, "used_on": None})
        return text

    def use(self, text: str) -> None:
        """The action taken next, on the current page, uses the fact `text` (read earlier)."""
        for fact in self.facts:
            if fact["text"] == text and fact["used_on"] is None:
                fact["used_on"] = self.page
                return
        raise ValueError(f"no unused fact {text!r} was read")

    def stop(self, answer: str) -> None:
        """End with `stop [answer]`; every fact not used earlier is used by the answer."""
        self.act(f"stop [{answer}]")
        for fact in self.facts:
            if fact["used_on"] is None:
                fact["used_on"] = len(self.actions)


def long_task(
    task_id: int,
    sites: list[str],
    start_url: str,
    intent: str,
    script: Script,
    reference_answers: dict[str, list[str]],
    comments: str,
    program_html: list[dict[str, Any]] | None = None,
    require_login: bool = False,
) -> dict[str, Any]:
    """A task object in the bundled format (tasks/README.md) for the trajectory `script`.

    `horizon` is the most pages between a fact and its use; a task that writes to a site
    (`program_html` given) resets it (`require_reset`).
    """
    checks = program_html or []
    eval_types = ["string_match", *(["program_html"] if checks else [])]
    return {
        "task_id": task_id,
        "sites": sites,
        "require_login": require_login,
        "require_reset": bool(checks),
        "start_url": start_url,
        "intent": intent,
        "eval": {
            "eval_types": eval_types,
            "reference_answers": reference_answers,
            "program_html": checks,
        },
        "reasoning_difficulty": "hard",
        "visual_difficulty": "easy",
        "overall_difficulty": "hard",
        "comments": comments,
        "horizon": max(fact["used_on"] - fact["page"] for fact in script.facts),
        "reference_actions": script.actions,
        "facts": script.facts,
    }
