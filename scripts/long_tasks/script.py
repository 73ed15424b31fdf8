"""Writing a long-horizon task: its trajectory page by page, with the facts it reads.

A family module (`classifieds.py`, `forum.py`, `shopping.py`, `cross.py`) computes each
task's answer from the sites' seeded data and writes the trajectory with a `Script`:

    script = Script()
    script.act(f"click {element('link', 'Bikes')}")
    price = script.fact("$120")  # shown on the current page
    script.act("click [link 'Electronics']", note=f"Blue road bike: {price}")
    script.stop(f"Blue road bike: {price}")
    task = long_task(301, Start(["classifieds"], "__CLASSIFIEDS__/"), intent, script, ...)

Pages are numbered as in `envs.tasks.Fact`: page 1 is the start page, page n + 1 follows
action n; a fact is used on the page of the stop action unless `Script.use` says otherwise.

Besides, this module holds what every family uses: the trajectory's common runs
(`Script.read_each`, `Script.follow_rule`, `search_and_open`, `sign_in`), the answer's
helpers (`unique_best`, `one_of`, `rule_checks`) and the goal's list of names (`named`).
The site helpers (prices, dates, links, checks of one site) stay in that site's module.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from envs.sites.common.accounts import TEST_ACCOUNT

Item = TypeVar("Item")


def element(role: str, name: str) -> str:
    """The reference `[role 'name']` of an element (tasks/README.md), quoted as Python's
    `repr` quotes: double quotes when the name holds a `'`."""
    return f"[{role} {name!r}]"


def search_action(query: str) -> str:
    """The action typing `query` into the current site's search box (and submitting it)."""
    return f"type [textbox 'Search'] [{query}] [1]"


def comment_action(text: str) -> str:
    """The action posting the comment `text` with the current page's comment box."""
    return f"type [textbox 'Comment'] [{text}] [1]"


def named(items: list[str]) -> str:
    """'A', 'B' and 'C'."""
    quoted = [f"'{item}'" for item in items]
    return ", ".join(quoted[:-1]) + f" and {quoted[-1]}"


def unique_best(items: Sequence[Item], key: Callable[[Item], Any], highest: bool = True) -> Item:
    """The item of `items` with the highest (or lowest) `key`.

    Raises:
        ValueError: another item shares that value (the task would have two answers).
    """
    winner = (max if highest else min)(items, key=key)
    if [key(item) for item in items].count(key(winner)) > 1:
        raise ValueError(f"{winner!r} ties with another item")
    return winner


def one_of(answer: str, candidates: list[str]) -> dict[str, list[str]]:
    """Reference answers naming `answer` and none of the other `candidates`."""
    return {"must_include": [answer], "must_exclude": [c for c in candidates if c != answer]}


def rule_checks(
    check: Callable[[str, dict[str, Any]], dict[str, Any]],
    written: list[str],
    skipped: list[str],
    text: str,
) -> list[dict[str, Any]]:
    """`program_html` checks of a rule that writes `text` on some items only: the last item
    of `written` shows it (`check(item, contents)`), the last of `skipped` does not."""
    return [
        check(written[-1], {"must_include": [text]}),
        check(skipped[-1], {"must_exclude": [text]}),
    ]


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

    def fact(self, text: str, kind: str | None = None) -> str:
        """Record that the current page shows `text`, a fact the task needs (of `kind`, for
        the carried facts: `envs.tasks.Fact.kind`); returns it."""
        fact = {"text": text, "page": self.page, "used_on": None}
        self.facts.append(fact if kind is None else {**fact, "kind": kind})
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

    def read_each(
        self,
        items: Sequence[Item],
        open_item: Callable[[Script, Item, str | None], None],
        read: Callable[[Script, Item], str],
        leave: str,
    ) -> None:
        """Open each of `items` in turn (`open_item(script, item, note)`) and read it there
        (`read(script, item)` records its facts and returns the agent's note of the page); each
        note goes with the next opening, the last one with the action `leave`."""
        noted = None
        for item in items:
            open_item(self, item, noted)
            noted = read(self, item)
        self.act(leave, note=noted)

    def follow_rule(
        self,
        items: Sequence[Item],
        open_item: Callable[[Script, Item], None],
        fact: Callable[[Item], str],
        picked: Collection[Item],
        write: Callable[[Script, Item, str], None],
    ) -> None:
        """Open each of `items` in turn (`open_item(script, item)`) and read `fact(item)` there,
        which decides the next action by a rule of the goal: on the items the rule picks
        (`picked`), `write(script, item, shown)` takes the write actions; the others are left
        alone."""
        for item in items:
            open_item(self, item)
            shown = self.fact(fact(item))
            self.use(shown)
            if item in picked:
                write(self, item, shown)


def search_and_open(script: Script, query: str, link: str, note: str | None = None) -> None:
    """Search the current site for `query` and click `link` in the results (two actions);
    `note`, about the page the search is typed on, goes with the first."""
    script.act(search_action(query), note=note)
    script.act(f"click {link}")


def sign_in(script: Script) -> None:
    """Type the test account into the sign-in form (two actions; lands on the page the
    form's `next` names)."""
    script.act(f"type [textbox 'Username'] [{TEST_ACCOUNT['username']}] [0]")
    script.act(f"type [textbox 'Password'] [{TEST_ACCOUNT['password']}] [1]")


@dataclass(frozen=True)
class Start:
    """Where a task starts: the sites it uses, its `start_url` (tasks/README.md) and whether
    the agent must sign in first (`require_login`)."""

    sites: list[str]
    url: str
    require_login: bool = False


def long_task(
    task_id: int,
    start: Start,
    intent: str,
    script: Script,
    reference_answers: dict[str, list[str]],
    comments: str,
    program_html: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A task object in the bundled format (tasks/README.md) for the trajectory `script`.

    `horizon` is the most pages between a fact and its use; a task that writes to a site
    (`program_html` given) resets it (`require_reset`).
    """
    checks = program_html or []
    eval_types = ["string_match", *(["program_html"] if checks else [])]
    return {
        "task_id": task_id,
        "sites": start.sites,
        "require_login": start.require_login,
        "require_reset": bool(checks),
        "start_url": start.url,
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
