"""The mechanistic evaluation (confidence vs the KL shift of eviction): its statistics helpers
against hand-computed values, and a quick run on the default model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agent_kv.evals import mechanistic as mech
from agent_kv.evals.report import RESULTS, SUMMARY, EvalContext


def test_kl_divergence_matches_hand_computed_value():
    p, q = [0.5, 0.5], [0.25, 0.75]
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438410362
    kl = mech.kl_divergence(torch.tensor(p).log(), torch.tensor(q).log())
    assert kl == pytest.approx(expected, abs=1e-7)
    # logits are shift-invariant; KL of a law with itself is 0; KL is asymmetric
    assert mech.kl_divergence(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([11.0, 12.0, 13.0])) == (
        pytest.approx(0.0, abs=1e-12)
    )
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    kl_qp = mech.kl_divergence(torch.tensor(q).log(), torch.tensor(p).log())
    assert kl_qp == pytest.approx(reverse, abs=1e-7)


def test_pearson_and_spearman_match_hand_computed_values():
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 4.0, 3.0]
    # deviations (-1.5, -0.5, 0.5, 1.5) and (-0.5, -1.5, 1.5, 0.5): products sum to 3, squares
    # to 5 each, so r = 3 / 5
    assert mech.pearson(x, y) == pytest.approx(0.6)
    assert mech.pearson(x, [-v for v in y]) == pytest.approx(-0.6)
    assert mech.pearson(x, [2 * v + 7 for v in x]) == pytest.approx(1.0)
    assert math.isnan(mech.pearson(x, [1.0] * 4))
    # a monotone but non-linear relation: rho is 1, r below it
    cubes = [v**3 for v in x]
    assert mech.spearman(x, cubes) == pytest.approx(1.0)
    assert mech.pearson(x, cubes) < 0.99
    # ties share their average rank
    assert mech.average_ranks([10.0, 20.0, 20.0, 5.0]).tolist() == [2.0, 3.5, 3.5, 1.0]
    # ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4]: sum of products 4.5, squares 4.5 and 5
    assert mech.spearman([1.0, 2.0, 2.0, 3.0], x) == pytest.approx(4.5 / math.sqrt(4.5 * 5))


def test_fisher_interval_and_quartiles():
    lo, hi = mech.fisher_interval(0.5, 103)  # half width 1.96 / 10 in z
    assert lo == pytest.approx(math.tanh(math.atanh(0.5) - 0.196))
    assert hi == pytest.approx(math.tanh(math.atanh(0.5) + 0.196))
    assert all(math.isnan(v) for v in mech.fisher_interval(0.5, 3))
    c = [0.9, 0.1, 0.5, 0.2, 0.8, 0.3, 0.7, 0.4]
    kl = [1.0, 10.0, 5.0, 20.0, 3.0, 6.0, 4.0, 2.0]
    assert mech.quartile_means(c, kl) == (15.0, 2.0)  # lowest c: 0.1, 0.2; highest: 0.8, 0.9


def test_eviction_rules_and_slices():
    positions = torch.arange(600)
    recent = mech.recent_span_rule(keep_newest=16, span=256)(positions, 600)
    assert recent.nonzero().squeeze(1).tolist() == list(range(328, 584))
    window = mech.window_rule(sinks=4, window=256)(positions, 600)
    assert window.nonzero().squeeze(1).tolist() == list(range(4, 344))
    assert not mech.no_eviction_rule(positions, 600).any()
    size = mech.Size(slices=4, slice_tokens=2048, warmup=512, stride=16)
    assert mech.slice_starts(31696, size) == ([0, 9882, 19765, 29648], 2048)
    assert mech.slice_starts(5000, size) == ([0, 2952], 2048)
    assert mech.slice_starts(1000, size) == ([0], 1000)


@pytest.mark.model
def test_forked_eviction_path_matches_full_path(smollm):
    from agent_kv.evals.texts import licence_text
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine.engine import Engine

    ids = smollm.tokenizer(licence_text()[:4000], add_special_tokens=False)["input_ids"][:301]
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    session = engine.new_sequence()
    engine.prefill(session, ids[:300])
    rules = {
        "none": mech.no_eviction_rule,
        "recent": mech.recent_span_rule(keep_newest=16, span=64),
    }
    logits, kl, evicted = mech.eviction_kl(engine, session, ids[300], rules)
    assert evicted == {"none": 0, "recent": 64}
    assert kl["none"] < 1e-5
    assert 0 < kl["recent"] < 50
    # the session went on with full KV; the forks left it untouched
    assert session.store.lengths() == [301] * session.store.num_layers
    assert session.token_ids == ids
    assert torch.equal(logits, session.last_logits)


@pytest.mark.model
def test_quick_run_reports_real_correlations(smollm, tmp_path):
    from agent_kv.evals.texts import licence_text

    ids = smollm.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    ctx = EvalContext(smollm, ids, True, tmp_path, lambda line: None)
    report = mech.run(ctx)
    report.write(tmp_path)

    samples = report.data["samples"]
    assert len(samples) == 20
    assert [s["t"] for s in samples] == list(range(320, 768, 23))
    for s in samples:
        assert 0.0 <= s["c"] <= 1.0
        for name in ("a", "b"):
            assert math.isfinite(s[f"kl_{name}"]) and s[f"kl_{name}"] >= 0.0
        assert s["kl_a"] > 0 and s["evicted_a"] == 256
        assert s["evicted_b"] == s["t"] - 4 - 256
    for name in ("a", "b"):
        stats = report.data["stats"][name]
        assert stats["n"] == 20
        assert -1.0 <= stats["pearson_r"] <= 1.0
        assert -1.0 <= stats["spearman_rho"] <= 1.0
        c = [s["c"] for s in samples]
        kl = [s[f"kl_{name}"] for s in samples]
        assert stats["pearson_r"] == pytest.approx(mech.pearson(c, kl))
    assert report.data["stats"]["b"]["mean_kl"] > 0
    assert (tmp_path / "confidence_vs_kl.png").stat().st_size > 1000
    assert report.figures == ["confidence_vs_kl.png"]
    summary = (tmp_path / SUMMARY).read_text()
    assert "Pearson r" in summary and "-0.77" in summary
    assert json.loads((tmp_path / RESULTS).read_text())["samples"] == samples
