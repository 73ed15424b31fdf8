"""A sweep's results as one row per policy setting (policy, budget, precision, agent), each
compared with the full-KV episodes of its own agent on the tasks both ran."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent_kv.harness.intervals import paired_difference_interval, success_interval
from agent_kv.harness.sweep.settings import record_key
from agent_kv.kv.policy_names import base_policy, declared_policies


def mean(values: Iterable[float]) -> float | None:
    """The mean of `values`; None for none."""
    values = list(values)
    return sum(values) / len(values) if values else None


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, budget, precision, agent), `full` first, then by policy, budget
    and agent, of records in the current field names (`settings.read_results`). Each row is
    compared with the full-KV episodes of its own agent.

    Row fields: `policy`, `budget` (None for full), `precision`, `agent`, `episodes`,
    `errors`, `success_rate` (errors count as failures) and `success_ci95` (its Wilson 95%
    interval, `intervals.success_interval`), `success_minus_full` (this row's success rate
    minus full KV's on the tasks both ran) and `success_minus_full_ci95` (its paired
    bootstrap 95% interval over those tasks, `intervals.paired_difference_interval`; None
    for full KV itself or under two common tasks), `relative_success` (this row's
    success rate over full KV's on the tasks both ran; None without a full run or when full never
    succeeded), `peak_kv_mb` (mean peak allocated KV bytes / 1e6 over episodes that report
    them), `peak_kv_live_mb` (the same for the peak live bytes), `peak_cold_kv_mb` (mean
    peak bytes of the cold tier, 0 without recall; never counted in the others),
    `reduction_vs_full` (mean peak bytes of full over mean peak bytes of this row, on the
    tasks both ran with a peak), `mean_steps`, `decode_tokens_per_s` (mean over every decode
    turn of every episode), `reference_accuracy` (reference steps whose action was the
    model's greedy choice over all reference steps replayed; None when none was) and
    `reference_steps`, `full_success_rate` (full KV's success on the tasks both ran; None
    without them), and agreement with full KV over every compared step of the row's
    episodes: `agreement` (share of steps whose own action equals full KV's), `mean_kl`
    (KL(full || policy), nats, mean over steps) and `agreement_steps` (None / 0 when no
    step was compared).
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        _, *setting = record_key(record)
        groups.setdefault(tuple(setting), []).append(record)
    rows = []
    for setting, group in groups.items():
        agent = setting[-1]
        full = {r["task_id"]: r for r in groups.get(("full", None, "fp", agent), [])}
        rows.append(_row(setting, group, full))
    order = {name: i for i, name in enumerate(declared_policies())}
    rows.sort(
        key=lambda r: (
            r["policy"] != "full",
            order.get(base_policy(r["policy"]), len(order)),
            r["policy"],
            r["budget"] or 0,
            r["precision"],
            r["agent"] != "text",
        )
    )
    return rows


def _row(
    setting: tuple, group: list[dict[str, Any]], full: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The row of `aggregate` of one policy setting's records, `full` its agent's full-KV
    records by task id."""
    policy, budget, precision, agent = setting
    common = [r for r in group if r["task_id"] in full]
    ours = [float(bool(r.get("success"))) for r in common]
    theirs = [float(bool(full[r["task_id"]].get("success"))) for r in common]
    return {
        "policy": policy,
        "budget": budget,
        "precision": precision,
        "agent": agent,
        "episodes": len(group),
        "errors": sum(r.get("end_reason") == "error" for r in group),
        **_success_fields(policy == "full", group, ours, theirs),
        **_memory_fields(group, common, full),
        "mean_steps": mean(r.get("steps") or 0 for r in group),
        "decode_tokens_per_s": mean(
            rate for r in group for rate in r.get("decode_tokens_per_s") or []
        ),
        **_reference_fields(group),
        "full_success_rate": mean(theirs),  # None without common tasks
        **_agreement_fields(group),
    }


def _success_fields(
    is_full: bool, group: list[dict[str, Any]], ours: list[float], theirs: list[float]
) -> dict[str, Any]:
    """`success_rate`, `success_ci95`, `success_minus_full`, `success_minus_full_ci95` and
    `relative_success` of a row (`aggregate`): `ours` and `theirs` are its successes and full
    KV's (1.0 or 0.0) on the tasks both ran."""
    full_rate = mean(theirs)
    return {
        "success_rate": mean(float(bool(r.get("success"))) for r in group),
        "success_ci95": success_interval(sum(bool(r.get("success")) for r in group), len(group)),
        "success_minus_full": None if is_full or full_rate is None else mean(ours) - full_rate,
        "success_minus_full_ci95": None if is_full else paired_difference_interval(ours, theirs),
        "relative_success": mean(ours) / full_rate if full_rate else None,
    }


def _memory_fields(
    group: list[dict[str, Any]], common: list[dict[str, Any]], full: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """`peak_kv_mb`, `peak_kv_live_mb`, `peak_cold_kv_mb` and `reduction_vs_full` of a row
    (`aggregate`): `common` are its records of the tasks full KV ran too."""
    peaks = [
        (full[r["task_id"]]["peak_kv_allocated_bytes"], r["peak_kv_allocated_bytes"])
        for r in common
        if r.get("peak_kv_allocated_bytes") and full[r["task_id"]].get("peak_kv_allocated_bytes")
    ]
    reduction = None
    if peaks:
        reduction = mean(p[0] for p in peaks) / mean(p[1] for p in peaks)
    peak = mean(r["peak_kv_allocated_bytes"] for r in group if r.get("peak_kv_allocated_bytes"))
    live = mean(r["peak_kv_live_bytes"] for r in group if r.get("peak_kv_live_bytes"))
    cold = mean(r.get("peak_cold_kv_bytes") or 0 for r in group)
    return {
        "peak_kv_mb": None if peak is None else peak / 1e6,
        "peak_kv_live_mb": None if live is None else live / 1e6,
        "peak_cold_kv_mb": None if cold is None else cold / 1e6,
        "reduction_vs_full": reduction,
    }


def _reference_fields(group: list[dict[str, Any]]) -> dict[str, Any]:
    """`reference_accuracy`, `reference_steps` and `reference_nll` of a row (`aggregate`):
    over every reference step, and every reference token, of its records."""
    ref_steps = sum(r.get("reference_steps") or 0 for r in group)
    ref_hits = sum(r.get("reference_hits") or 0 for r in group)
    ref_tokens = sum(r.get("reference_tokens") or 0 for r in group)
    ref_nll = sum((r.get("reference_nll") or 0) * (r.get("reference_tokens") or 0) for r in group)
    return {
        "reference_accuracy": ref_hits / ref_steps if ref_steps else None,
        "reference_steps": ref_steps,
        "reference_nll": ref_nll / ref_tokens if ref_tokens else None,
    }


def _agreement_fields(group: list[dict[str, Any]]) -> dict[str, Any]:
    """`agreement`, `mean_kl` and `agreement_steps` of a row (`aggregate`): weighted by the
    steps each record compared."""
    compared = sum(r.get("steps_compared") or 0 for r in group)
    agreed = sum((r.get("agreement") or 0) * (r.get("steps_compared") or 0) for r in group)
    kl = sum((r.get("mean_kl") or 0) * (r.get("steps_compared") or 0) for r in group)
    return {
        "agreement": agreed / compared if compared else None,
        "mean_kl": kl / compared if compared else None,
        "agreement_steps": compared,
    }


def row_label(row: dict[str, Any]) -> str:
    """'conf-kv 512', 'conf-kv 512 int8', 'full', 'full tools' (the tool-calling agent)."""
    label = row["policy"] if row["budget"] is None else f"{row['policy']} {row['budget']}"
    if row["precision"] != "fp":
        label = f"{label} {row['precision']}"
    return label if row.get("agent", "text") == "text" else f"{label} {row['agent']}"
