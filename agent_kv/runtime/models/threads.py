"""How many CPU threads torch runs a model with: `$AGENT_KV_THREADS`, else 1.

`load_model` applies the setting before it loads (so `agent-kv` and `ChatAgentKV.local()`
get it alike); the command line's `--threads N` sets `$AGENT_KV_THREADS` for its process and
the processes it starts (`agent-kv bench --workers`). With `$AGENT_KV_THREADS` unset but
`$OMP_NUM_THREADS` set, torch keeps the count it read from the latter.

Why 1: `benchmarks/threads.py`, one run on the project's 2-core CPU (SmolLM2-135M, a
500-token prefill and 32 decode steps through `Engine` with conf-kv, medians of 5 interleaved
repetitions; idle (load average about 1 from other users), then with 2 busy-loop processes,
which other users' tests joined):

    setting                    idle: prefill, decode step    loaded: prefill, decode step
    1 thread                   0.85 s, 66 ms                 1.59 s, 109 ms
    2 threads                  0.59 s, 47 ms                 13.2 s, 180 ms
    2 threads, OMP passive     0.62 s, 74 ms                 1.51 s, 99 ms

Two threads are 1.4x faster on an idle machine and collapse when another process holds a
core (prefill 8x slower than one thread; a shorter smoke run saw decode steps 15x slower):
torch's OpenMP threads meet at a barrier after every operator and wait for the member that
was descheduled. `OMP_WAIT_POLICY=PASSIVE` avoids the collapse but decodes slower than one
thread when idle, and it works only if set before torch is first imported, which a library
cannot ensure. One thread costs 1.4x idle and degrades only by its share of the cores. Only the
intra-op count is set: torch's inter-op pool serves `torch.jit.fork`, which agent_kv does not
use (and it cannot be resized once it has run anything).

Threads that ran a torch operator before `apply` keep their old count: apply it first.
"""

from __future__ import annotations

import os

from agent_kv.errors import ConfigError

ENV = "AGENT_KV_THREADS"
DEFAULT = 1


def configured() -> int | None:
    """The thread count `$AGENT_KV_THREADS` asks for, `DEFAULT` when it is unset, or None
    when it is unset and `$OMP_NUM_THREADS` is set (torch then keeps that count).

    Raises:
        ConfigError: `$AGENT_KV_THREADS` is not a whole number >= 1.
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None if os.environ.get("OMP_NUM_THREADS") else DEFAULT
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{ENV} must be a whole number >= 1, got {text!r}")
    return int(text)


def choose(threads: int | None) -> None:
    """Make `threads` (when not None) the setting of this process and of the processes it
    starts, by setting `$AGENT_KV_THREADS`; `apply` puts it into effect.

    Raises:
        ConfigError: `threads` below 1, or (when None) an invalid `$AGENT_KV_THREADS`.
    """
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        os.environ[ENV] = str(threads)
    configured()


def apply() -> int:
    """Set torch's intra-op thread count to `configured()` (imports torch); return the count
    in effect.

    Raises:
        ConfigError: `$AGENT_KV_THREADS` is not a whole number >= 1.
    """
    threads = configured()
    import torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
