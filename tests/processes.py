"""Shared helpers for tests that run the `agent-kv` command as a process: its output read line
by line, a free port, and a live `agent-kv serve`."""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

CLI = [sys.executable, "-m", "agent_kv.cli"]


def read_lines_until(stream, done, timeout: float) -> list[str]:
    """Lines of `stream` up to the first for which `done(line)` holds; AssertionError if the
    stream ends first, queue.Empty after `timeout` seconds without it. A thread goes on
    reading the stream, so the process never blocks on a full pipe."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while not seen or not done(seen[-1]):
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        if line is None:
            raise AssertionError(f"the stream ended before the line wanted: {seen}")
        seen.append(line)
    return seen


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def agent_kv_serve(*args: str, timeout: float = 300) -> Iterator[str]:
    """Run `agent-kv serve *args` on a free port until the block ends; yields its root URL
    once it says it is ready. AssertionError (with what it printed) if it exits first. Decode
    steps run eagerly unless `args` say `--compile`: a compile takes about a minute per
    server, and tests/test_decode_graph.py checks the compiled step against the eager one."""
    port = free_port()
    compile_flag = [] if "--compile" in args else ["--no-compile"]
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), *compile_flag, *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_lines_until(proc.stderr, lambda line: "ready on" in line, timeout=timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
