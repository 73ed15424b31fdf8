"""Run the recall suite under one policy and format and print full success per k.

    AGENT_KV_THREADS=1 .venv/bin/python scripts/recall_calibrate.py --format notes \
        --out runs/recall/notes [--tasks 401,402] [--max-k 3] [--model DIR] [--weights fp32] \
        [--policy window --budget 1024 --rerotate]

Each task's trace and `results.jsonl` go under `--out` (see
`agent_kv.harness.scripted_episode`). Under
full KV, tasks past the model's context end with an error (counted in the table's `errors`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_kv.harness.scripted_episode import FORMATS, SUITE, format_by_k, run_recall
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS, WEIGHT_FORMATS
from envs.browser_env import BrowserEnv
from envs.server import SiteServers
from envs.tasks import load_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=sorted(FORMATS), default="notes")
    parser.add_argument("--tasks", default="", help="comma-separated task ids (default: all)")
    parser.add_argument("--max-k", type=int, default=None, help="only tasks with k <= this")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--rerotate", action="store_true", help="rerotate positions")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of tasks/README.md's figures)",
    )
    parser.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default=DEFAULT_WEIGHTS, help="--weights (fp16)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    wanted = {int(i) for i in args.tasks.split(",") if i}
    tasks = [
        task
        for task in load_suite(SUITE)
        if (not wanted or task.task_id in wanted)
        and (args.max_k is None or task.horizon <= args.max_k)
    ]
    positions = "rerotate" if args.rerotate else "original"
    spec = PolicySpec.parse(args.policy, args.budget, None, positions=positions)
    loaded = load_model(args.model, args.weights)

    def engine() -> Engine:
        return Engine.from_spec(spec, loaded.model, loaded.tokenizer)

    def show(record) -> None:
        error = f" error: {record.error[:60]}" if record.error else ""
        print(
            f"task {record.task_id} k={record.k} {record.history_tokens} tokens "
            f"{'solved' if record.success else 'failed'}: {record.reply!r}{error}",
            flush=True,
        )

    sites = sorted({site for task in tasks for site in task.sites})
    with SiteServers(sites) as servers, BrowserEnv(servers, screenshots=False) as env:
        records = run_recall(
            tasks, engine, env, args.out, loaded.name, FORMATS[args.format], on_record=show
        )
    print(format_by_k(records))


if __name__ == "__main__":
    main()
