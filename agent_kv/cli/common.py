"""What the commands share: the one-line failure (`fail`), and the checks of options more
than one command takes."""

from __future__ import annotations

from pathlib import Path

import typer

from agent_kv.errors import AgentKVError, ConfigError
from envs.actions import ACTION_FORMATS


def fail(message: str) -> None:
    """Print `error: message` on stderr and exit with status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def writable_dir(path: Path) -> None:
    """Create `path` (and parents) or raise AgentKVError saying why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AgentKVError(f"cannot use {path}: {err.strerror}") from None


def check_mode(mode: str) -> None:
    """Raises ConfigError for a `--mode` other than `harness.sweep.settings.MODES` (free,
    scripted)."""
    # the sweep's settings load the tasks (pydantic, the sites' web framework): not at start
    from agent_kv.harness.sweep.settings import MODES

    if mode not in MODES:
        raise ConfigError(f"--mode must be {' or '.join(MODES)}, got {mode!r}")


def check_scripted_agents(agents: list[str], option: str) -> None:
    """Raises ConfigError, naming `option`, when `agents` is not just text: `--mode scripted`
    answers as a text action."""
    if set(agents) != {"text"}:
        raise ConfigError(f"--mode scripted answers as text: it takes {option} text only")


def check_agent(agent: str, option: str = "--agent") -> None:
    """Raises ConfigError, naming `option`, for an agent other than
    `envs.actions.ACTION_FORMATS`."""
    if agent not in ACTION_FORMATS:
        raise ConfigError(f"{option} takes {', '.join(ACTION_FORMATS)}, got {agent!r}")
