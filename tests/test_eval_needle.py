"""The needle-in-a-haystack evaluation: its pure helpers, and one quick run on the model."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agent_kv.evals import needle
from agent_kv.evals.answers import is_right
from agent_kv.evals.report import EvalContext
from agent_kv.evals.texts import licence_text
from agent_kv.kv.cold_tier import ColdConfig


def test_insert_needle_puts_it_at_the_nearest_line_start():
    haystack = list(range(100, 200))
    breaks = [0, 10, 40, 55, 100]
    for depth, expected in [(0.0, 0), (0.3, 40), (0.5, 55), (0.8, 100), (1.0, 100)]:
        context, at = needle.insert_needle(haystack, [1, 2, 3], depth, breaks)
        assert at == expected
        assert context[at : at + 3] == [1, 2, 3]
        assert context[:at] + context[at + 3 :] == haystack


def test_line_breaks_follow_newline_tokens(smollm):
    ids = smollm.tokenizer("one two\nthree four\nfive", add_special_tokens=False)["input_ids"]
    breaks = needle.line_breaks(ids, smollm.tokenizer)
    assert breaks[0] == 0 and breaks[-1] == len(ids)
    starts = [smollm.tokenizer.decode(ids[b:]) for b in breaks[1:-1]]
    assert starts == ["three four\nfive", "five"]


@pytest.mark.parametrize(
    ("answer", "right"),
    [
        (" 58213. Remember", True),
        (" 58213", True),
        ("58213.\n", True),
        (" 582130", False),
        (" 5821", False),
        (" 1. 58213", False),
        (" not in the text", False),
    ],
)
def test_is_right_takes_the_first_run_of_digits(answer, right):
    assert is_right(answer, "58213") is right


SMALL_POLICIES = ["full", "conf-kv", "kvzip", "conf-kv+recall"]
"""The default run's policies: full KV, a budgeted one (with the paper's figure), KVzip (its
own peak) and a cold tier."""


@pytest.mark.model
@pytest.mark.parametrize("grid", ["small", pytest.param("quick", marks=pytest.mark.slow)])
def test_quick_run(smollm, tmp_path, monkeypatch, grid):
    """`slow`: the quick size (what `agent-kv eval needle --quick` runs: 45 trials); by
    default its lengths at two depths for four of its policies (14 trials)."""
    policies = needle.POLICIES
    if grid == "small":
        monkeypatch.setattr(needle, "QUICK", dataclasses.replace(needle.QUICK, depths=(0.0, 1.0)))
        policies = SMALL_POLICIES
    text_ids = smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    lines = []
    ctx = EvalContext(smollm, text_ids, True, tmp_path, lines.append, policies)
    report = needle.run(ctx)
    size = needle.QUICK
    labels = report.data["lengths"]
    assert len(labels) == len(size.lengths) + len(size.rerotate_lengths)
    trials, cells = report.data["trials"], report.data["cells"]

    # every policy x length x depth cell, its accuracy what its trials say
    keys = {(c["policy"], c["length"], c["depth"]) for c in cells}
    assert keys == {(p, n, d) for p in policies for n in labels for d in size.depths}
    for cell in cells:
        hits = [
            t
            for t in trials
            if (t["policy"], t["length"], t["depth"])
            == (cell["policy"], cell["length"], cell["depth"])
        ]
        assert cell["trials"] == len(hits)
        if cell["policy"] == "full" and "rerotate" in cell["length"]:
            assert hits == [] and cell["accuracy"] is None
            continue
        assert len(hits) == size.seeds
        assert cell["accuracy"] == sum(t["right"] for t in hits) / len(hits)
        assert 0.0 <= cell["accuracy"] <= 1.0
    for trial in trials:
        assert trial["right"] == is_right(trial["answer"], trial["key"])
        assert trial["peak_kv_allocated_bytes"] > 0
    assert len(lines) == len(trials)

    # full KV finds the key in short contexts; the budgeted policies hold less at the longest
    full = [t for t in trials if t["policy"] == "full"]
    assert sum(t["right"] for t in full) >= len(full) // 2
    longest = labels[len(size.lengths) - 1]
    peak = {
        t["policy"]: t["peak_kv_allocated_bytes"]
        for t in trials
        if t["length"] == longest and t["depth"] == 0
    }
    # KVzip's reconstruction pass holds a chunk and its repeat on top of the budget for a
    # moment: at this size that reaches full KV's allocation, never more
    assert all(peak[p] < peak["full"] for p in policies if p not in ("full", "kvzip"))
    assert peak["kvzip"] <= peak["full"]
    for trial in trials:  # the cold tier counted apart, only where there is one
        assert (trial["peak_cold_kv_bytes"] > 0) == trial["policy"].endswith("+recall")

    (figure,) = report.figures
    assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.write(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "91.4%" in summary and "n/a" in summary
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "needle" and len(saved["trials"]) == len(trials)


@pytest.mark.model
def test_lengths_and_recall_settings_replace_the_grid_and_are_reported(
    smollm, tiny_llama, tmp_path, monkeypatch
):
    monkeypatch.setattr(needle, "QUICK", dataclasses.replace(needle.QUICK, depths=(0.5,)))
    tiny = dataclasses.replace(smollm, model=tiny_llama, name="tiny-llama")  # 8,192 context
    text_ids = smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    recall = ColdConfig(pages=2, select="vote")
    ctx = EvalContext(tiny, text_ids, True, tmp_path, print, ["h2o+recall"], recall, (600, 9000))
    report = needle.run(ctx)
    assert report.data["lengths"] == ["600", "9000 rerotate"]  # past the model's 8,192
    assert report.data["recall"]["select"] == "vote" and report.data["recall"]["pages"] == 2
    assert [t["tokens"] for t in report.data["trials"]] == [600, 9000]
    assert "settings pages=2, select=vote" in report.markdown()
    written = [json.loads(line) for line in (tmp_path / needle.TRIALS).read_text().splitlines()]
    assert written == report.data["trials"]  # each trial written as it ended
    short = dataclasses.replace(ctx, text_ids=text_ids[:5000], lengths=(600, 6000))
    with pytest.raises(ValueError, match="too short for a 6000-token context"):
        needle.run(short)  # refused before any trial, the last run's trials left as they were
    assert (tmp_path / needle.TRIALS).read_text().count("\n") == 2


def test_the_command_line_checks_lengths_and_recall_settings():
    from typer.testing import CliRunner

    from agent_kv.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["eval", "perplexity", "--lengths", "1024"])
    assert result.exit_code != 0 and "--lengths applies to needle only" in result.output
    result = runner.invoke(app, ["eval", "needle", "--lengths", "1K"])
    assert result.exit_code != 0 and "comma-separated whole numbers" in result.output
    result = runner.invoke(app, ["eval", "needle", "--recall-param", "select=all"])
    assert result.exit_code != 0 and "select must be one of layer, vote" in result.output
