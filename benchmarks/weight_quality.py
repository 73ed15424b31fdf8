"""The quality cost of each weight format (`--weights`) against fp32, on the same model:
perplexity on the licence texts, greedy-action agreement on the bundled tasks' trajectories,
and the recall suite's answers.

- Perplexity: `--segments` segments of `--tokens` tokens spread over the Debian licence texts
  (`agent_kv.evals.texts`), each scored teacher-forced from an empty full-KV cache in
  512-token calls (prefill's chunks: `Engine.score`); `exp(mean NLL)` per format, and its
  change against fp32.
- Greedy-action agreement: every full-KV episode of a sweep directory (`--sweep`, as `agent-kv
  bench` writes it, traces included) is replayed teacher-forced, turn by turn, into two full-KV
  caches, the sweep's own weight format (the reference: its actions are the trace's) and the
  format under test, which decodes its own greedy action at each step under the page's
  grammar (`agent_kv.harness.agreement.replay_agreement`); the share of steps whose action
  equals the trace's, and the mean KL between the two formats' next-token distributions
  along the reference actions (nats).
- Recall answers: two recall-suite results (`--recall A.jsonl B.jsonl`, `agent-kv bench --mode
  scripted` runs of the same tasks and policy under two formats): the share of tasks whose
  answers are the same string, and each run's success.

    .venv/bin/python benchmarks/weight_quality.py --formats fp32 fp16 bf16 int8 \\
        --sweep docs/results/free-nav-0.5b-full --recall runs/recall-fp32/results.jsonl \\
        runs/recall-fp16/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from agent_kv.evals.texts import licence_text
from agent_kv.harness.agent import AgentConfig
from agent_kv.harness.agreement import read_trajectory, replay_agreement
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model

SCORE_CHUNK = 512


def perplexity(loaded, segments: list[list[int]]) -> float:
    """exp(mean NLL) over every scored token of `segments`, full KV."""
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("full"))
    nll, tokens = 0.0, 0
    for ids in segments:
        log_probs = engine.score(engine.new_sequence(), ids, chunk=SCORE_CHUNK)
        nll -= float(log_probs.sum())
        tokens += log_probs.numel()
    return math.exp(nll / tokens)


def sweep_episodes(sweep: Path) -> list[tuple[str, Path, dict]]:
    """(intent, trace directory, settings) of each full-KV episode of a sweep directory."""
    settings = json.loads((sweep / "settings.json").read_text())
    episodes = []
    for line in (sweep / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["policy"] == "full" and record["end_reason"] != "error":
            trace = Path(record["trace_dir"])
            intent = json.loads((trace / "task.json").read_text())["intent"]
            episodes.append((intent, trace, settings))
    return episodes


def agreement(tested, reference, episodes) -> dict:
    """Greedy-action agreement of `tested`'s full KV with `reference`'s recorded actions."""
    steps = []
    for intent, trace, settings in episodes:
        config = AgentConfig(
            max_obs_tokens=settings.get("max_obs_tokens", AgentConfig.max_obs_tokens),
            agent=settings.get("agent", "text"),
        )
        engine = Engine(tested.model, tested.tokenizer, make_policy("full"))
        ref = Engine(reference.model, reference.tokenizer, make_policy("full"))
        steps += replay_agreement(intent, read_trajectory(trace), engine, ref, config)
    agree = sum(s.agree for s in steps)
    return {
        "steps": len(steps),
        "agree": agree,
        "agreement": agree / len(steps) if steps else None,
        "mean_kl": sum(s.kl for s in steps) / len(steps) if steps else None,
    }


def recall_comparison(first: Path, second: Path) -> dict:
    """Tasks whose answers are identical in two recall runs, and each run's successes."""
    runs = [
        {r["task_id"]: r for r in map(json.loads, path.read_text().splitlines())}
        for path in (first, second)
    ]
    shared = sorted(set(runs[0]) & set(runs[1]))
    same = sum(runs[0][t]["answer"] == runs[1][t]["answer"] for t in shared)
    return {
        "tasks": len(shared),
        "same_answer": same,
        "solved": [sum(run[t]["success"] for t in shared) for run in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=bundled_models.DEFAULT_MODEL)
    parser.add_argument("--formats", nargs="+", default=["fp32", "fp16", "bf16", "int8"])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per text segment")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--sweep", type=Path, default=None, help="a sweep directory with traces")
    parser.add_argument("--reference", default=None, help="the sweep's weight format")
    parser.add_argument("--recall", type=Path, nargs=2, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    loaded = {name: load_model(args.model, weights=name) for name in args.formats}
    tokenizer = next(iter(loaded.values())).tokenizer
    ids = tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    stride = len(ids) // args.segments
    segments = [ids[i * stride : i * stride + args.tokens] for i in range(args.segments)]
    rows = {}
    for name, model in loaded.items():
        with torch.no_grad():
            rows[name] = {"perplexity": perplexity(model, segments)}
        print(f"{name}: perplexity {rows[name]['perplexity']:.4f}", flush=True)
    if args.sweep is not None:
        episodes = sweep_episodes(args.sweep)
        reference = loaded[args.reference]
        for name, model in loaded.items():
            if name != args.reference:
                rows[name]["agreement"] = agreement(model, reference, episodes)
                print(f"{name}: agreement {rows[name]['agreement']}", flush=True)
    base = rows.get("fp32", {}).get("perplexity")
    print(f"\n{args.segments} x {args.tokens} licence-text tokens; model {args.model}\n")
    print("| weights | perplexity | vs fp32 | action agreement (steps) | mean KL (nats) |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        change = f"{row['perplexity'] / base - 1:+.2%}" if base else "-"
        agreed = row.get("agreement")
        cells = (
            f"{agreed['agreement']:.1%} ({agreed['agree']}/{agreed['steps']}) | "
            f"{agreed['mean_kl']:.4f}"
            if agreed and agreed["steps"]
            else "- | -"
        )
        print(f"| {name} | {row['perplexity']:.4f} | {change} | {cells} |")
    if args.recall is not None:
        print(f"\nrecall answers: {recall_comparison(*args.recall)}")


if __name__ == "__main__":
    main()
