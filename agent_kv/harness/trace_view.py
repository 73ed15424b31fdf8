"""An episode trace as one self-contained HTML page (`agent-kv trace DIR` -> `DIR/trace.html`).

The trace directory is what `agent.run_episode` writes: per step `step_NNN.json` (observation,
reply, parsed action, KV figures) and `step_NNN.png` (the screenshot acted on), optionally a
set-of-marks image `step_NNN.som.png`, plus `kv_steps.jsonl` (one record per forward call) and
`summary.json`. The page shows the summary, an inline SVG plot of live KV bytes (after each
call appended: the peaks; after the policy evicted: the troughs, so the sawtooth) and of the
confidence over the episode's forward calls, then per step the screenshot(s), the
observation text (collapsible), the reply and the parsed action. Images are embedded as
base64, so the file can be moved or mailed alone.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from agent_kv.errors import AgentKVError

TEMPLATES = Path(__file__).resolve().parent / "templates"
TRACE_HTML = "trace.html"
_STEP = re.compile(r"step_(\d+)\.json$")


class TraceError(AgentKVError):
    """A directory that is not a readable episode trace; the message is one line."""


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
        `summary` (dict or None), `kv_steps` (list of records), `steps` (per step: the
        step_NNN.json record plus `screenshot` and `som` data URIs or None).

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
    steps = []
    for number, path in step_files:
        record = _read_json(path)
        if not isinstance(record, dict):
            raise TraceError(f"{path}: expected a JSON object")
        stem = f"step_{number:03d}"
        record["screenshot"] = _image(trace_dir / f"{stem}.png")
        record["som"] = _image(trace_dir / f"{stem}.som.png") or _image(
            trace_dir / f"{stem}_som.png"
        )
        record.setdefault("step", number)
        steps.append(record)
    kv_steps = []
    if kv_path.exists():
        try:
            lines = kv_path.read_text(encoding="utf-8").splitlines()
            kv_steps = [json.loads(line) for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TraceError(f"{kv_path}: cannot read: {err}") from None
    summary_path = trace_dir / "summary.json"
    summary = _read_json(summary_path) if summary_path.exists() else None
    return {"summary": summary, "kv_steps": kv_steps, "steps": steps}


def kv_plot_svg(kv_steps: list[dict[str, Any]], width: int = 960, height: int = 260) -> str:
    """An inline SVG: live KV bytes in MB (left axis; after each forward call appended, then
    after its eviction, drawn as one sawtooth line) and confidence in [0, 1] (right axis)
    against the forward call index. An empty string for no records."""
    if not kv_steps:
        return ""
    left, right, top, bottom = 60, 50, 14, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    n = len(kv_steps)
    mb = [
        (r.get("appended_kv_bytes", r.get("kv_bytes", 0)) / 1e6, r.get("kv_bytes", 0) / 1e6)
        for r in kv_steps
    ]
    top_mb = max(max(a, b) for a, b in mb) or 1.0

    def x(i: float) -> float:
        return left + (plot_w * i / max(n - 1, 1))

    def y_mb(v: float) -> float:
        return top + plot_h * (1 - v / top_mb)

    def y_conf(v: float) -> float:
        return top + plot_h * (1 - min(max(v, 0.0), 1.0))

    saw = []
    for i, (appended, kept) in enumerate(mb):
        saw.append(f"{x(i):.1f},{y_mb(appended):.1f}")
        saw.append(f"{x(i):.1f},{y_mb(kept):.1f}")
    conf = " ".join(
        f"{x(i):.1f},{y_conf(float(r.get('confidence', 0.0))):.1f}" for i, r in enumerate(kv_steps)
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
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
            f"{top_mb * frac:.1f}</text>"
        )
        parts.append(
            f'<text x="{left + plot_w + 4}" y="{yy + 4:.1f}" fill="#d62728">{frac:.2f}</text>'
        )
    parts += [
        f'<polyline points="{" ".join(saw)}" fill="none" stroke="#1f77b4" stroke-width="1.2"/>',
        f'<polyline points="{conf}" fill="none" stroke="#d62728" stroke-width="1" '
        'stroke-opacity="0.7"/>',
        f'<text x="{left}" y="{height - 8}">forward call 1</text>',
        f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end">{n}</text>',
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle">'
        "forward calls (prefill chunks and decode tokens)</text>",
        f'<text x="12" y="{top + plot_h / 2:.0f}" fill="#1f77b4" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + plot_h / 2:.0f})">KV (MB)</text>',
        f'<text x="{width - 8}" y="{top + plot_h / 2:.0f}" fill="#d62728" text-anchor="middle" '
        f'transform="rotate(90 {width - 8} {top + plot_h / 2:.0f})">confidence</text>',
        "</svg>",
    ]
    return "\n".join(parts)


def render_trace(trace_dir: Path) -> str:
    """The HTML page of the trace in `trace_dir` (see the module docstring).

    Raises:
        TraceError: see `load_trace`.
    """
    data = load_trace(Path(trace_dir))
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    template = env.get_template("trace.html")
    return template.render(
        title=Path(trace_dir).resolve().name,
        summary=data["summary"],
        steps=data["steps"],
        kv_calls=len(data["kv_steps"]),
        plot=kv_plot_svg(data["kv_steps"]),
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
