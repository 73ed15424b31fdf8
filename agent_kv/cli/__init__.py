"""The `agent-kv` command line.

    agent-kv run-episode --task 1 --policy conf-kv --budget 1024 --out runs/

Every user error (unknown task, malformed task file, bad policy settings, missing Chromium or
model) is one line on stderr and exit status 2, never a traceback. Importing this package does
not import torch, and the commands check their options before they do, so help and usage
errors come at once: what is heavy to import (torch, Ray, Playwright, the tasks and the sites'
web framework) each command imports inside, where it needs it.

One module per command group, each a plain function registered on `app` here: `episode`
(run-episode, trace), `bench`, `evals` (eval), `serve`, `models` (its own sub-app) and
`sites`; the options several commands take are in `options`, their shared checks and the
one-line failure in `common`. `python -m agent_kv.cli` runs `main` (`__main__`).
"""

from __future__ import annotations

import typer

from agent_kv.cli.bench import bench_command
from agent_kv.cli.episode import run_episode_command, trace_command
from agent_kv.cli.evals import eval_command
from agent_kv.cli.models import models_app
from agent_kv.cli.serve import serve_command
from agent_kv.cli.sites import sites_command

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="agent_kv: a local LLM backend for long-horizon web agents with a managed KV cache.",
)


@app.callback()
def _root() -> None:
    """agent_kv command line."""


app.command("run-episode")(run_episode_command)
app.command("bench")(bench_command)
app.command("trace")(trace_command)
app.command("eval")(eval_command)
app.command("serve")(serve_command)
app.add_typer(models_app, name="models")
app.command("sites")(sites_command)


def main() -> int:
    """Console entry point: usage errors become one `error:` line and exit status 2."""
    try:
        return app(standalone_mode=False) or 0
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        return 1
    except typer.TyperException as err:
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        if message:  # empty when the help page was shown for a bare `agent-kv`
            typer.echo(f"error: {message}", err=True)
        return getattr(err, "exit_code", 2)
