"""The action grammar of VisualWebArena, as data, and its parser.

One action per step, written by the agent as text:

    click [id]                 hover [id]
    type [id] [text] [0|1]     (1 = press Enter after typing, the default)
    press [key_comb]           scroll [up|down]
    new_tab                    tab_focus [tab_index]     close_tab
    goto [url]                 go_back                   go_forward
    stop [answer]              (`stop` alone answers "")

`parse_action` accepts the action alone, inside ``` fences, or after "the next action I will
perform is", and tolerates prose around it. It raises `ActionParseError` otherwise.

Extension for reference trajectories (not in VisualWebArena): wherever an action takes an
element id, `[role 'name']` may stand for it, e.g. `click [link 'Blue road bike - $120']`.
Element ids are backend DOM node ids that change between runs, so task files name elements
this way; the browser env resolves the reference to the first element of the current
accessibility tree with exactly that role and name (see `envs.browser_env`).
"""

import ast
import re
from dataclasses import dataclass

ACTION_GRAMMAR: dict[str, str] = {
    "click": "click [id]",
    "type": "type [id] [text] [0|1]",
    "hover": "hover [id]",
    "press": "press [key_comb]",
    "scroll": "scroll [up|down]",
    "new_tab": "new_tab",
    "tab_focus": "tab_focus [tab_index]",
    "close_tab": "close_tab",
    "goto": "goto [url]",
    "go_back": "go_back",
    "go_forward": "go_forward",
    "stop": "stop [answer]",
}
"""Action kind -> its syntax."""
ACTION_FORMATS = ("text", "tools")
"""How an agent may write an action: as text in this syntax, or as a call of the action's
function tool (`agent_kv.harness.action_tools`)."""


ANSWER_PHRASE = "the next action i will perform is"

KEYS: dict[str, str] = {
    name.lower(): name
    for name in (
        "Enter Tab Escape Backspace Delete Insert Space Home End PageUp PageDown "
        "ArrowUp ArrowDown ArrowLeft ArrowRight Control Shift Alt Meta ControlOrMeta "
        "F1 F2 F3 F4 F5 F6 F7 F8 F9 F10 F11 F12"
    ).split()
}
"""Named keys of `press` (case-insensitive) -> Playwright key names."""
KEY_ALIASES = {
    "ctrl": "Control",
    "cmd": "Meta",
    "command": "Meta",
    "option": "Alt",
    "esc": "Escape",
    "return": "Enter",
    "del": "Delete",
    "up": "ArrowUp",
    "down": "ArrowDown",
    "left": "ArrowLeft",
    "right": "ArrowRight",
    "pgup": "PageUp",
    "pgdn": "PageDown",
    "space": " ",
}

_ID = r"\[\s*(?P<id>\d+)\s*\]"
_REF = r"\[\s*(?P<role>[A-Za-z]+)\s+(?P<name>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\s*\]"
_TARGET = rf"(?:{_ID}|{_REF})"
_KIND_WORD = re.compile(
    r"\b(" + "|".join(sorted(ACTION_GRAMMAR, key=len, reverse=True)) + r")\b", re.IGNORECASE
)
_FENCE = re.compile(r"```(?:[a-zA-Z]*\n)?(.*?)```", re.DOTALL)


class ActionParseError(ValueError):
    """The text holds no valid action; the message explains the grammar to the agent."""


@dataclass(frozen=True)
class ElementRef:
    """An element named by role and accessible name instead of id (reference actions only)."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role} {self.name!r}"


@dataclass(frozen=True)
class Action:
    """A parsed action.

    Attributes:
        kind: a key of ACTION_GRAMMAR.
        element_id: the element of click/type/hover, when given as a number.
        element_ref: the element of click/type/hover, when given as [role 'name'].
        text: what `type` types.
        press_enter: whether `type` presses Enter afterwards.
        key: the Playwright key combination of `press`, e.g. "Control+a".
        direction: "up" or "down" for `scroll`.
        tab_index: the tab of `tab_focus` (0-based).
        url: the target of `goto`.
        answer: the answer of `stop` ("" when none was given).
    """

    kind: str
    element_id: int | None = None
    element_ref: ElementRef | None = None
    text: str | None = None
    press_enter: bool = True
    key: str | None = None
    direction: str | None = None
    tab_index: int | None = None
    url: str | None = None
    answer: str | None = None

    @property
    def target(self) -> str:
        """The element argument as written: '12' or "link 'Home'"."""
        return str(self.element_id if self.element_ref is None else self.element_ref)

    def __str__(self) -> str:
        """The canonical text of the action, e.g. 'type [12] [red bike] [1]'."""
        match self.kind:
            case "click" | "hover":
                return f"{self.kind} [{self.target}]"
            case "type":
                return f"type [{self.target}] [{self.text}] [{int(self.press_enter)}]"
            case "press":
                return f"press [{self.key}]"
            case "scroll":
                return f"scroll [{self.direction}]"
            case "tab_focus":
                return f"tab_focus [{self.tab_index}]"
            case "goto":
                return f"goto [{self.url}]"
            case "stop":
                return f"stop [{self.answer}]"
            case _:
                return self.kind


def grammar_help() -> str:
    """The one-paragraph grammar reminder appended to parse errors."""
    return (
        "Reply with exactly one action, e.g. ```click [12]```. Valid actions: "
        + ", ".join(ACTION_GRAMMAR.values())
        + ". In type, the last [0|1] says whether to press Enter (default 1)."
    )


def normalise_key(key_comb: str) -> str:
    """A `press` key combination in Playwright form: 'ctrl+a' -> 'Control+a'.

    Raises:
        ActionParseError: an unknown multi-character key name.
    """
    parts = [part.strip() for part in key_comb.strip().split("+")]
    if key_comb.strip() == "+":
        parts = ["+"]
    keys = []
    for part in parts:
        lowered = part.lower()
        if len(part) == 1:
            keys.append(part)
        elif lowered in KEY_ALIASES:
            keys.append(KEY_ALIASES[lowered])
        elif lowered in KEYS:
            keys.append(KEYS[lowered])
        else:
            raise ActionParseError(
                f"unknown key {part!r} in press [{key_comb}]: use names such as Enter, Tab, "
                "Escape, Backspace, ArrowDown, PageDown or combinations such as Control+a"
            )
    return "+".join(keys)


def _target(match: re.Match) -> dict:
    """element_id / element_ref keyword arguments from a match of _TARGET."""
    if match.group("id") is not None:
        return {"element_id": int(match.group("id"))}
    return {"element_ref": ElementRef(match.group("role"), ast.literal_eval(match.group("name")))}


def _parse_at(text: str, kind: str, whole: bool) -> Action | None:
    """Parse `text`, which starts with the action word `kind`.

    With `whole` the action must span all of `text` (free text arguments may then contain
    brackets); otherwise it may be followed by anything and free text ends at the first `]`.
    Returns None when the syntax does not match.
    """
    rest = text[len(kind) :]
    free = r"(?P<free>.*)" if whole else r"(?P<free>.*?)"
    end = r"\s*$" if whole else ""
    patterns = {
        "click": rf"\s*{_TARGET}",
        "hover": rf"\s*{_TARGET}",
        "type": rf"\s*{_TARGET}\s*\[{free}\](?:\s*\[\s*(?P<enter>[01])\s*\])?",
        "press": rf"\s*\[{free}\]",
        "scroll": r"\s*\[?\s*(?P<dir>up|down)\s*\]?",
        "tab_focus": r"\s*\[\s*(?P<tab>\d+)\s*\]",
        "goto": rf"\s*\[{free}\]",
        "stop": rf"(?:\s*\[{free}\])?",
        "new_tab": "",
        "close_tab": "",
        "go_back": "",
        "go_forward": "",
    }
    flags = re.DOTALL | re.IGNORECASE
    match = None
    if kind == "type" and whole:
        # As VisualWebArena: with a trailing [0|1] the text is everything up to it.
        match = re.match(
            rf"\s*{_TARGET}\s*\[{free}\]\s*\[\s*(?P<enter>[01])\s*\]{end}", rest, flags
        )
    match = match or re.match(patterns[kind] + end, rest, flags)
    if match is None:
        return None
    groups = match.groupdict()
    if kind in ("click", "hover"):
        return Action(kind, **_target(match))
    if kind == "type":
        return Action(
            "type", text=groups["free"], press_enter=groups["enter"] != "0", **_target(match)
        )
    if kind == "press":
        return Action("press", key=normalise_key(groups["free"]))
    if kind == "scroll":
        return Action("scroll", direction=groups["dir"].lower())
    if kind == "tab_focus":
        return Action("tab_focus", tab_index=int(groups["tab"]))
    if kind == "goto":
        url = groups["free"].strip()
        return Action("goto", url=url) if url else None
    if kind == "stop":
        if groups["free"] is None and rest.strip(" \t\n.!`"):
            return None
        return Action("stop", answer=(groups["free"] or "").strip())
    return Action(kind)


def _parse_candidate(candidate: str, fenced: bool) -> Action | None:
    """The first action found in `candidate`, scanning action words left to right.

    A fenced block is the action itself, so its free-text argument may contain `]`; in prose
    free text ends at the first `]`.
    """
    for match in _KIND_WORD.finditer(candidate):
        kind = match.group(1).lower()
        snippet = candidate[match.start() :].strip()
        action = _parse_at(snippet, kind, whole=True) if fenced else None
        if action is None:
            action = _parse_at(snippet, kind, whole=False)
        if action is not None:
            return action
    return None


def parse_action(text: str) -> Action:
    """Parse the agent's reply into one Action.

    Where to look, in order: after the last "the next action I will perform is"
    (case-insensitive) if present, else the whole reply; inside that, ``` fenced blocks first,
    then the plain text. Within a piece, the first action word that starts a syntactically
    valid action wins. A bare `stop` without brackets counts only when nothing follows it.

    Raises:
        ActionParseError: no valid action; the message restates the grammar.
    """
    if not isinstance(text, str) or not text.strip():
        raise ActionParseError(f"Empty reply: no action found. {grammar_help()}")
    region = text
    lowered = text.lower()
    if ANSWER_PHRASE in lowered:
        region = text[lowered.rindex(ANSWER_PHRASE) + len(ANSWER_PHRASE) :]
    for block in _FENCE.findall(region):
        action = _parse_candidate(block, fenced=True)
        if action is not None:
            return action
    action = _parse_candidate(region, fenced=False)
    if action is None and region is not text:
        action = _parse_candidate(text, fenced=False)
    if action is not None:
        return action
    shown = " ".join(text.split())
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    raise ActionParseError(f"Could not parse an action from {shown!r}. {grammar_help()}")
