"""`agent-kv trace DIR`: one self-contained HTML page from an episode trace."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from agent_kv.cli import app
from agent_kv.harness.trace_view import TraceError, kv_plot_svg, load_trace, write_trace_html


def _png(color: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def fake_trace(tmp_path: Path) -> Path:
    """Two steps (the first with a set-of-marks image), six forward calls, a summary."""
    trace = tmp_path / "task1-window"
    trace.mkdir()
    for step, (reply, action) in enumerate(
        [("click [12]", "click [12]"), ("stop [<b>$120</b>]", "stop [<b>$120</b>]")], start=1
    ):
        record = {
            "step": step,
            "url": f"http://127.0.0.1/listing/{step}",
            "observation": f"[12] link 'Blue road bike' step {step}",
            "reply": reply,
            "action": action,
            "error": None,
            "kv_bytes": 2_000_000,
            "peak_kv_bytes": 3_000_000,
            "tokens_seen": 100 * step,
        }
        (trace / f"step_{step:03d}.json").write_text(json.dumps(record))
        (trace / f"step_{step:03d}.png").write_bytes(_png("blue"))
    (trace / "step_001.som.png").write_bytes(_png("red"))
    with (trace / "kv_steps.jsonl").open("w") as handle:
        for i in range(6):
            kv = 1_000_000 * (i % 3 + 1)
            handle.write(
                json.dumps(
                    {
                        "seen_tokens": 50 * (i + 1),
                        "appended_kv_bytes": kv + 500_000,
                        "kv_bytes": kv,
                        "confidence": i / 5,
                        "gated": True,
                        "budget": 256,
                        "evicted": 3,
                    }
                )
                + "\n"
            )
    (trace / "summary.json").write_text(
        json.dumps({"task_id": 1, "policy": "window", "success": True, "steps": 2})
    )
    return trace


def test_html_trace_from_a_fake_trace_dir(fake_trace: Path):
    path = write_trace_html(fake_trace)
    assert path == fake_trace / "trace.html"
    html = path.read_text()
    blue = base64.b64encode(_png("blue")).decode()
    red = base64.b64encode(_png("red")).decode()
    assert html.count(f"data:image/png;base64,{blue}") == 2  # one screenshot per step
    assert html.count(f"data:image/png;base64,{red}") == 1  # the set-of-marks image
    assert "<svg" in html and html.count("<polyline") == 2
    assert "over 6 forward calls" in html
    assert html.count("<details>") == 2 and "Blue road bike&#39; step 2" in html
    assert "stop [&lt;b&gt;$120&lt;/b&gt;]" in html  # replies are escaped
    assert "<b>$120" not in html
    assert 'id="step-1"' in html and 'id="step-2"' in html
    assert 'src="http' not in html  # nothing fetched from outside


def test_sawtooth_plot_has_two_points_per_call():
    records = [{"appended_kv_bytes": 3e6, "kv_bytes": 1e6, "confidence": 0.5}] * 4
    svg = kv_plot_svg(records)
    saw = svg.split('<polyline points="')[1].split('"')[0].split()
    assert len(saw) == 8
    assert kv_plot_svg([]) == ""


def test_load_trace_refuses_what_is_not_a_trace(tmp_path: Path):
    with pytest.raises(TraceError, match="not a directory"):
        load_trace(tmp_path / "missing")
    with pytest.raises(TraceError, match="not an episode trace"):
        load_trace(tmp_path)
    (tmp_path / "step_001.json").write_text("{broken")
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path)


def test_trace_cli(fake_trace: Path, tmp_path: Path):
    runner = CliRunner()
    result = runner.invoke(app, ["trace", str(fake_trace)])
    assert result.exit_code == 0, result.stderr
    assert (fake_trace / "trace.html").stat().st_size > 1000
    bad = runner.invoke(app, ["trace", str(tmp_path / "nope")])
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.browser
@pytest.mark.model
def test_html_trace_from_a_real_one_step_episode(tmp_path: Path):
    from agent_kv.cli import _run
    from agent_kv.kv.policy_spec import PolicySpec
    from envs.tasks import load_task

    summary = _run(
        load_task(1), PolicySpec.parse("window", 256, None), None, 1, 1200, 512, "som", tmp_path
    )
    trace = Path(summary["trace_dir"])
    html = write_trace_html(trace).read_text()
    assert html.count("data:image/png;base64,") >= 2  # the screenshot and its set-of-marks
    assert "<svg" in html and 'id="step-1"' in html
