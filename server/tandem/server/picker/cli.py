"""``tandem epp``: the endpoint picker a Gateway API Inference Extension gateway asks over
``ext_proc`` (``docs/gateway.md``). Engines come as ``tandem proxy`` takes them: ``--node``
flags locally, Kubernetes discovery in a cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from tandem.server.logsafe import add_log_level_argument, configure_logging
from tandem.server.proxy.cli import (
    add_discovery_arguments,
    add_routing_arguments,
    current_namespace,
    discovery_from_args,
)
from tandem.server.proxy.registry import Registry
from tandem.server.wire.auth import add_credential_arguments, credentials_from_args

from .choice import PickerConfig
from .server import PickerSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (0.0.0.0: every interface; the operator passes it)",
    )
    parser.add_argument("--port", type=int, default=9002, help="the gRPC port (GIE's default)")
    add_credential_arguments(parser, "TANDEM_EPP_API_KEY")
    parser.set_defaults(api_key=None)  # the gateway authenticates clients; the picker has none
    add_discovery_arguments(parser)
    parser.add_argument(
        "--pool-name",
        default=None,
        help="find the engines from this InferencePool (its selector and target port), as "
        "GIE's picker does (its selector rules over --selector)",
    )
    parser.add_argument(
        "--pool-namespace",
        default=None,
        help="the pool's namespace (default: --namespace, else this pod's)",
    )
    add_routing_arguments(parser)
    parser.add_argument(
        "--shed-queue",
        type=int,
        default=None,
        help="answer 429 when every engine that could serve a request has this many waiting",
    )
    parser.add_argument(
        "--fallback-endpoints",
        type=int,
        default=0,
        help="name up to this many further engines after the chosen one, best first, for a "
        "gateway that falls back down the list (0: one; Envoy's ORIGINAL_DST takes only one)",
    )
    parser.add_argument(
        "--health-interval", type=float, default=2.0, help="seconds between /health polls"
    )
    parser.add_argument(
        "--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes"
    )
    add_log_level_argument(parser)


def settings_from_args(args: argparse.Namespace) -> PickerSettings:
    """The picker's settings; the internal credential from the environment or a file."""
    from tandem.server.proxy.discovery import parse_node_flag

    credentials = credentials_from_args(args, os.environ, "TANDEM_EPP_API_KEY")
    config = PickerConfig(
        policy=args.policy,
        disagg_threshold=args.disagg_threshold,
        shed_queue=args.shed_queue,
        fallbacks=args.fallback_endpoints,
        internal_key=credentials.internal_key,
    )
    return PickerSettings(
        config=config,
        static_nodes=tuple(parse_node_flag(v) for v in args.node),
        health_interval=args.health_interval,
        metrics_interval=args.metrics_interval,
        discovery=_discovery(args),
    )


def _discovery(
    args: argparse.Namespace,
) -> Callable[[Registry], contextlib.AbstractAsyncContextManager[None]] | None:
    """The pool's pods (``--pool-name``: its selector and port rule over ``--selector``),
    or the proxy's discovery."""
    if args.pool_name is None:
        return discovery_from_args(args)
    from .pool import pool_discovery

    namespace = current_namespace(args.pool_namespace or args.namespace)
    return pool_discovery(namespace, args.pool_name)


def run(args: argparse.Namespace) -> int:
    from .server import serve

    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        logging.getLogger("tandem.picker").error("bad arguments: %s", exc)
        return 2
    asyncio.run(serve(settings, f"{args.host}:{args.port}"))
    return 0
