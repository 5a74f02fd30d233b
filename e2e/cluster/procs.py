"""Starting and stopping the control-plane processes, and nothing else.

Every pid the harness starts is written to `<state>/pids/<name>.pid`, so a
later `python -m e2e.cluster down` (or a crashed run's cleanup) can stop it.
Before signalling a pid we check that it still runs one of our binaries:
after a reboot or a long pause a stale pid file may name someone else's
process, which we must never kill.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec hook: the kernel SIGKILLs the child when the starting process dies.

    A pytest run killed with SIGKILL cannot run its fixture finalizers; this
    makes sure its control plane does not outlive it. SIGKILL, not SIGTERM:
    all components get the signal at once, and an apiserver whose etcd
    vanishes mid graceful-shutdown hangs; the data is throwaway anyway.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Managed:
    """One process we started: its name, binary, pid and log file."""

    name: str
    binary: Path
    pid: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        """True while the pid exists, runs our binary and is not a zombie."""
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return runs_binary(self.pid, self.binary)

    def log_tail(self, lines: int = 25) -> str:
        """Last lines of the log, for error messages that explain a failed start."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def runs_binary(pid: int, binary: Path) -> bool:
    """Whether /proc says pid is a live (non-zombie) process executing `binary`."""
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        exe = os.readlink(proc / "exe")
    except (OSError, IndexError):
        return False
    return state != "Z" and Path(exe.removesuffix(" (deleted)")) == binary.resolve()


def spawn(
    name: str, binary: Path, args: list[str], state_dir: Path, tie_to_parent: bool
) -> Managed:
    """Start `binary args...` in its own session with output in logs/<name>.log."""
    logs = state_dir / "logs"
    pids = state_dir / "pids"
    logs.mkdir(parents=True, exist_ok=True)
    pids.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [str(binary), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if tie_to_parent else None,
        )
    (pids / f"{name}.pid").write_text(f"{popen.pid}\n")
    return Managed(name=name, binary=binary, pid=popen.pid, log=log, popen=popen)


def recorded(state_dir: Path, bin_dir: Path) -> list[Managed]:
    """Processes listed in the state dir's pid files (for `down` from another process)."""
    found = []
    for pid_file in sorted((state_dir / "pids").glob("*.pid")):
        name = pid_file.stem
        try:
            pid = int(pid_file.read_text().strip())
        except ValueError:
            continue
        found.append(Managed(name, bin_dir / name, pid, state_dir / "logs" / f"{name}.log"))
    return found


def _reap(proc: Managed) -> None:
    if proc.popen is not None:
        try:
            proc.popen.wait(timeout=0)
        except subprocess.TimeoutExpired:
            pass


def terminate(procs: list[Managed], state_dir: Path, grace: float = 15.0) -> None:
    """SIGTERM the given processes together, SIGKILL what is left after `grace` seconds."""
    targets = [p for p in procs if p.alive()]
    for proc in targets:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while targets and time.monotonic() < deadline:
        for proc in targets:
            _reap(proc)
        targets = [p for p in targets if p.alive()]
        time.sleep(0.1)
    for proc in targets:
        _signal(proc, signal.SIGKILL)
        if proc.popen is not None:
            proc.popen.wait(timeout=10)
    for proc in procs:
        _reap(proc)
        (state_dir / "pids" / f"{proc.name}.pid").unlink(missing_ok=True)


def _signal(proc: Managed, sig: signal.Signals) -> None:
    if not proc.alive():
        return
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def memory_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process in KiB, from /proc/<pid>/status."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0])
    except OSError:
        pass
    return values["VmRSS"], values["VmHWM"]
