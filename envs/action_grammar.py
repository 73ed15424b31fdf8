"""The action grammar of one observation, as a Lark grammar for constrained decoding.

Every sentence of it is an action `envs.actions.parse_action` accepts, in canonical form
(`click [12]`, `type [12] [red bike] [1]`, `stop [$45]`, ...), with element ids exactly those
of the observation, tab indices those of the open tabs, and free text (typed text, answers,
URLs) bounded in length so a constrained reply always ends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from envs.actions import KEY_ALIASES, KEYS

TEXT_CHARS = 100
"""Most characters of typed text and of a `stop` answer."""
URL_CHARS = 200
"""Most characters of a `goto` URL."""
MAX_ELEMENT_IDS = 5000
"""More ids than this on one page make the grammar too large to be worth building."""

_ID_LINE = re.compile(r"^\s*\[(\d+)\]", re.MULTILINE)
_KEY_NAMES = sorted({*KEYS.values(), *(k for k in KEY_ALIASES.values() if k != " ")})


class ActionGrammarError(ValueError):
    """No action grammar for this observation (the reason is the message)."""


@dataclass(frozen=True)
class ActionGrammar:
    """One observation's action grammar.

    Attributes:
        lark: the grammar in Lark syntax (llguidance's dialect; rule `start`).
        element_ids: the ids `click`, `hover` and `type` may name, ascending.
        tabs: open tabs (`tab_focus` takes 0 to tabs - 1).
        max_bytes: UTF-8 bytes of the longest action, an upper bound on its tokens (every
            token is at least one byte).
    """

    lark: str
    element_ids: tuple[int, ...]
    tabs: int
    max_bytes: int


def element_ids(observation_text: str) -> list[int]:
    """The element ids of an observation's lines (`[id] role 'name'`), ascending, unique."""
    return sorted({int(match) for match in _ID_LINE.findall(observation_text)})


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def action_grammar(ids: Sequence[int], tabs: int) -> ActionGrammar:
    """The grammar of the actions available on a page with element `ids` and `tabs` tabs.

    Without ids the element actions are left out; the rest (scroll, tabs, goto, history,
    stop) remain.

    Raises:
        ActionGrammarError: more than `MAX_ELEMENT_IDS` ids, or `tabs` < 1.
    """
    ids = sorted(set(ids))
    if len(ids) > MAX_ELEMENT_IDS:
        raise ActionGrammarError(
            f"{len(ids)} element ids on the page, more than the grammar's {MAX_ELEMENT_IDS}"
        )
    if tabs < 1:
        raise ActionGrammarError(f"a page needs at least one open tab, got {tabs}")
    actions = [
        '"scroll [" DIRECTION "]"',
        '"press [" key "]"',
        '"new_tab"',
        '"close_tab"',
        '"tab_focus [" TAB "]"',
        '"goto [" URL "]"',
        '"go_back"',
        '"go_forward"',
        '"stop [" TEXT "]"',
    ]
    rules = [
        'DIRECTION: "up" | "down"',
        'key: KEY ("+" KEY)*',
        "KEY: " + " | ".join(_literal(k) for k in _KEY_NAMES) + " | /[a-z0-9]/",
        "TAB: " + " | ".join(_literal(str(t)) for t in range(tabs)),
        rf"URL: /[^\]\n\r ]{{1,{URL_CHARS}}}/",
        rf"TEXT: /[^\]\n\r]{{0,{TEXT_CHARS}}}/",
    ]
    if ids:
        actions[:0] = [
            '"click [" ELEMENT "]"',
            '"hover [" ELEMENT "]"',
            '"type [" ELEMENT "] [" TEXT "] [" ENTER "]"',
        ]
        rules += ["ELEMENT: " + " | ".join(_literal(str(i)) for i in ids), 'ENTER: "0" | "1"']
    lark = "start: " + "\n     | ".join(actions) + "\n" + "\n".join(rules) + "\n"
    longest_id = len(str(ids[-1])) if ids else 0
    longest = max(
        len("type [] [] [1]") + longest_id + 4 * TEXT_CHARS,
        len("goto []") + 4 * URL_CHARS,
    )
    return ActionGrammar(lark, tuple(ids), tabs, longest)
