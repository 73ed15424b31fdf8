"""Task evaluators in VisualWebArena's format: `string_match`, `url_match` and `program_html`.

`evaluate(task, answer, final_url, sites, read_page=None)` runs every evaluator in
`task.eval.eval_types` and multiplies their scores (each 0.0 or 1.0).

string_match compares the `stop` answer with `eval.reference_answers`, after cleaning both as
VisualWebArena does (surrounding quotes stripped, lowercased, outer whitespace stripped):

- `exact_match`: cleaned answer == cleaned reference.
- `must_include`: every listed reference occurs in the answer; `a |OR| b` accepts either.
- `must_exclude`: no listed reference occurs in the answer.
- `one_of`: at least one listed reference occurs in the answer.
- `fuzzy_match`: deterministic (VisualWebArena asks an LLM). Both sides are normalised —
  lowercased, punctuation replaced by spaces, whitespace collapsed — and a reference matches
  when it equals the normalised answer or occurs in it as a run of whole words.

"Occurs" for must_include / must_exclude / one_of means a whole-word occurrence: the
reference's text (punctuation and inner spaces included) appears in the answer, and where the
reference begins or ends with a word character (letter, digit, underscore) the answer has no
word character right before or after it, so "correct" does not occur in "incorrect" nor
"yes" in "eyes", while "yes" occurs in "Yes, it is" and "correct" in "correct.". Punctuation
at the reference's ends is matched as written ("$45" occurs in "It is $45", "Ann Lee." needs
the full stop). A reference beginning or ending with a digit must not continue a number of the
answer either, across a decimal point or a thousands comma: "12" does not occur in "$120" or
"1,200", nor "5" in "5.5" or "2" in "1.2". ".00" cents after a whole number are ignored on
both sides, so "$45.00" and "$45" match each other.

url_match compares the final URL with `eval.reference_url` (`|OR|` alternatives, placeholders
such as `__CLASSIFIEDS__` substituted). URLs are lowercased and stripped of a trailing "/";
query strings are compared parsed. `url_note` "EXACT": same host and path and the same query
parameters; "GOLD in PRED" (the default): the predicted path equals the reference path or
continues it after a "/", and every reference query parameter is present with that value.

program_html reads pages of the browser at the end of the episode, through `read_page(url,
locator) -> str` (`BrowserEnv.read_page`). Each check of `eval.program_html` reads one text:
`url` "last" is the active tab as it is, any other URL (placeholders substituted) is opened in
a new tab of the same browser context (so a login cookie applies), read and closed; `locator`
"" reads the page's visible text (`document.body.innerText`), otherwise the value of the
JavaScript expression (stringified; null, undefined or a script error read as ""). The text is
scored by string_match's rules against the check's `required_contents`; the evaluator's score
is the product over its checks. Unlike VisualWebArena, an empty locator reads the visible text
rather than the HTML source, and `func:` helper functions are not supported (`envs.tasks`
rejects them when the task is loaded).
"""

import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlparse

from envs.server import SiteServers, replace_placeholders
from envs.tasks import ProgramHtml, Task

OR = " |OR| "
_ZERO_CENTS = re.compile(r"(\d)\.00(?!\d|\.\d)")
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}\u2018\u2019\u201c\u201d\u2013\u2014]")


@dataclass(frozen=True)
class EvalResult:
    """Score in [0, 1] (product of the evaluators) and per-evaluator details."""

    score: float
    details: dict[str, Any] = field(default_factory=dict)


def clean_answer(text: str) -> str:
    """VisualWebArena's cleaning: strip, drop one pair of surrounding quotes, lowercase."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text.strip().lower()


def occurs(reference: str, answer: str) -> bool:
    """Whether cleaned `reference` occurs in cleaned `answer` as whole words (a reference end
    that is a word character touches no word character of the answer; one that is a digit
    touches no further number either; see the module docstring). An empty reference occurs
    in every answer."""
    reference = _ZERO_CENTS.sub(r"\1", clean_answer(reference))
    answer = _ZERO_CENTS.sub(r"\1", clean_answer(answer))
    if not reference:
        return True
    before = _edge(reference[0], r"(?<!\w)", r"(?<!\d[.,])")
    after = _edge(reference[-1], r"(?!\w)", r"(?![.,]\d)")
    return re.search(before + re.escape(reference) + after, answer) is not None


def _edge(char: str, word_rule: str, digit_rule: str) -> str:
    """The lookaround that keeps a reference end `char` from running into the answer's text:
    `word_rule` for a word character, plus `digit_rule` for a digit, nothing for punctuation."""
    if not re.fullmatch(r"\w", char):
        return ""
    return word_rule + digit_rule if re.fullmatch(r"\d", char) else word_rule


def normalise(text: str) -> str:
    """fuzzy_match normalisation: lowercase, punctuation to spaces, whitespace collapsed."""
    return " ".join(_PUNCTUATION.sub(" ", text.lower()).split())


def fuzzy_match(reference: str, answer: str) -> bool:
    """Normalised reference equals the normalised answer or is a run of its whole words."""
    ref, ans = normalise(reference), normalise(answer)
    if ref == ans:
        return True
    return bool(ref) and f" {ref} " in f" {ans} "


def string_match(reference_answers: Mapping[str, Any], answer: str | None) -> tuple[float, dict]:
    """Score (0.0 or 1.0) of `answer` against VisualWebArena `reference_answers`, and details.

    A missing answer (None, i.e. the agent never stopped) scores 0.
    """
    if answer is None:
        return 0.0, {"answer": None, "reason": "no answer"}
    checks: dict[str, bool] = {}
    for approach, value in reference_answers.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        match approach:
            case "exact_match":
                ok = all(clean_answer(answer) == clean_answer(v) for v in values)
            case "must_include":
                ok = all(any(occurs(alt, answer) for alt in v.split(OR)) for v in values)
            case "must_exclude":
                ok = not any(occurs(v, answer) for v in values)
            case "one_of":
                ok = any(occurs(v, answer) for v in values)
            case "fuzzy_match":
                ok = all(fuzzy_match(v, answer) for v in values)
            case _:
                raise ValueError(f"unknown reference_answers key {approach!r}")
        checks[approach] = ok
    if not checks:
        return 0.0, {"answer": answer, "reason": "no reference answers"}
    score = float(all(checks.values()))
    return score, {"answer": answer, "checks": checks}


def _split_url(url: str) -> tuple[str, dict[str, list[str]]]:
    """(host + path without trailing '/', parsed query) of a lowercased URL."""
    parsed = urlparse(url.strip().lower())
    return parsed.netloc + parsed.path.rstrip("/"), parse_qs(parsed.query)


def url_matches(reference: str, predicted: str, note: str = "GOLD in PRED") -> bool:
    """Whether `predicted` matches one `reference` URL under `note` (see module docstring)."""
    ref_base, ref_query = _split_url(reference)
    pred_base, pred_query = _split_url(predicted)
    if note == "EXACT":
        return ref_base == pred_base and ref_query == pred_query
    if note != "GOLD in PRED":
        raise ValueError(f"unknown url_note {note!r}: use 'EXACT' or 'GOLD in PRED'")
    base_ok = pred_base == ref_base or pred_base.startswith(ref_base + "/")
    return base_ok and all(
        any(v in pred_query.get(key, []) for v in values) for key, values in ref_query.items()
    )


def url_match(
    reference_url: str, final_url: str, note: str, placeholders: Mapping[str, str]
) -> tuple[float, dict]:
    """Score (0.0 or 1.0) of `final_url` against `reference_url` (`|OR|` alternatives);
    `placeholders` maps e.g. `__CLASSIFIEDS__` to its base URL."""
    references = [replace_placeholders(ref, placeholders) for ref in reference_url.split(OR)]
    ok = any(url_matches(ref, final_url, note or "GOLD in PRED") for ref in references)
    return float(ok), {"final_url": final_url, "reference_urls": references, "url_note": note}


PageReader = Callable[[str, str], str]
"""`(url, locator) -> text`: what a program_html check reads ("last" = the active tab)."""


def program_html(
    checks: list[ProgramHtml], read_page: PageReader, placeholders: Mapping[str, str]
) -> tuple[float, dict]:
    """Score (0.0 or 1.0) of the program_html `checks`: the product of one string match per
    check on the text `read_page(url, locator)` returns, placeholders in `url` substituted.
    """
    results = []
    score = 1.0
    for check in checks:
        url = check.url if check.url == "last" else replace_placeholders(check.url, placeholders)
        text = read_page(url, check.locator)
        part, info = string_match(check.required_contents.model_dump(exclude_none=True), text)
        results.append({"url": url, "locator": check.locator, "score": part, **info})
        score *= part
    return score, {"checks": results}


def evaluate(
    task: Task,
    answer: str | None,
    final_url: str,
    sites: SiteServers | Mapping[str, str],
    read_page: PageReader | None = None,
) -> EvalResult:
    """Score one finished episode of `task`.

    Args:
        task: the task (validated by `envs.tasks`).
        answer: the `stop` answer, or None when the episode ended without `stop`.
        final_url: the URL of the active tab at the end.
        sites: a `SiteServers` (or placeholder -> base URL map) for placeholder substitution.
        read_page: `(url, locator) -> text` for program_html, normally the episode's
            `BrowserEnv.read_page`; not needed by tasks without program_html.

    Returns:
        EvalResult with score = product of the evaluators' scores and details per evaluator.

    Raises:
        ValueError: the task uses program_html and `read_page` is None, or an unknown
            evaluator.
        Whatever `read_page` raises (a page that cannot be opened).
    """
    score = 1.0
    details: dict[str, Any] = {}
    spec = task.eval
    placeholders = sites if isinstance(sites, Mapping) else sites.placeholders
    for eval_type in spec.eval_types:
        if eval_type == "string_match":
            refs = spec.reference_answers.model_dump() if spec.reference_answers else {}
            part, info = string_match(refs, answer)
        elif eval_type == "url_match":
            part, info = url_match(spec.reference_url or "", final_url, spec.url_note, placeholders)
        elif eval_type == "program_html":
            if read_page is None:
                raise ValueError(
                    f"task {task.task_id}: program_html needs read_page (BrowserEnv.read_page)"
                )
            part, info = program_html(spec.program_html, read_page, placeholders)
        else:
            raise ValueError(f"task {task.task_id}: evaluator {eval_type!r} is not implemented")
        details[eval_type] = {"score": part, **info}
        score *= part
    return EvalResult(score=score, details=details)
