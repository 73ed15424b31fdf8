"""`agent-kv trace DIR`: one self-contained HTML page from an episode trace."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import random_tokens, with_old_names
from PIL import Image
from typer.testing import CliRunner

from agent_kv.cli import app
from agent_kv.harness.trace_view import (
    TraceError,
    kv_plot_svg,
    load_trace,
    step_cache_fields,
    token_pieces,
    write_trace_html,
)
from agent_kv.kv.store import KVStore


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
            "kv_allocated_bytes": 2_500_000,
            "kv_live_bytes": 2_000_000,
            "peak_kv_allocated_bytes": 3_600_000,
            "peak_kv_live_bytes": 3_000_000,
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
                        "appended_kv_live_bytes": kv + 500_000,
                        "kv_live_bytes": kv,
                        "kv_allocated_bytes": kv + 800_000,
                        "confidence": i / 5,
                        "gated": True,
                        "budget": 256,
                        "evicted": 3,
                    }
                )
                + "\n"
            )
    summary = {"task_id": 1, "policy": "window", "success": True, "steps": 2}
    summary |= {"peak_kv_allocated_bytes": 3_600_000, "full_kv_allocated_bytes": 9_000_000}
    (trace / "summary.json").write_text(json.dumps(summary))
    return trace


def test_html_trace_from_a_fake_trace_dir(fake_trace: Path):
    path = write_trace_html(fake_trace)
    assert path == fake_trace / "trace.html"
    html = path.read_text()
    blue = base64.b64encode(_png("blue")).decode()
    red = base64.b64encode(_png("red")).decode()
    assert html.count(f"data:image/png;base64,{blue}") == 2  # one screenshot per step
    assert html.count(f"data:image/png;base64,{red}") == 1  # the set-of-marks image
    assert "<svg" in html and html.count("<polyline") == 3  # live, allocated, confidence
    assert "KV 2.5 MB allocated, 2.0 MB live (peak 3.6 MB allocated, 3.0 MB live)" in html
    assert "over 6 forward calls" in html
    assert "<td>peak_kv_allocated_bytes</td><td>3600000</td>" in html
    assert html.count("<details>") == 2 and "Blue road bike&#39; step 2" in html
    assert "stop [&lt;b&gt;$120&lt;/b&gt;]" in html  # replies are escaped
    assert "<b>$120" not in html
    assert 'id="step-1"' in html and 'id="step-2"' in html
    assert 'src="http' not in html  # nothing fetched from outside


def test_a_trace_written_with_the_old_names_renders_as_in_the_new(fake_trace: Path):
    html = write_trace_html(fake_trace).read_text()
    current = load_trace(fake_trace)
    for path in [*fake_trace.glob("step_*.json"), fake_trace / "summary.json"]:
        path.write_text(json.dumps(with_old_names(json.loads(path.read_text()))))
    kv_path = fake_trace / "kv_steps.jsonl"
    lines = kv_path.read_text().splitlines()
    kv_path.write_text("".join(json.dumps(with_old_names(json.loads(x))) + "\n" for x in lines))
    assert '"peak_kv_bytes"' in (fake_trace / "summary.json").read_text()
    assert '"allocated_kv_bytes"' in kv_path.read_text()
    assert load_trace(fake_trace) == current
    assert write_trace_html(fake_trace).read_text() == html


def test_sawtooth_plot_has_two_points_per_call():
    records = [{"appended_kv_live_bytes": 3e6, "kv_live_bytes": 1e6, "confidence": 0.5}] * 4
    svg = kv_plot_svg(records)
    saw = svg.split('<polyline points="')[1].split('"')[0].split()
    assert len(saw) == 8
    assert svg.count("<polyline") == 2  # records without allocated bytes draw no such line
    assert kv_plot_svg([]) == ""


def test_allocated_bytes_plot_as_one_point_per_call_on_the_same_axis():
    records = [{"appended_kv_live_bytes": 2e6, "kv_live_bytes": 1e6, "kv_allocated_bytes": 4e6}]
    records *= 3
    svg = kv_plot_svg(records)
    held = svg.split('<polyline points="')[2].split('"')[0].split()
    assert len(held) == 3
    assert {float(point.split(",")[1]) for point in held} == {14.0}  # the axis top: 4 MB
    assert ">4.0</text>" in svg


MB = 1_000_000


@pytest.fixture
def cached_trace(tmp_path: Path) -> Path:
    """Two steps over 4 layers with known cache states, four forward calls, the task and
    the verdict.

    Positions: step 1 feeds 0-7 (system 0-2 and observation 3-5 pinned, header 6, reply 7);
    step 2 feeds 8-13 (observation 8-11 pinned, header 12, reply 13). After step 2 the
    released step-1 observation is INT8 in every layer (3), evicted from every layer (4), and
    FP in 1, INT8 in 1, evicted from 2 layers (5). One token costs 1 MB; the budget is 2
    unpinned tokens per layer."""
    trace = tmp_path / "task1-conf-kv"
    trace.mkdir()
    steps = [
        {
            "step": 1,
            "reply": "click [1]",
            "action": "click [1]",
            "observation": "page one",
            "tokens_seen": 8,
            "step_s": 1.25,
            "token_start": 0,
            "tokens": ["SYS", " goal", "\n", "PAGE1", " price", " <b>", "\nA:", " click [1]"],
            "observation_span": [3, 6],
            "reply_span": [7, 8],
            "kv_layers": 4,
            "kv_bytes_per_token": MB,
            "kv_quantized_format": None,
            "kv_states": [[0, 8, 4, 0]],
            "pinned_spans": [[0, 6]],
            "pinned_tokens": 6,
        },
        {
            "step": 2,  # no step_s: the summary's is shown
            "reply": "stop [$120]",
            "action": "stop [$120]",
            "observation": "page two",
            "tokens_seen": 14,
            "token_start": 8,
            "tokens": ["PAGE2", " a", " b", " c", "\nA:", " stop [$120]"],
            "observation_span": [8, 12],
            "reply_span": [13, 14],
            "kv_layers": 4,
            "kv_bytes_per_token": MB,
            "kv_quantized_format": "int8",
            "kv_states": [[0, 3, 4, 0], [3, 4, 0, 4], [4, 5, 0, 0], [5, 6, 1, 1], [6, 14, 4, 0]],
            "pinned_spans": [[0, 3], [8, 12]],
            "pinned_tokens": 7,
        },
    ]
    for record in steps:
        (trace / f"step_{record['step']:03d}.json").write_text(json.dumps(record))
    calls = [(7, 7 * MB), (8, 8 * MB), (13, 10 * MB), (14, 10 * MB)]
    (trace / "kv_steps.jsonl").write_text(
        "".join(
            json.dumps({"seen_tokens": seen, "kv_live_bytes": live, "confidence": 0.5, "budget": 2})
            + "\n"
            for seen, live in calls
        )
    )
    task = {
        "task_id": 1,
        "intent": "What is the price of the Blue road bike?",
        "eval": {
            "eval_types": ["string_match", "url_match"],
            "reference_answers": {"must_include": ["120"], "exact_match": None},
            "reference_url": "__CLASSIFIEDS__/listing/1",
            "url_note": "GOLD in PRED",
        },
    }
    (trace / "task.json").write_text(json.dumps(task))
    details = {
        "string_match": {"score": 1.0, "answer": "$120", "checks": {"must_include": [True]}},
        "url_match": {"score": 0.0, "final_url": "http://127.0.0.1/listing/2"},
    }
    summary = {"task_id": 1, "score": 0.0, "answer": "$120", "end_reason": "stop"}
    summary |= {"eval_details": details, "step_s": [1.25, 2.5]}
    (trace / "summary.json").write_text(json.dumps(summary))
    return trace


def _prompt_of(html: str, step: int) -> str:
    """The prompt view of one step of the page."""
    return html.split(f"<summary>Prompt after step {step}:")[1].split("</details>")[0]


def test_page_shows_the_goal_the_expected_answer_and_the_verdict(cached_trace: Path):
    html = write_trace_html(cached_trace).read_text()
    assert "<strong>What is the price of the Blue road bike?</strong>" in html
    assert "Expected (string_match)</td><td><code>must_include: [&#34;120&#34;]</code>" in html
    assert "Expected (url_match)</td><td><code>__CLASSIFIEDS__/listing/1 (GOLD in PRED)" in html
    assert "Answer</td><td><code>$120</code>" in html
    assert '<span class="fail">score 0.0</span> (ended: stop)' in html
    assert "string_match</td><td>score 1.0: <code>answer: $120; checks: " in html
    assert "url_match</td><td>score 0.0: <code>final_url: http://127.0.0.1/listing/2" in html


def test_prompt_marks_each_token_by_its_state_in_the_cache(cached_trace: Path):
    html = write_trace_html(cached_trace).read_text()
    assert html.count('<details class="wide">') == 2  # one prompt per step, collapsed
    first, second = _prompt_of(html, 1), _prompt_of(html, 2)
    # after step 1 everything is FP: the pinned system prompt and observation, then plain
    assert '<span class="pin" title="pinned: FP in all 4 layers">SYS goal\n</span>' in first
    reply_1 = '\nA:<span class="mark">step 1 reply</span> click [1]'  # header, mark, reply
    assert reply_1 in first and "q4" not in first and "e4" not in first
    # after step 2 the released observation is INT8, evicted, or mixed, per token
    assert '<span class="q4" title="FP 0, INT8 4, evicted 0 of 4 layers">PAGE1</span>' in second
    assert '<span class="e4" title="FP 0, INT8 0, evicted 4 of 4 layers"> price</span>' in second
    assert '<span class="q1 e2" title="FP 1, INT8 1, evicted 2 of 4 layers"> &lt;b&gt;' in second
    assert '<span class="pin" title="pinned: FP in all 4 layers">PAGE2 a b c</span>' in second
    assert reply_1 in second  # header and reply stay FP: plain text
    # step boundaries: where each step's observation and reply begin, up to that step
    marks = re.findall(r'<span class="mark">([^<]*)</span>', second)
    assert marks == ["step 1 observation", "step 1 reply", "step 2 observation", "step 2 reply"]
    assert re.findall(r'<span class="mark">([^<]*)</span>', first) == marks[:2]
    # the shares of the 14 x 4 token-layer slots: 45 FP, 5 INT8, 6 evicted
    assert "14 tokens, 7 pinned; of token-layer slots 80% FP, 9% INT8, 11% evicted" in html


def test_each_step_shows_its_wall_time(cached_trace: Path):
    html = write_trace_html(cached_trace).read_text()
    assert "<h3>Step 1 <small>(1.25 s)</small></h3>" in html  # from the step record
    assert "<h3>Step 2 <small>(2.50 s)</small></h3>" in html  # from summary.json's step_s


def _polyline_ys(svg: str, name: str) -> list[list[float]]:
    """The y coordinates of each polyline of class `name`."""
    lines = re.findall(rf'<polyline points="([^"]*)" class="{name}"', svg)
    return [[float(point.split(",")[1]) for point in line.split()] for line in lines]


def test_plot_draws_the_budget_the_full_kv_line_and_step_marks(cached_trace: Path):
    data = load_trace(cached_trace)
    svg = kv_plot_svg(data["kv_steps"], data["steps"])
    # the axis tops at full KV's 14 MB; plot area from y=14, 214 px high
    assert _polyline_ys(svg, "full-kv") == [[121.0, 105.7, 29.3, 14.0]]  # 7, 8, 13, 14 MB
    # (2 unpinned tokens + 6 pinned) x 1 MB in step 1, (2 + 7) in step 2
    assert _polyline_ys(svg, "budget") == [[105.7, 105.7, 90.4, 90.4]]
    marks = re.findall(r'<line class="step-mark" x1="([\d.]+)"', svg)
    assert marks == ["60.0", "626.7"]  # calls 1 and 3 begin steps 1 and 2
    assert ">step 1</text>" in svg and ">step 2</text>" in svg
    assert "budget: (budget + pinned)" in svg and "full KV: tokens seen" in svg
    unlimited = [{**r, "budget": None} for r in data["kv_steps"]]
    svg = kv_plot_svg(unlimited, data["steps"])  # e.g. full KV: no budget
    assert _polyline_ys(svg, "budget") == [] and "budget:" not in svg
    gap = [{**r, "budget": None} if i == 1 else r for i, r in enumerate(data["kv_steps"])]
    assert len(_polyline_ys(kv_plot_svg(gap, data["steps"]), "budget")) == 2


class _ByteTokenizer:
    """Each id is a fixed byte string; decoding joins them as UTF-8, like a byte-level BPE."""

    BYTES = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b" b"}

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.BYTES[i] for i in ids).decode("utf-8", errors="replace")


def test_token_pieces_give_a_split_character_to_the_token_that_completes_it():
    assert token_pieces(_ByteTokenizer(), [1, 2, 3, 4]) == ["a", "", "\u00e9", " b"]
    assert token_pieces(_ByteTokenizer(), [1, 2]) == ["a", "\ufffd"]  # cut: shown as it is


def test_step_cache_fields_run_length_encode_the_states_of_every_position():
    store = KVStore(2, 1, 4)
    random_tokens(store, 6)
    store.pins.pin(0, 2)
    store.compact(0, torch.tensor([0, 1, 2, 3, 5]))  # layer 0 evicts position 4
    store.precision.quantize_slots(1, 0, torch.tensor([2, 3]), group=2, fmt="int8")  # layer 1: INT8
    chat = SimpleNamespace(
        sequence=SimpleNamespace(store=store, token_ids=[1, 2, 3, 4, 1, 4]),
        engine=SimpleNamespace(tokenizer=_ByteTokenizer()),
        spans={0: (0, 4), 1: (4, 6)},
        messages=[{}, {}],
    )
    fields = step_cache_fields(chat, 1, observation=0)
    assert fields == {
        "token_start": 1,
        "tokens": ["", "\u00e9", " b", "a", " b"],
        "observation_span": [0, 4],
        "reply_span": [4, 6],
        "kv_layers": 2,
        "kv_bytes_per_token": store.bytes_per_token(),
        "kv_quantized_format": "int8",
        "kv_states": [[0, 2, 2, 0], [2, 4, 1, 1], [4, 5, 1, 0], [5, 6, 2, 0]],
        "pinned_spans": [[0, 2]],
        "pinned_tokens": 2,
    }
    json.dumps(fields)  # plain values, ready for the step record


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
    from agent_kv.cli.episode import _run
    from agent_kv.harness.agent import AgentConfig
    from agent_kv.kv.policy_spec import PolicySpec
    from envs.tasks import load_task

    summary = _run(
        load_task(1),
        "free",
        PolicySpec.parse("window", 256, None),
        "smollm2-135m",
        "fp32",
        AgentConfig(max_steps=1),
        512,
        "som",
        tmp_path,
        False,  # --no-compile: decode steps eager (test_decode_graph.py checks the compiled one)
    )
    trace = Path(summary["trace_dir"])
    assert json.loads((trace / "task.json").read_text())["eval"]["reference_answers"] == {
        "exact_match": None, "must_include": ["120"], "must_exclude": None, "one_of": None,
        "fuzzy_match": None,
    }  # fmt: skip
    step = json.loads((trace / "step_001.json").read_text())
    assert step["step_s"] == summary["step_s"][0] > 0
    assert step["token_start"] == 0 and len(step["tokens"]) == step["tokens_seen"]
    runs = step["kv_states"]
    assert runs[0][0] == 0 and runs[-1][1] == step["tokens_seen"]
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))  # contiguous
    assert step["pinned_tokens"] == sum(end - start for start, end in step["pinned_spans"])
    obs_start, obs_end = step["observation_span"]
    assert "Page:" in "".join(step["tokens"][obs_start:obs_end])
    html = write_trace_html(trace).read_text()
    assert html.count("data:image/png;base64,") >= 2  # the screenshot and its set-of-marks
    assert "<svg" in html and 'id="step-1"' in html
    assert "What is the price of the Blue road bike?" in html and "must_include" in html
    assert '<span class="mark">step 1 observation</span>' in html
    assert 'class="full-kv"' in html and 'class="budget"' in html
