"""The evaluation suite's pipeline at its quick sizes: perplexity, ablations and ARKV retrieval
on the real model, the `all` runner's gathered summary, and the command's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agent_kv.evals import ablations, experiment_names, perplexity, run_experiments
from agent_kv.evals.answers import is_right
from agent_kv.evals.arkv import build_context
from agent_kv.evals.perplexity import (
    QUICK,
    Sizes,
    Totals,
    gap_closed,
    int8_budget,
    segments,
    variants,
)
from agent_kv.evals.report import Report, Table
from agent_kv.evals.texts import licence_text
from agent_kv.kv.store import Int8Config
from tests.test_cli import run_cli


@pytest.fixture(scope="module")
def text_ids(smollm) -> list[int]:
    return smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]


def _results(directory: Path) -> dict:
    assert (directory / "summary.md").read_text().startswith("## ")
    return json.loads((directory / "results.json").read_text())


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_segments_spread_over_the_text():
    ids = list(range(100))
    assert segments(ids, 40, 3) == [ids[0:40], ids[30:70], ids[60:100]]
    assert segments(ids, 40, 1) == [ids[0:40]]
    with pytest.raises(ValueError, match="fewer than 200"):
        segments(ids, 200, 1)


def test_table_refuses_a_row_of_the_wrong_width_and_json_has_no_nan(tmp_path):
    table = Table("t", ["a", "b"])
    with pytest.raises(ValueError, match="1 cells for 2 columns"):
        table.add(1)
    Report("x", "X", "setup", [table], data={"r": float("nan"), "s": [1.5, float("inf")]}).write(
        tmp_path
    )
    assert json.loads((tmp_path / "results.json").read_text())["s"] == [1.5, None]


def test_unknown_experiment_is_named():
    assert experiment_names("all")[0] == "perplexity"
    with pytest.raises(ValueError, match="unknown experiment 'bogus'"):
        experiment_names("bogus")


def test_cli_errors_are_one_line(tmp_path):
    proc = run_cli("eval", "bogus", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown experiment 'bogus': choose all or one of perplexity, ablations, "
        "needle, mechanistic, latency, arkv"
    ]
    proc = run_cli("eval", "arkv", "--text", str(tmp_path / "missing.txt"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: cannot read the text") and "missing.txt" in proc.stderr


@pytest.mark.model
def test_the_plain_window_row_keeps_no_sinks_and_the_other_four(smollm):
    windows = {v.label: v.policy.sinks for v in variants(smollm, QUICK) if "window" in v.label}
    assert windows == {f"window {QUICK.window}": 0, f"window {QUICK.window} + 4 sinks": 4}


SMALL = Sizes(lengths=(320,), segments=1, window=136, int8=Int8Config(fp_window=64, group=16))
"""Half the quick size's tokens: N_low = 281 tokens in the bytes of the 136-token window, fewer
than the 320 scored, so CONF-KV evicts at both of its budgets (whose halves pass its
protect_recent, 64)."""


@pytest.mark.parametrize("size", ["small", pytest.param("quick", marks=pytest.mark.slow)])
def test_perplexity_and_ablations_quick(smollm, text_ids, tmp_path, monkeypatch, size):
    """`slow`: the quick size (what `agent-kv eval perplexity --quick` runs, 640 tokens); by
    default `SMALL`."""
    if size == "small":
        for module in (perplexity, ablations):
            monkeypatch.setattr(module, "QUICK", SMALL)
    sizes = perplexity.QUICK  # the size the run uses
    reports = run_experiments(["perplexity", "ablations"], smollm, text_ids, tmp_path, quick=True)
    assert [r.experiment for r in reports] == ["perplexity", "ablations"]
    gathered = (tmp_path / "summary.md").read_text()
    assert "](perplexity/perplexity_vs_memory.png)" in gathered
    assert "](ablations/ablations.png)" in gathered

    result = _results(tmp_path / "perplexity")
    _png(tmp_path / "perplexity" / "perplexity_vs_memory.png")
    rows = result["lengths"][str(sizes.lengths[0])]
    window = f"window {sizes.window}"
    assert list(rows) == ["full", window, f"{window} + 4 sinks", "conf-kv+int8", "conf-kv-l+int8"]
    for row in rows.values():
        assert row["tokens"] == sizes.lengths[0] - 1
        assert math.isclose(row["perplexity"], math.exp(row["nll"] / row["tokens"]))
    # a 136- or 192-token window loses what full KV sees on licence text
    assert rows["full"]["perplexity"] < rows[window]["perplexity"]
    n_low = int8_budget(smollm.model, sizes.window, sizes.int8)
    assert result["sizes"]["n_low"] == n_low > sizes.window  # INT8 buys tokens at equal bytes
    for label in ("conf-kv+int8", "conf-kv-l+int8"):
        assert rows[label]["mean_bytes"] <= rows[window]["mean_bytes"]
        assert n_low // 2 <= rows[label]["mean_budget"] <= n_low
    assert rows["full"]["mean_budget"] is None
    assert rows[window]["mean_budget"] == sizes.window
    table = reports[0].tables[0]
    closed = {row[1]: row[5:7] for row in table.rows}
    assert closed["full"] == ["-", "-"] and closed[window][0] == "-"
    expected = gap_closed(
        Totals(**{k: rows["conf-kv+int8"][k] for k in ("nll", "tokens")}),
        Totals(**{k: rows[window][k] for k in ("nll", "tokens")}),
        Totals(**{k: rows["full"][k] for k in ("nll", "tokens")}),
    )
    assert closed["conf-kv+int8"][0] == f"{expected:.0%}"

    ablation = _results(tmp_path / "ablations")
    _png(tmp_path / "ablations" / "ablations.png")
    variants = ablation["variants"]
    reference = variants["conf-kv+int8 (reference)"]
    assert ablation["random_budget"] == round(reference["mean_budget"])
    assert variants["random+int8, same ratio"]["mean_budget"] == ablation["random_budget"]
    assert variants["gate off: always N_high"]["mean_budget"] == n_low // 2
    assert variants["gate off: always N_low"]["mean_budget"] == n_low
    assert (
        variants["gate off: always N_high"]["mean_bytes"]
        <= reference["mean_bytes"]
        <= variants["gate off: always N_low"]["mean_bytes"]
    )
    # the same tokens in the model's dtype cost more bytes than with INT8
    assert variants["int8 off, same tokens"]["mean_bytes"] > reference["mean_bytes"]
    assert variants["int8 off, same bytes"]["mean_budget"] <= sizes.window
    sinks = variants[f"window {sizes.window} + 4 sinks"]
    assert sinks["mean_budget"] == sizes.window and sinks["tokens"] == rows["full"]["tokens"]


def test_retrieval_context_places_every_fact(smollm, text_ids):
    context, facts = build_context(text_ids, smollm.tokenizer, 600, 3, seed=1)
    assert abs(len(context) - 600) <= 3  # sentence boundaries may merge a token or two
    text = smollm.tokenizer.decode(context)
    places = [text.index(f"The code of the {name} is {code}.") for name, code in facts]
    assert places == sorted(places)
    assert is_right(" 4821, and", "4821") and not is_right(" 482", "4821")
    assert not is_right("1. 2345", "1234") and not is_right(" 48215", "4821")
    with pytest.raises(ValueError, match="too short"):
        build_context(text_ids[:100], smollm.tokenizer, 600, 3, seed=1)


@pytest.mark.model
def test_arkv_quick(smollm, text_ids, tmp_path):
    (report,) = run_experiments(["arkv"], smollm, text_ids, tmp_path, quick=True)
    result = _results(tmp_path / "arkv")
    _png(tmp_path / "arkv" / "accuracy_vs_memory.png")
    policies = result["policies"]
    assert list(policies) == [
        "full",
        "base-quant",
        "window 256",
        "arkv 256",
        "base-origin 256",
        "conf-kv+arkv 256",
        "kvzip 256",
        "window+recall 256",
        "arkv+recall 256",
    ]
    for row in policies.values():
        assert row["asked"] == 2 == len(row["answers"])
        assert row["accuracy"] == sum(a["right"] for a in row["answers"]) / 2
    assert policies["full"]["right"] >= 1  # a 512-token context is within reach of full KV
    assert policies["full"]["quantized_share"] == 0
    assert policies["base-quant"]["quantized_share"] > 0.9
    assert 0 < policies["arkv 256"]["quantized_share"] < 0.5
    assert policies["base-origin 256"]["quantized_share"] == 0
    full_held = policies["full"]["mean_held_bytes"]
    for label in ("window 256", "arkv 256", "base-origin 256"):
        assert policies[label]["mean_held_bytes"] < full_held
    # ARKV holds at most the bytes of its budget in FP tokens (46,080 bytes each, all layers)
    assert policies["arkv 256"]["mean_held_bytes"] <= 256 * 46_080
    # with recall the hot tier holds what the policy's budget allows, the cold tier apart
    assert policies["arkv+recall 256"]["mean_held_bytes"] <= 256 * 46_080
    assert (
        policies["arkv+recall 256"]["peak_cold_bytes"]
        > 0
        == policies["arkv 256"]["peak_cold_bytes"]
    )
    assert len(report.tables) == 1 and len(report.tables[0].rows) == 9


def test_arkv_policies_replaces_the_list_and_keeps_full(smollm, text_ids, tmp_path):
    run_experiments(["arkv"], smollm, text_ids, tmp_path, quick=True, policies=["h2o+recall"])
    assert list(_results(tmp_path / "arkv")["policies"]) == ["full", "h2o+recall 256"]
