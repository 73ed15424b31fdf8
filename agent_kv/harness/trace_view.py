"""An episode trace as one self-contained HTML page (`agent-kv trace DIR` -> `DIR/trace.html`).

The trace directory is what `agent.run_episode` writes:

- `task.json`: the task as run (VisualWebArena config fields: `intent`, `eval` with the
  reference answers, reference URL or page checks, ...);
- per step `step_NNN.json` (observation, reply, parsed action, KV figures, `step_s` the
  step's wall time in seconds, and the prompt and cache fields of `step_cache_fields`),
  `step_NNN.png` (the screenshot acted on) and optionally a set-of-marks image
  `step_NNN.som.png`;
- `kv_steps.jsonl` (one record per forward call, `runtime.sequence.CallRecord`);
- `summary.json` (the episode summary with the evaluator's verdict: `score`, `answer`,
  `eval_details`).

Traces written before the KV figures were renamed are read too (`agent_kv.renamed_fields`).

The page shows the goal, the expected answer and the verdict, the summary, an inline SVG plot
of the KV memory over the forward calls (`kv_plot_svg`), then per step its wall time, the
screenshot(s), the reply and the parsed action, the observation text and the prompt the model
saw with each token marked by its state in the KV cache after the step (`prompt_html`), both
collapsed. Images are embedded as base64, so the file can be moved or mailed alone.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from agent_kv.errors import AgentKVError
from agent_kv.renamed_fields import current_names

if TYPE_CHECKING:
    from agent_kv.runtime.chat.conversation import Conversation

TEMPLATES = Path(__file__).resolve().parent / "templates"
TRACE_HTML = "trace.html"
TASK_JSON = "task.json"
_STEP = re.compile(r"step_(\d+)\.json$")
SHARE_LEVELS = 4
"""A share of the layers is drawn in this many shades (quarters): level 0 only for no layer,
the top level only for all of them."""
HELD_BACK = 4
"""The most tokens `token_pieces` joins to complete one character."""


class TraceError(AgentKVError):
    """A directory that is not a readable episode trace; the message is one line."""


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text of each token of `ids`, special tokens kept, in pieces that concatenate to
    their decoded text. Each token is decoded after the one before it (so a tokenizer that
    drops a leading space at the start of a text keeps it); a token that ends inside a
    character gets "" and the character goes to the token that completes it."""
    pieces: list[str] = []
    done = 0  # ids[:done] have their pieces
    for end in range(1, len(ids) + 1):
        context = max(done - 1, 0)
        before = tokenizer.decode(ids[context:done], skip_special_tokens=False)
        text = tokenizer.decode(ids[context:end], skip_special_tokens=False)
        if text.endswith("\ufffd") and end - done < HELD_BACK and end < len(ids):
            continue
        piece = text[len(before) :] if text.startswith(before) else text
        pieces += [""] * (end - done - 1) + [piece]
        done = end
    return pieces


def _runs(values: list[tuple]) -> list[list]:
    """`[start, end, *value]` per run of equal consecutive `values` (positions `[start,
    end)`)."""
    runs: list[list] = []
    for position, value in enumerate(values):
        if runs and runs[-1][2:] == list(value):
            runs[-1][1] = position + 1
        else:
            runs.append([position, position + 1, *value])
    return runs


def step_cache_fields(chat: Conversation, first_token: int, observation: int) -> dict[str, Any]:
    """What a step record holds about the prompt and the KV cache, taken right after the
    step's reply:

    - `token_start`, `tokens`: the first position fed in this step and the text of each token
      fed in it (`token_pieces`), so the records of steps 1..k concatenate to the prompt of
      step k;
    - `observation_span`, `reply_span`: `[start, end)` positions of the step's observation
      (message index `observation`) and of its reply;
    - `kv_layers`; `kv_bytes_per_token`: the key and value bytes of one token across all
      layers at full precision; `kv_quantized_format`: "int8", "fp8" or None while nothing
      is quantized;
    - `kv_states`: `[start, end, fp_layers, quantized_layers]` per run of positions in the
      same state, covering every position seen: live at full precision in `fp_layers`
      layers, quantized in `quantized_layers`, evicted from the others;
    - `pinned_spans`: `[start, end)` per run of pinned positions (pinned tokens stay at full
      precision in every layer); `pinned_tokens`: how many.
    """
    store = chat.sequence.store
    seen = store.seen_tokens
    fp, quantized = store.precision.counts()
    pinned = store.pins.positions().tolist()
    return {
        "token_start": first_token,
        "tokens": token_pieces(chat.engine.tokenizer, chat.sequence.token_ids[first_token:seen]),
        "observation_span": list(chat.spans[observation]),
        "reply_span": list(chat.spans[len(chat.messages) - 1]),
        "kv_layers": store.num_layers,
        "kv_bytes_per_token": store.bytes_per_token(),
        "kv_quantized_format": store.precision.quantized_format(),
        "kv_states": _runs(list(zip(fp.tolist(), quantized.tolist(), strict=True))),
        "pinned_spans": [run[:2] for run in _runs([(flag,) for flag in pinned]) if run[2]],
        "pinned_tokens": sum(pinned),
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: cannot read: {err}") from None


def _image(path: Path) -> str | None:
    """A data: URI of the PNG at `path`, None when there is none."""
    if not path.is_file():
        return None
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def load_trace(trace_dir: Path) -> dict[str, Any]:
    """Everything the page shows, read from `trace_dir`.

    Returns:
        `task` and `summary` (dicts or None), `kv_steps` (list of records), `steps` (per step:
        the step_NNN.json record plus `screenshot` and `som` data URIs or None, and `step_s`
        from the summary for records written without it); the summary's, the steps' and the
        forward calls' KV figures in the current names (`renamed_fields.current_names`).

    Raises:
        TraceError: not a directory, no step file and no kv_steps.jsonl, or a file that does
            not parse.
    """
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise TraceError(f"{trace_dir}: not a directory")
    step_files = sorted(
        (int(m.group(1)), p) for p in trace_dir.iterdir() if (m := _STEP.match(p.name))
    )
    kv_path = trace_dir / "kv_steps.jsonl"
    if not step_files and not kv_path.exists():
        raise TraceError(f"{trace_dir}: not an episode trace (no step_NNN.json, no kv_steps.jsonl)")
    summary_path, task_path = trace_dir / "summary.json", trace_dir / TASK_JSON
    summary = current_names(_read_json(summary_path)) if summary_path.exists() else None
    step_times = (summary or {}).get("step_s") or []
    steps = []
    for number, path in step_files:
        record = _read_json(path)
        if not isinstance(record, dict):
            raise TraceError(f"{path}: expected a JSON object")
        record = current_names(record)
        stem = f"step_{number:03d}"
        record["screenshot"] = _image(trace_dir / f"{stem}.png")
        record["som"] = _image(trace_dir / f"{stem}.som.png") or _image(
            trace_dir / f"{stem}_som.png"
        )
        record.setdefault("step", number)
        if "step_s" not in record and 0 < number <= len(step_times):
            record["step_s"] = step_times[number - 1]
        steps.append(record)
    kv_steps = []
    if kv_path.exists():
        try:
            lines = kv_path.read_text(encoding="utf-8").splitlines()
            kv_steps = [current_names(json.loads(line)) for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TraceError(f"{kv_path}: cannot read: {err}") from None
    task = _read_json(task_path) if task_path.exists() else None
    return {"task": task, "summary": summary, "kv_steps": kv_steps, "steps": steps}


def _shown(value: Any) -> str:
    """A value as one line of text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def expected_answer(task: dict[str, Any]) -> list[tuple[str, str]]:
    """What the task's evaluators expect, as `(evaluator, expectation)` lines: the reference
    answers of string_match, the reference URL of url_match (with its url_note), each page
    check of program_html; the eval types as recorded in `task["eval"]`."""
    spec = task.get("eval") or {}
    lines = []
    for eval_type in spec.get("eval_types", []):
        if eval_type == "string_match":
            answers = spec.get("reference_answers") or {}
            text = "; ".join(f"{k}: {_shown(v)}" for k, v in answers.items() if v is not None)
        elif eval_type == "url_match":
            text = f"{spec.get('reference_url')} ({spec.get('url_note', 'GOLD in PRED')})"
        elif eval_type == "program_html":
            checks = spec.get("program_html") or []
            text = "; ".join(
                f"{c.get('url')} {c.get('locator') or 'page text'}: "
                + ", ".join(f"{k} {_shown(v)}" for k, v in c["required_contents"].items() if v)
                for c in checks
            )
        else:
            text = _shown(spec)
        lines.append((eval_type, text))
    return lines


def verdict(summary: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """The evaluator's verdict per evaluator, `(evaluator, score, details)`, from the
    summary's `eval_details` (details as `key: value` pairs)."""
    rows = []
    for eval_type, info in (summary.get("eval_details") or {}).items():
        if not isinstance(info, dict):
            rows.append((eval_type, None, _shown(info)))
            continue
        details = "; ".join(f"{k}: {_shown(v)}" for k, v in info.items() if k != "score")
        rows.append((eval_type, info.get("score"), details))
    return rows


def _level(count: int, layers: int) -> int:
    """`count` of `layers` as a shade 0..SHARE_LEVELS: 0 only for none, the top only for
    all."""
    if count == 0:
        return 0
    if count == layers:
        return SHARE_LEVELS
    return min(max(round(SHARE_LEVELS * count / layers), 1), SHARE_LEVELS - 1)


def _state_span(text: str, state: tuple[int, int] | None, pinned: bool, record: dict) -> str:
    """One run of tokens in one state as HTML: plain text at full precision in every layer,
    else a span of class `pin` (pinned), `qN` (quantized in about N quarters of the layers)
    and `eN` (evicted from about N quarters), titled with the exact layer counts."""
    layers = record["kv_layers"]
    if pinned:
        return f'<span class="pin" title="pinned: FP in all {layers} layers">{text}</span>'
    if state is None or state == (layers, 0):
        return text
    fp, quantized = state
    evicted = layers - fp - quantized
    fmt = (record.get("kv_quantized_format") or "int8").upper()
    levels = {"q": _level(quantized, layers), "e": _level(evicted, layers)}
    shown = " ".join(f"{name}{level}" for name, level in levels.items() if level)
    title = f"FP {fp}, {fmt} {quantized}, evicted {evicted} of {layers} layers"
    return f'<span class="{shown}" title="{title}">{text}</span>'


def prompt_html(pieces: list[str], record: dict[str, Any], marks: dict[int, list[str]]) -> str:
    """The prompt the model saw up to step `record`, as HTML: the text of `pieces` (one per
    position, escaped) in runs of positions in one state after that step (its `kv_states`
    and `pinned_spans`, see `_state_span`), with a badge before each position of `marks`
    (e.g. "step 2 observation")."""
    n = len(pieces)
    states: list[tuple[int, int] | None] = [None] * n
    for start, end, fp, quantized in record["kv_states"]:
        states[start:end] = [(fp, quantized)] * (min(end, n) - start)
    pinned = [False] * n
    for start, end in record["pinned_spans"]:
        pinned[start:end] = [True] * (min(end, n) - start)
    keys = list(zip(states, pinned, strict=True))
    parts, start = [], 0
    for position in range(1, n + 1):
        if position < n and keys[position] == keys[start] and position not in marks:
            continue
        parts += [f'<span class="mark">{escape(label)}</span>' for label in marks.get(start, [])]
        text = str(escape("".join(pieces[start:position])))
        parts.append(_state_span(text, states[start], pinned[start], record))
        start = position
    return "".join(parts)


def cache_shares(record: dict[str, Any]) -> dict[str, float]:
    """Shares of the step's token-layer slots (positions seen x layers) held at full
    precision (`fp`), quantized (`quantized`) and evicted (`evicted`), each in [0, 1]."""
    fp = quantized = positions = 0
    for start, end, fp_layers, quantized_layers in record["kv_states"]:
        fp += (end - start) * fp_layers
        quantized += (end - start) * quantized_layers
        positions = end
    slots = max(positions * record["kv_layers"], 1)
    evicted = slots - fp - quantized if positions else 0
    return {"fp": fp / slots, "quantized": quantized / slots, "evicted": evicted / slots}


def prompt_views(steps: list[dict[str, Any]]) -> None:
    """Add `prompt` (`prompt_html`) and `shares` (`cache_shares`) to each step record that
    has the cache fields of `step_cache_fields`: the tokens of steps 1..k, with badges where
    each of those steps' observation and reply begin."""
    pieces: list[str] = []
    marks: dict[int, list[str]] = {}
    for record in steps:
        if "tokens" not in record or "kv_states" not in record:
            continue
        pieces += [""] * (record["token_start"] - len(pieces))
        pieces[record["token_start"] :] = record["tokens"]
        for what in ("observation", "reply"):
            marks.setdefault(record[f"{what}_span"][0], []).append(f"step {record['step']} {what}")
        record["prompt"] = Markup(prompt_html(pieces, record, marks))
        record["shares"] = cache_shares(record)


def _step_of_calls(kv_steps: list[dict], steps: list[dict]) -> list[int | None]:
    """Per forward call, the index in `steps` of the step that fed it (the first whose
    `tokens_seen` reaches the call's `seen_tokens`), None past the last step."""
    ends = [record.get("tokens_seen", 0) for record in steps]
    owners, k = [], 0
    for call in kv_steps:
        while k < len(ends) and call.get("seen_tokens", 0) > ends[k]:
            k += 1
        owners.append(k if k < len(ends) else None)
    return owners


def _budget_mb(kv_steps: list[dict], steps: list[dict], per_token: int) -> list[float | None]:
    """Per call, the most live KV its budget allows at full precision in MB: (budget
    unpinned tokens per layer + the step's pinned tokens) x `per_token` bytes; None for
    calls without a budget."""
    owners = _step_of_calls(kv_steps, steps)
    values = []
    for call, owner in zip(kv_steps, owners, strict=True):
        pinned = steps[owner].get("pinned_tokens", 0) if owner is not None else 0
        budget = call.get("budget")
        values.append(None if budget is None else (budget + pinned) * per_token / 1e6)
    return values


def _points(xs: list[float], ys: list[float | None]) -> list[str]:
    """`x,y` point lists of one polyline per stretch of values that are not None."""
    lines: list[list[str]] = [[]]
    for x, y in zip(xs, ys, strict=True):
        if y is None:
            lines.append([])
        else:
            lines[-1].append(f"{x:.1f},{y:.1f}")
    return [" ".join(line) for line in lines if line]


def kv_plot_svg(
    kv_steps: list[dict[str, Any]],
    steps: list[dict[str, Any]] | None = None,
    width: int = 960,
    height: int = 290,
) -> str:
    """An inline SVG against the forward call index: live KV bytes in MB (left axis; after
    each forward call appended, then after its eviction, one sawtooth line), allocated KV
    bytes in MB (the most the buffers held during each call, for records that have it),
    confidence in [0, 1] (right axis) and, from the step records `steps`: the full-KV line
    (tokens seen x full-precision bytes per token: what full KV would hold), the budget line
    (`_budget_mb`) and a vertical mark where each step's forward calls begin. A legend of the
    lines drawn, three to a row, runs below the axis. An empty string for no records."""
    if not kv_steps:
        return ""
    steps = steps or []
    n = len(kv_steps)
    per_token = next((s["kv_bytes_per_token"] for s in steps if "kv_bytes_per_token" in s), 0)
    appended = [r.get("appended_kv_live_bytes", r.get("kv_live_bytes", 0)) / 1e6 for r in kv_steps]
    kept = [r.get("kv_live_bytes", 0) / 1e6 for r in kv_steps]
    allocated = [r.get("kv_allocated_bytes", 0) / 1e6 for r in kv_steps]
    full = [r.get("seen_tokens", 0) * per_token / 1e6 for r in kv_steps]
    budget = _budget_mb(kv_steps, steps, per_token) if per_token else [None] * n
    top_mb = max(*appended, *kept, *allocated, *full, *(b or 0 for b in budget)) or 1.0
    area = _PlotArea(width, height, n, top_mb)
    xs = [area.x(i) for i in range(n)]
    saw = " ".join(
        f"{xs[i]:.1f},{area.y_mb(a):.1f} {xs[i]:.1f},{area.y_mb(k):.1f}"
        for i, (a, k) in enumerate(zip(appended, kept, strict=True))
    )
    conf = [area.y_conf(float(r.get("confidence", 0.0))) for r in kv_steps]
    series = [  # (class, colour, dash, legend, polylines)
        ("live", "#1f77b4", "", "live KV: after append, after eviction", [saw]),
        ("allocated", "#2ca02c", "", "allocated KV: the most during each call",
         _points(xs, [area.y_mb(v) for v in allocated]) if any(allocated) else []),
        ("confidence", "#d62728", "", "confidence c (right axis)", _points(xs, conf)),
        ("full-kv", "#7f7f7f", "6 3", "full KV: tokens seen × FP bytes/token",
         _points(xs, [area.y_mb(v) for v in full]) if per_token else []),
        ("budget", "#ff7f0e", "4 2", "budget: (budget + pinned) × FP bytes/token",
         _points(xs, [area.y_mb(v) for v in budget])),
    ]  # fmt: skip
    parts = [
        *_grid_svg(area),
        *_step_marks_svg(area, xs, kv_steps, steps),
        *_series_svg(area, [item for item in series if item[4]]),
        *_axis_labels_svg(area),
    ]
    return "\n".join(parts)


@dataclass(frozen=True)
class _PlotArea:
    """`kv_plot_svg`'s geometry in SVG pixels: an image `width` x `height` whose plotting area
    starts `left`, `top` from its corner and leaves `right`, `bottom` free; `calls` forward
    calls along x, `top_mb` MB at the top of the left axis, confidence 0 to 1 on the right."""

    width: int
    height: int
    calls: int
    top_mb: float
    left: int = 60
    right: int = 50
    top: int = 14
    bottom: int = 62

    @property
    def plot_w(self) -> int:
        """The plotting area's width."""
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> int:
        """The plotting area's height."""
        return self.height - self.top - self.bottom

    def x(self, i: float) -> float:
        """x of forward call `i` (0-based)."""
        return self.left + (self.plot_w * i / max(self.calls - 1, 1))

    def y_mb(self, v: float | None) -> float | None:
        """y of `v` MB on the left axis; None for None."""
        return None if v is None else self.top + self.plot_h * (1 - v / self.top_mb)

    def y_conf(self, v: float) -> float:
        """y of confidence `v` on the right axis, clipped to [0, 1]."""
        return self.top + self.plot_h * (1 - min(max(v, 0.0), 1.0))


def _grid_svg(area: _PlotArea) -> list[str]:
    """The SVG's opening tag, the plotting area and its quarter grid lines, ticked in MB on the
    left axis and in confidence on the right."""
    left, top, plot_w, plot_h = area.left, area.top, area.plot_w, area.plot_h
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{area.width}" height="{area.height}" '
        f'viewBox="0 0 {area.width} {area.height}" font-family="sans-serif" font-size="11">',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
        'stroke="#ccc"/>',
    ]
    for frac in (0, 0.25, 0.5, 0.75, 1):
        yy = top + plot_h * (1 - frac)
        parts.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
        )
        parts.append(
            f'<text x="{left - 4}" y="{yy + 4:.1f}" text-anchor="end" fill="#1f77b4">'
            f"{area.top_mb * frac:.1f}</text>"
        )
        parts.append(
            f'<text x="{left + plot_w + 4}" y="{yy + 4:.1f}" fill="#d62728">{frac:.2f}</text>'
        )
    return parts


def _step_marks_svg(
    area: _PlotArea, xs: list[float], kv_steps: list[dict[str, Any]], steps: list[dict[str, Any]]
) -> list[str]:
    """A dashed vertical mark, labelled with the step, at the first forward call of each step
    (`_step_of_calls`; none without step records); `xs` is each call's x."""
    parts = []
    owners = _step_of_calls(kv_steps, steps) if steps else []
    for i, owner in enumerate(owners):
        if owner is not None and (i == 0 or owners[i - 1] != owner):
            parts.append(
                f'<line class="step-mark" x1="{xs[i]:.1f}" x2="{xs[i]:.1f}" y1="{area.top}" '
                f'y2="{area.top + area.plot_h}" stroke="#999" stroke-dasharray="2 3"/>'
                f'<text x="{xs[i] + 3:.1f}" y="{area.top + 11}" fill="#666">'
                f"step {steps[owner].get('step', owner + 1)}</text>"
            )
    return parts


def _series_svg(area: _PlotArea, drawn: list[tuple[str, str, str, str, list[str]]]) -> list[str]:
    """The polylines of each series drawn, `(class, colour, dash, legend, polylines)`, and
    their legend below the axis, three to a row."""
    parts = []
    for i, (name, colour, dash, label, lines) in enumerate(drawn):
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        width_px = 1 if name == "confidence" else 1.2
        parts += [
            f'<polyline points="{line}" class="{name}" fill="none" stroke="{colour}" '
            f'stroke-width="{width_px}"{dashed}/>'
            for line in lines
        ]
        legend_x = area.left + area.plot_w * (i % 3) / 3
        legend_y = area.top + area.plot_h + 32 + 14 * (i // 3)
        parts.append(
            f'<text x="{legend_x:.0f}" y="{legend_y}" fill="{colour}">&#9632; {label}</text>'
        )
    return parts


def _axis_labels_svg(area: _PlotArea) -> list[str]:
    """The x axis's first and last call numbers and the three axis titles, and the SVG's
    closing tag."""
    left, top, plot_w, plot_h, width = area.left, area.top, area.plot_w, area.plot_h, area.width
    return [
        f'<text x="{left}" y="{top + plot_h + 14}">forward call 1</text>',
        f'<text x="{left + plot_w}" y="{top + plot_h + 14}" text-anchor="end">{area.calls}</text>',
        f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h + 14}" text-anchor="middle">'
        "forward calls (prefill chunks and decode tokens)</text>",
        f'<text x="12" y="{top + plot_h / 2:.0f}" fill="#1f77b4" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + plot_h / 2:.0f})">KV (MB)</text>',
        f'<text x="{width - 8}" y="{top + plot_h / 2:.0f}" fill="#d62728" text-anchor="middle" '
        f'transform="rotate(90 {width - 8} {top + plot_h / 2:.0f})">confidence</text>',
        "</svg>",
    ]


def render_trace(trace_dir: Path) -> str:
    """The HTML page of the trace in `trace_dir` (see the module docstring).

    Raises:
        TraceError: see `load_trace`.
    """
    data = load_trace(Path(trace_dir))
    prompt_views(data["steps"])
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    template = env.get_template("trace.html")
    summary, task = data["summary"], data["task"]
    return template.render(
        title=Path(trace_dir).resolve().name,
        task=task,
        expected=expected_answer(task) if task else [],
        verdict=verdict(summary) if summary else [],
        summary=summary,
        steps=data["steps"],
        kv_calls=len(data["kv_steps"]),
        plot=kv_plot_svg(data["kv_steps"], data["steps"]),
    )


def write_trace_html(trace_dir: Path) -> Path:
    """Write `trace_dir/trace.html` and return its path.

    Raises:
        TraceError: see `load_trace`, or the page cannot be written.
    """
    html = render_trace(trace_dir)
    path = Path(trace_dir) / TRACE_HTML
    try:
        path.write_text(html, encoding="utf-8")
    except OSError as err:
        raise TraceError(f"cannot write {path}: {err.strerror or err}") from None
    return path
