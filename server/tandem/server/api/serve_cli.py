"""``tandem serve``: the engine's HTTP server on uvicorn.

SIGTERM (or ``GET /terminate``) stops admitting at once (new requests get 503), lets the
requests in flight finish for up to ``--shutdown-timeout`` seconds, aborts what is left,
and exits 0. An engine that fails to load makes the process exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from tandem.server.engine.engine_args import add_engine_arguments, engine_config_from_args
from tandem.server.logsafe import add_log_level_argument, configure_logging
from tandem.server.net import add_listen_arguments, inherited_sockets, reserve_port
from tandem.server.wire.auth import add_credential_arguments, credentials_from_args
from tandem.server.wire.edge import add_edge_arguments, edge_from_args

from .reasoning import PARSERS as REASONING_PARSERS
from .state import ROLES, ServerSettings
from .tool_parsers import PARSERS as TOOL_PARSERS

if TYPE_CHECKING:
    from .app import ProxyRegistration

log = logging.getLogger("tandem.api")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="an HF-format model directory or a .gguf file (default: smollm2-135m-instruct, "
        "downloaded once into the cache)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients use in 'model' (default: the model directory's or file's name)",
    )
    add_listen_arguments(parser)
    parser.add_argument(
        "--api-key",
        default=None,
        help="a client key: require 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY; "
        "prefer the environment or --api-key-file: arguments are visible in ps)",
    )
    add_credential_arguments(parser, "TANDEM_API_KEY")
    parser.add_argument(
        "--role", choices=ROLES, default="both", help="this engine's part in P/D disaggregation"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="admission limit: requests waiting for the engine beyond this get 429",
    )
    parser.add_argument(
        "--session-ttl",
        type=float,
        default=600.0,
        help="seconds an idle session keeps its KV blocks",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="grace period for requests in flight after SIGTERM",
    )
    parser.add_argument(
        "--kv-transfer-host",
        default=None,
        help="address the P/D KV transport listens on and advertises (default: --host, or this "
        "host's address when --host is 0.0.0.0)",
    )
    parser.add_argument(
        "--kv-transfer-port", type=int, default=0, help="KV transport port (0: any free port)"
    )
    parser.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=5.0,
        help="seconds a KV pull waits for each answer from a prefill engine before failing",
    )
    parser.add_argument(
        "--proxy-url", default=None, help="register with this Tandem proxy on start-up"
    )
    parser.add_argument(
        "--proxy-api-key",
        default=None,
        help="the key for registering with the proxy (default: $TANDEM_PROXY_API_KEY, else the "
        "internal credential)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_PARSERS,
        help="how tool calls are written (default: from the chat template's family)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split <think>...</think> into reasoning_content",
    )
    add_log_level_argument(parser)
    add_edge_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tandem.server.engine import LLMEngine
    from tandem.server.engine.config import ConfigError
    from tandem.server.engine.default_model import one_line, resolve_model
    from tandem.server.engine.loader import read_model_config
    from tandem.server.engine.models.config import ModelLoadError
    from tandem.server.engine.tokenizer import load_tokenizer

    from .app import build_app

    configure_logging(args.log_level)
    if args.node_rank:  # another node of a multi-node replica: ranks only, no API
        return _run_member(args)
    if (listener := _listener(args)) is None:
        return 1
    try:
        model_dir, default_name = resolve_model(args.model)
        config = engine_config_from_args(args, model_dir)  # validates flags before loading
        settings = settings_from_args(args, model_dir, default_name)
        if (
            settings.role != "both"
            and not settings.credentials.open
            and not settings.internal_api_key
        ):
            log.warning(
                "role %s with keys but no internal credential: kv_transfer_params will be "
                "refused (set $TANDEM_INTERNAL_API_KEY on the proxy and every engine; "
                "docs/security.md)",
                settings.role,
            )
        tokenizer = load_tokenizer(model_dir)
        vocab_size = read_model_config(model_dir).vocab_size
    except (ModelLoadError, ConfigError, OSError, ValueError) as exc:
        # One line that says what was wrong, never a traceback: these are the user's input.
        log.error("cannot load the model: %s", one_line(exc))
        return 1

    failed: list[BaseException] = []
    server: _Server | None = None

    def on_failure(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = build_app(
        settings,
        lambda: LLMEngine(config),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        on_engine_failure=on_failure,
        kv_transfer_host=_transport_host(args),
        kv_transfer_port=args.kv_transfer_port,
        kv_transfer_timeout=args.kv_transfer_timeout,
        registration=_registration(args, settings),
    )
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(0.0, settings.shutdown_timeout) or None,
        access_log=args.log_level == "debug",
    )
    server = _Server(uv_config)
    state = app.state.tandem
    state.shutdown = lambda: server.handle_exit(signal.SIGTERM, None)
    server.on_exit_signal = lambda: setattr(state, "draining", True)
    log.info(
        "serving %s as %r on %s:%d (role %s)",
        model_dir,
        settings.served_model_name,
        args.host,
        listener.getsockname()[1],
        settings.role,
    )
    server.run(sockets=[listener])
    return 1 if failed else 0


def _run_member(args: argparse.Namespace) -> int:
    """A node other than the leader of a replica that spans nodes (``--node-rank`` > 0): it
    joins the leader's process group and runs its ranks until the leader stops
    (``engine/parallel/member.py``); it binds no port and serves nothing."""
    from tandem.server.engine.config import ConfigError
    from tandem.server.engine.default_model import one_line, resolve_model
    from tandem.server.engine.models.config import ModelLoadError
    from tandem.server.engine.parallel.member import run_member

    try:
        model_dir, _ = resolve_model(args.model)
        config = engine_config_from_args(args, model_dir)
    except (ModelLoadError, ConfigError, OSError, ValueError) as exc:
        log.error("cannot load the model: %s", one_line(exc))
        return 1
    run_member(config)
    return 0


def _listener(args: argparse.Namespace) -> socket.socket | None:
    """The socket to serve on, bound before anything loads, so a port already in use is
    said at once rather than after the model has loaded (None, logged): the one ``tandem up``
    bound for us (``--listen-fd``), else ``--host``:``--port`` bound here (SO_REUSEADDR, as
    uvicorn binds: a live listener holds the port, a dead server's TIME_WAIT does not)."""
    inherited = inherited_sockets(args.listen_fd)
    if inherited:
        return inherited[0]
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        return reserve_port(args.host, args.port, family=family)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc.strerror or exc)
        return None


def _registration(args: argparse.Namespace, settings: ServerSettings) -> ProxyRegistration | None:
    from .app import ProxyRegistration

    if not args.proxy_url:
        return None
    host = args.host if args.host not in ("0.0.0.0", "::", "") else _transport_host(args)
    return ProxyRegistration(
        args.proxy_url,
        f"http://{host}:{args.port}",
        args.proxy_api_key or os.environ.get("TANDEM_PROXY_API_KEY") or settings.internal_api_key,
    )


def _transport_host(args: argparse.Namespace) -> str:
    if args.kv_transfer_host:
        return args.kv_transfer_host
    if args.host not in ("0.0.0.0", "::", ""):
        return args.host
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def settings_from_args(
    args: argparse.Namespace,
    model_dir: str,
    default_name: str,
    environ: dict[str, str] | None = None,
) -> ServerSettings:
    """Server settings from the flags; each key falls back to its environment variable
    (``docs/security.md``)."""
    env = os.environ if environ is None else environ
    creds = credentials_from_args(args, env, "TANDEM_API_KEY")
    api_key = args.api_key or env.get("TANDEM_API_KEY") or None
    return ServerSettings(
        model_dir=model_dir,
        served_model_name=args.served_model_name or default_name,
        api_key=api_key,
        extra_api_keys=creds.client_keys - {api_key},
        internal_api_key=creds.internal_key,
        admin_api_key=creds.admin_key,
        role=args.role,
        max_waiting_requests=args.max_waiting_requests,
        session_ttl=args.session_ttl,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        edge=edge_from_args(args),
        default_max_tokens=args.default_max_tokens or None,
    )


class _Server(uvicorn.Server):
    """uvicorn's Server, told to stop admitting the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.on_exit_signal: Callable[[], None] = lambda: None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_exit_signal()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down, which would make a graceful
        # SIGTERM exit look like a kill (-15); a drained shutdown exits 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and captured and captured[-1] == sig:
            captured.pop()
