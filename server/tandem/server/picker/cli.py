"""``tandem epp``: the endpoint picker a Gateway API Inference Extension gateway asks over
``ext_proc`` (``docs/gateway.md``). Engines come as ``tandem proxy`` takes them: ``--node``
flags locally, Kubernetes discovery in a cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

from tandem.server.proxy.routing import POLICIES
from tandem.server.wire.auth import add_credential_arguments, credentials_from_args

from .choice import PickerConfig
from .server import PickerSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9002, help="the gRPC port (GIE's default)")
    add_credential_arguments(parser, "TANDEM_EPP_API_KEY")
    parser.set_defaults(api_key=None)  # the gateway authenticates clients; the picker has none
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="URL[=ROLE]",
        help="a static engine (repeatable); ROLE is both (default), prefill or decode",
    )
    parser.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    parser.add_argument("--namespace", default=None, help="pods' namespace (default: this pod's)")
    parser.add_argument("--selector", default="tandem.dev/role", help="engine pods' selector")
    parser.add_argument("--disagg-threshold", type=int, default=32)
    parser.add_argument(
        "--policy",
        "--routing-policy",
        dest="policy",
        choices=POLICIES,
        default="score",
        help="score: prefix affinity minus load; least_load; round_robin",
    )
    parser.add_argument(
        "--shed-queue",
        type=int,
        default=None,
        help="answer 429 when every engine that could serve a request has this many waiting",
    )
    parser.add_argument("--health-interval", type=float, default=2.0)
    parser.add_argument(
        "--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes"
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def settings_from_args(args: argparse.Namespace) -> PickerSettings:
    """The picker's settings; the internal credential from the environment or a file."""
    from tandem.server.proxy.cli import namespace_of
    from tandem.server.proxy.discovery import kubernetes_discovery, parse_node_flag

    credentials = credentials_from_args(args, os.environ, "TANDEM_EPP_API_KEY")
    config = PickerConfig(
        policy=args.policy,
        disagg_threshold=args.disagg_threshold,
        shed_queue=args.shed_queue,
        internal_key=credentials.internal_key,
    )
    discovery = (
        kubernetes_discovery(namespace_of(args.namespace), args.selector)
        if args.discovery == "kubernetes"
        else None
    )
    return PickerSettings(
        config=config,
        static_nodes=tuple(parse_node_flag(v) for v in args.node),
        health_interval=args.health_interval,
        metrics_interval=args.metrics_interval,
        discovery=discovery,
    )


def run(args: argparse.Namespace) -> int:
    from tandem.server.logsafe import configure_logging

    from .server import serve

    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        logging.getLogger("tandem.picker").error("bad arguments: %s", exc)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, f"{args.host}:{args.port}"))
    return 0
