"""A child of ``tandem up`` dies with it, whatever ends ``tandem up`` (``kill -9`` included,
which runs none of its clean-up): each child asks the kernel for SIGTERM when its parent
dies (Linux's ``PR_SET_PDEATHSIG``), or, where there is no such call, watches its parent id
from a thread. SIGTERM, not SIGKILL: an engine then stops its tensor-parallel ranks and
frees its port as on any shutdown.

``tandem up`` names itself in the child's environment (``PARENT_ENV``); the child arms the
signal first thing (``cli.main``) and takes the variable out of its environment, so its own
children (ranks) do not inherit a parent that is not theirs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import MutableMapping

PARENT_ENV = "TANDEM_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 1.0


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must die with this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_parent(environ: MutableMapping[str, str] = os.environ) -> None:
    """Arm the parent-death signal when a parent asked for it (``PARENT_ENV``)."""
    raw = environ.pop(PARENT_ENV, None)
    if not raw or not raw.isdigit():
        return
    parent = int(raw)
    if not _set_pdeathsig(signal.SIGTERM):
        threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _watch(parent: int) -> None:
    """The fallback: poll the parent id; once the parent is gone it changes (re-parented)."""
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGTERM)
