"""The latency evaluation at its quick size: every row measured, nothing about speed asserted."""

from __future__ import annotations

import json
import math

import pytest

from agent_kv.evals import latency
from agent_kv.evals.report import EvalContext
from agent_kv.evals.texts import licence_text

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def quick_report(smollm, tmp_path_factory):
    out = tmp_path_factory.mktemp("latency")
    text_ids = smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    lines: list[str] = []
    report = latency.run(EvalContext(smollm, text_ids, True, out, lines.append))
    report.write(out)
    return report, out, lines


def _finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_every_batch1_context_measured(quick_report):
    report, _, _ = quick_report
    size = latency.QUICK
    rows = report.data["batch1"]
    assert [row["context"] for row in rows] == list(size.contexts)
    for row in rows:
        for label in latency.POLICIES:
            measured = row[label]
            assert len(measured["step_s"]) == size.steps
            assert all(_finite_positive(s) for s in measured["step_s"])
            assert _finite_positive(measured["prefill_s"])
            assert _finite_positive(measured["median_ms"])
            assert 0 <= measured["policy_share"] < 1
            assert measured["seen_tokens"] == row["context"] + size.steps
        assert _finite_positive(row["speedup_median"])
    # full KV keeps every token; conf-kv evicted at the longer context
    longest = rows[-1]
    assert longest["full"]["live_tokens"] == longest["context"] + size.steps
    assert longest["conf-kv"]["kv_live_bytes"] < longest["full"]["kv_live_bytes"]
    assert longest["conf-kv"]["live_tokens"] <= size.budget


def test_batch8_generates_what_was_asked(quick_report):
    report, _, _ = quick_report
    size = latency.QUICK
    runs = report.data["batch8_runs"]
    assert {(r["context"], r["policy"]) for r in runs} == {
        (n, p) for n in size.batch_contexts for p in latency.POLICIES
    }
    for r in runs:
        assert r["rows"] == latency.BATCH
        assert r["per_row_generated"] == [size.new_tokens] * latency.BATCH
        assert r["generated"] == latency.BATCH * size.new_tokens
        assert _finite_positive(r["decode_s"]) and r["wall_s"] > r["decode_s"]
    pooled = report.data["batch8"]
    assert [row["context"] for row in pooled] == list(size.batch_contexts)
    for row in pooled:
        for label in latency.POLICIES:
            assert row[label]["generated"] == row[label]["asked"]
            assert _finite_positive(row[label]["tokens_per_s"])
            assert _finite_positive(row[label]["batch1_tokens_per_s"])
        assert _finite_positive(row["throughput_ratio"])


def test_report_files_and_tables(quick_report):
    report, out, lines = quick_report
    assert report.figures == ["latency.png"]
    png = out / "latency.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    summary = (out / "summary.md").read_text()
    assert "1.8x" in summary and "2.06x" in summary
    assert json.loads((out / "results.json").read_text())["experiment"] == "latency"
    single, memory, batch = report.tables
    assert len(single.rows) == len(latency.QUICK.contexts) == len(memory.rows)
    assert len(batch.rows) == len(latency.QUICK.batch_contexts)
    assert lines, "progress is logged"
