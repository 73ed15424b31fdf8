"""Web tasks in VisualWebArena's config format, validated with pydantic, and the bundled suites.

A task file holds one JSON task object or a list of them. Fields follow VisualWebArena's
config files (`task_id`, `sites`, `start_url`, `intent`, `eval`, ...). Two fields are ours:

- `reference_actions`: a trajectory that solves the task, one action string per step, ending
  in `stop [...]`. Elements are named `[role 'name']` instead of by numeric id (ids are backend
  DOM node ids that differ between runs); see `envs.actions`.
- `horizon`: how many earlier pages' observations the task needs remembered (0 = the answer
  is on the page where the agent stops).
- `facts` and `history_tokens` (the long-horizon suite): each fact the answer needs, the page
  that shows it and the page where it is used, with the step and token distance between them;
  and the tokens of the whole scripted history at the answer (`scripts/long_tasks/build.py`
  measures both).
- `answer_prefix`, `distractors` and `split` (the long-horizon suite's fitted carry tasks,
  541-600): see `Task`.

Bundled suites live in `tasks/<suite>/*.json` (see tasks/README.md). Every error is a
`TaskError` with a one-line message naming the file, the task and the field.
"""

import json
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from envs.actions import ActionParseError, parse_action
from envs.server import SITES

TASKS_DIR = Path(__file__).resolve().parent.parent / "tasks"
"""Where the bundled suites live (one sub-folder per suite)."""
DEFAULT_SUITE = "classifieds"
_PLACEHOLDER = re.compile(r"__[A-Z]+__")


class TaskError(ValueError):
    """A task that cannot be found, read or validated; the message is one line."""


class ReferenceAnswers(BaseModel):
    """`eval.reference_answers` of string_match (see `envs.evaluators` for the semantics)."""

    model_config = ConfigDict(extra="forbid")
    label: ClassVar[str] = "reference_answers"
    exact_match: str | None = None
    must_include: list[str] | None = None
    must_exclude: list[str] | None = None
    one_of: list[str] | None = None
    fuzzy_match: list[str] | str | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> "ReferenceAnswers":
        given = {k: v for k, v in self.model_dump().items() if v is not None}
        if not given:
            raise ValueError(
                f"{self.label} needs at least one of " + ", ".join(type(self).model_fields)
            )
        for key, value in given.items():
            values = value if isinstance(value, list) else [value]
            if not values or any(not str(v).strip() for v in values):
                raise ValueError(f"{self.label}.{key} must hold non-empty strings")
        return self


class RequiredContents(ReferenceAnswers):
    """`required_contents` of one program_html check: the same keys and semantics as
    `reference_answers`, matched against the text the check reads from a page."""

    label: ClassVar[str] = "required_contents"


class ProgramHtml(BaseModel):
    """One `eval.program_html` check (VisualWebArena format, see `envs.evaluators`).

    Attributes:
        url: "last" (the active tab at the end of the episode) or a URL, usually beginning
            with a site placeholder, that is opened in a new tab of the episode's browser.
        locator: "" (the page's visible text) or a JavaScript expression whose value is read.
            VisualWebArena's `func:` helper functions are not supported.
        required_contents: what the read text must (not) contain.
    """

    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1)
    locator: str = ""
    required_contents: RequiredContents

    @model_validator(mode="after")
    def _supported(self) -> "ProgramHtml":
        for name in ("url", "locator"):
            if getattr(self, name).strip().startswith("func:"):
                raise ValueError(
                    f"{name} {getattr(self, name)!r}: VisualWebArena's func: helper functions "
                    "are not supported; use 'last', a URL or a JavaScript expression"
                )
        return self


class EvalSpec(BaseModel):
    """The `eval` object of a task."""

    model_config = ConfigDict(extra="forbid")
    eval_types: list[Literal["string_match", "url_match", "program_html"]] = Field(min_length=1)
    reference_answers: ReferenceAnswers | None = None
    reference_url: str | None = ""
    url_note: Literal["EXACT", "GOLD in PRED"] = "GOLD in PRED"
    program_html: list[ProgramHtml] = []
    string_note: str | None = None
    reference_answer_raw_annotation: str | None = None

    @model_validator(mode="after")
    def _evaluators_have_references(self) -> "EvalSpec":
        if "program_html" in self.eval_types and not self.program_html:
            raise ValueError("program_html needs a non-empty eval.program_html list")
        if "string_match" in self.eval_types and not self.reference_answers:
            raise ValueError("string_match needs eval.reference_answers")
        if "url_match" in self.eval_types and not self.reference_url:
            raise ValueError("url_match needs eval.reference_url")
        return self


Difficulty = Literal["easy", "medium", "hard"]
FactKind = Literal["name", "price", "count", "id", "date", "location"]
"""What a carried fact is (`scripts/long_tasks/kinds.py` says how a page shows each kind)."""
Split = Literal["calibration", "held-out"]


class Fact(BaseModel):
    """One fact a task's answer (or a later action) needs, where it is read and where used.

    Pages are numbered as the agent sees them: page 1 is the start page, page n + 1 the one
    after reference action n; the answer is given on the last page (`len(reference_actions)`).

    Attributes:
        text: the fact as the page shows it (whole words, e.g. `$120` or `pixel_pilot`).
        page: the page that shows it.
        used_on: the page whose action uses it (the last page for the answer).
        tokens: tokens of the scripted history from the fact on its page to its use (the
            default model's tokenizer, the recall runner's notes format); None until measured.
        kind: what the fact is (a person's name, a price, a count, an id, a date, a location);
            given for the facts the fitted carry tasks carry, None elsewhere.
    """

    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1)
    page: int = Field(ge=1)
    used_on: int = Field(ge=1)
    tokens: int | None = Field(default=None, ge=0)
    kind: FactKind | None = None

    @property
    def steps(self) -> int:
        """Actions between reading the fact and using it (`used_on - page`)."""
        return self.used_on - self.page


class Task(BaseModel):
    """One web task (VisualWebArena config fields plus `reference_actions` and `horizon`).

    The long-horizon suite's fields (tasks/README.md): `facts` and `history_tokens` as
    measured by its build, and `answer_prefix`: the start of the answer that a scripted run
    (`agent_kv.harness.scripted_episode`) forces after `stop [`, so that what the model decodes
    is the fact itself (e.g. `Black wool sweater location:`); empty, only `stop [` is forced. The
    reference answer must begin with it.

    The fitted carry tasks (541-600) answer with one fact read many pages earlier and say two
    more things, both None on every other task:

    - `distractors`: whether a page between that fact and the answer shows another fact of
      the same kind (a later listing's price after a price, any person's name after a
      seller); such a task needs its one fact `kind`ed.
    - `split`: "calibration" or "held-out", fixed before any policy runs (tasks/README.md,
      "The long-horizon suite", says how it is assigned).
    """

    model_config = ConfigDict(extra="forbid")
    task_id: int
    sites: list[str] = Field(min_length=1)
    start_url: str
    intent: str = Field(min_length=1)
    intent_template: str = ""
    intent_template_id: int | None = None
    instantiation_dict: dict[str, Any] = {}
    require_login: bool = False
    require_reset: bool = False
    storage_state: str | None = None
    geolocation: Any = None
    image: str | list[str] | None = None
    reasoning_difficulty: Difficulty | None = None
    visual_difficulty: Difficulty | None = None
    overall_difficulty: Difficulty | None = None
    comments: str | None = None
    eval: EvalSpec
    reference_actions: list[str] = []
    horizon: int = Field(default=0, ge=0)
    facts: list[Fact] = []
    history_tokens: int | None = Field(default=None, ge=1)
    answer_prefix: str = ""
    distractors: bool | None = None
    split: Split | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Task":
        for site in self.sites:
            if site not in SITES:
                raise ValueError(f"site {site!r} is not bundled (bundled: {sorted(SITES)})")
        known = {SITES[site].placeholder for site in self.sites}
        for url in self.start_urls:
            if not any(url.startswith(placeholder) for placeholder in known):
                choices = ", ".join(sorted(known))
                raise ValueError(
                    f"start_url {url!r} must begin with a site placeholder ({choices})"
                )
        texts = {"start_url": self.start_url, "eval.reference_url": self.eval.reference_url or ""}
        for i, check in enumerate(self.eval.program_html):
            texts[f"eval.program_html.{i}.url"] = check.url
        for where, text in texts.items():
            for placeholder in _PLACEHOLDER.findall(text):
                if placeholder not in known:
                    raise ValueError(
                        f"{where}: placeholder {placeholder} is not one of the task's sites"
                    )
        for i, text in enumerate(self.reference_actions):
            try:
                action = parse_action(text)
            except ActionParseError as error:
                raise ValueError(
                    f"reference_actions[{i}] {text!r} does not parse: {error}"
                ) from None
            if (action.kind == "stop") != (i == len(self.reference_actions) - 1):
                raise ValueError("reference_actions must end with stop [...] and stop only there")
        if self.answer_prefix and not (
            self.reference_actions
            and self.reference_actions[-1].startswith(f"stop [{self.answer_prefix}")
        ):
            raise ValueError(
                f"answer_prefix {self.answer_prefix!r}: the last reference action must be "
                "stop [...] beginning with it"
            )
        pages = len(self.reference_actions)
        for i, fact in enumerate(self.facts):
            if not fact.page <= fact.used_on <= pages:
                raise ValueError(
                    f"facts[{i}]: needs page <= used_on <= {pages} (the pages of the "
                    f"reference actions), got page {fact.page}, used_on {fact.used_on}"
                )
        if self.distractors is not None and not (
            len(self.facts) == 1 and self.facts[0].kind is not None
        ):
            raise ValueError("distractors needs exactly one fact, with its kind")
        return self

    @property
    def start_urls(self) -> list[str]:
        """The start URLs, one per tab (`start_url` split on ' |AND| '), placeholders kept."""
        return [url.strip() for url in self.start_url.split(" |AND| ")]


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _error_line(where: str, error: ValidationError) -> str:
    """One line for the first pydantic error: "<where>: field 'eval.eval_types' missing"."""
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    if first["type"] == "missing":
        return f"{where}: field '{loc}' missing"
    if first["type"] == "extra_forbidden":
        return f"{where}: unknown field '{loc}'"
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: field '{loc}': {message}" if loc else f"{where}: {message}"


def load_tasks(path: str | Path) -> list[Task]:
    """All tasks in a JSON file holding one task object or a list of them.

    Raises:
        TaskError: unreadable file, invalid JSON, an invalid task, or duplicate task ids.
    """
    path = Path(path)
    shown = _shown(path)
    if path.is_dir():
        raise TaskError(f"{shown}: is a directory; pass a task JSON file or a bundled task id")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskError(f"{shown}: no such task file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TaskError(f"{shown}: cannot read: {error}") from None
    except json.JSONDecodeError as error:
        raise TaskError(f"{shown}: invalid JSON at line {error.lineno}: {error.msg}") from None
    entries = raw if isinstance(raw, list) else [raw]
    tasks: list[Task] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            where = f"{shown} entry {index}" if isinstance(raw, list) else shown
            raise TaskError(f"{where}: a task must be a JSON object")
        task_id = entry.get("task_id")
        where = f"{shown} task {task_id}" if isinstance(task_id, int) else f"{shown} entry {index}"
        try:
            tasks.append(Task.model_validate(entry))
        except ValidationError as error:
            raise TaskError(_error_line(where, error)) from None
    seen: set[int] = set()
    for task in tasks:
        if task.task_id in seen:
            raise TaskError(f"{shown} task {task.task_id}: duplicate task_id")
        seen.add(task.task_id)
    return tasks


def _id_ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts: list[str] = []
    for task_id in sorted(ids):
        if parts and task_id == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{task_id}"
        else:
            parts.append(str(task_id))
    return ", ".join(parts)


def suite_names() -> list[str]:
    """Names of the bundled suites (sub-folders of TASKS_DIR holding JSON files)."""
    return sorted(p.name for p in TASKS_DIR.iterdir() if p.is_dir() and any(p.glob("*.json")))


def load_suite(name: str = DEFAULT_SUITE) -> list[Task]:
    """All tasks of bundled suite `name`, sorted by task_id.

    Raises:
        TaskError: unknown suite, an invalid file, or a task id used twice in the suite.
    """
    folder = TASKS_DIR / name
    if not folder.is_dir() or name not in suite_names():
        raise TaskError(f"unknown task suite {name!r}: bundled suites are {suite_names()}")
    tasks: dict[int, Task] = {}
    for path in sorted(folder.glob("*.json")):
        for task in load_tasks(path):
            if task.task_id in tasks:
                raise TaskError(f"{_shown(path)} task {task.task_id}: duplicate task_id in suite")
            tasks[task.task_id] = task
    return [tasks[task_id] for task_id in sorted(tasks)]


def load_task(id_or_path: int | str | Path) -> Task:
    """One task: an int (or a string of digits) is a bundled task id, anything else a path.

    A path must hold exactly one task.

    Raises:
        TaskError: unknown id, missing or invalid file, or a file holding several tasks.
    """
    if isinstance(id_or_path, int) or (
        isinstance(id_or_path, str) and id_or_path.removeprefix("-").isdigit()
    ):
        task_id = int(id_or_path)
        bundled = [task for suite in suite_names() for task in load_suite(suite)]
        for task in bundled:
            if task.task_id == task_id:
                return task
        ids = _id_ranges([task.task_id for task in bundled])
        raise TaskError(f"unknown task id {task_id}: bundled ids are {ids}")
    tasks = load_tasks(id_or_path)
    if len(tasks) != 1:
        raise TaskError(f"{_shown(Path(id_or_path))}: holds {len(tasks)} tasks, expected one")
    return tasks[0]
