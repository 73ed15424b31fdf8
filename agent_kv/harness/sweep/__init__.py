"""Policy sweeps: run web tasks under several KV policies and budgets, and report success next
to memory.

    agent-kv bench --tasks classifieds --policies full,window,conf-kv --budgets 512,1024 \
        --out runs/sweep

One *job* is a task under one policy setting (policy, budget, precision) and one agent
(`--agents`: actions as text or as tool calls, `action_formats`); `full` runs once per task
and agent, without a budget, always at full precision (it is the baseline every other row of
the same agent is compared with). Each finished job appends one JSON line to
`DIR/results.jsonl` (the episode summary of `agent.run_episode` plus `policy`, `budget`,
`precision`, `agent` and, unless disabled, the teacher-forced reference-action accuracy),
flushed at once; a rerun skips the jobs already in the file, so an interrupted sweep
resumes. A job that raises (browser death, model error,
anything) is recorded with `end_reason: "error"` and the error text, and the sweep goes on.
At the end `DIR/summary.md` holds the table of `aggregate` and `DIR/success_vs_memory.png`
plots success rate against mean peak KV memory, one labelled point per row.

The modules, one job each:

- `settings`: jobs and their keys, the sweep's episode settings (`BenchSettings`), task
  selection, the results file's names and records;
- `job_runs`: what runs the episodes (a `Runner` in this process, or `RayActors`), one job
  run into its record, and which job may start next;
- `episode_runner`: the real runner (`EpisodeRunner`: model, sites, browsers) and the
  teacher-forced reference-action replay;
- `ray_pool`: the Ray actors that run a sweep, and the Ray session they run in;
- `schedule`: `run_bench`, the sweep's driver (resume, progress, records written as
  episodes finish), in this process or on Ray;
- `aggregate`: one row per policy setting, compared with full KV;
- `report`: the summary's tables and plots.

Importing `settings`, `job_runs`, `aggregate` or `report` imports neither torch nor Ray, so
the command line checks its options at once; `episode_runner` imports torch, `ray_pool` and
`schedule` import Ray.
"""
