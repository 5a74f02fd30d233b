"""Start ``tandem up`` as a real process and wait for the OpenAI base URL it prints."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time


def start_up(
    args: list[str], env: dict[str, str], timeout: float
) -> tuple[subprocess.Popen, str, list[str]]:
    """``tandem up ARGS`` with no client credentials inherited; returns the process, its
    OpenAI base URL and the lines it printed until then (the caller stops it)."""
    env = dict(env, TOKENIZERS_PARALLELISM="false")
    env.pop("TANDEM_PROXY_API_KEY", None)
    env.pop("TANDEM_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.server.cli", "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"OpenAI base URL: (\S+)", line):
            return proc, m.group(1), lines
    proc.kill()
    proc.wait(30)
    raise AssertionError("tandem up printed no base URL:\n" + "".join(lines))


def stop_up(proc: subprocess.Popen, reader: threading.Thread) -> None:
    """Ctrl-C ``tandem up`` as a user would, kill it if it does not stop within a minute,
    then let the thread reading its output finish."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
