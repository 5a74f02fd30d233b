"""Loopback networking shared by the engine's rank launcher, ``tandem up`` and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
