"""Loopback networking shared by the engine's rank launcher, ``tandem up`` and the tests."""

from __future__ import annotations

import argparse
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str, port: int = 0, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port), not yet listening, for a child
    to serve on (``--listen-fd``). Unlike ``free_port`` the port is held from the moment it is
    picked: no ephemeral pick (another ``bind(host, 0)`` or an outgoing connection) can take
    it before the child serves. SO_REUSEADDR, as uvicorn binds: the connections it accepts
    inherit it, so a restart can bind the port again over their TIME_WAIT.
    Raises OSError when the port is in use."""
    s = socket.socket(family)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host`` and ``--port`` (loopback by default: a server is reachable from elsewhere
    only when asked), and ``--listen-fd``: serve on a socket a parent process (``tandem up``)
    bound for us."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for "
        "every interface, with --api-key; the operator and tandem up pass their own)",
    )
    parser.add_argument("--port", type=int, default=8000, help="the port")
    parser.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)


def inherited_sockets(listen_fd: int | None) -> list[socket.socket] | None:
    """uvicorn's ``sockets`` for ``--listen-fd`` (None: uvicorn binds ``--host``/``--port``)."""
    return None if listen_fd is None else [socket.socket(fileno=listen_fd)]
