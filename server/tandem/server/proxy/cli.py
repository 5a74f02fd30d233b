"""``tandem proxy``: the OpenAI front door over prefill, decode and aggregated engines."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable

from tandem.server.logsafe import add_log_level_argument, configure_logging
from tandem.server.net import add_listen_arguments, inherited_sockets
from tandem.server.wire.auth import add_credential_arguments, credentials_from_args
from tandem.server.wire.edge import add_edge_arguments, edge_from_args

from .node_address import DEFAULT_NODE_NETWORKS, NodeNetworks, parse_networks
from .pd_flow import FlowConfig
from .registry import Registry
from .routing import POLICIES
from .state import ProxySettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_edge_arguments(parser)
    add_listen_arguments(parser)
    parser.add_argument(
        "--api-key",
        default=None,
        help="a client key: require 'Authorization: Bearer KEY' from clients (default: "
        "$TANDEM_PROXY_API_KEY; prefer the environment or --api-key-file: arguments show in ps)",
    )
    add_credential_arguments(parser, "TANDEM_PROXY_API_KEY")
    parser.add_argument(
        "--engine-api-key",
        default=None,
        help="the key the engines require, when it is not the internal credential (default: "
        "$TANDEM_ENGINE_API_KEY, else the internal credential)",
    )
    add_discovery_arguments(parser)
    parser.add_argument(
        "--allow-node-networks",
        default=",".join(DEFAULT_NODE_NETWORKS),
        metavar="CIDR,...",
        help="networks POST /nodes/add may name (default: loopback and private ranges); "
        "link-local and metadata addresses are refused regardless",
    )
    add_routing_arguments(parser)
    _add_health_arguments(parser)
    add_log_level_argument(parser)


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the engines come from: static flags or Kubernetes discovery (the proxy and the
    gateway's endpoint picker alike)."""
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="URL[=ROLE]",
        help="a static engine (repeatable); ROLE is both (default), prefill or decode",
    )
    parser.add_argument(
        "--discovery",
        choices=("static", "kubernetes"),
        default="static",
        help="kubernetes: watch engine pods labelled tandem.dev/role",
    )
    parser.add_argument(
        "--namespace", default=None, help="pods' namespace (default: this pod's, else 'default')"
    )
    parser.add_argument(
        "--selector", default="tandem.dev/role", help="label selector for engine pods"
    )


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """Which engine serves a request, and whether it runs prefill -> decode (the proxy and
    the gateway's endpoint picker alike: one scorer)."""
    parser.add_argument(
        "--disagg-threshold",
        type=int,
        default=32,
        help="prompts whose uncached part is estimated under this many tokens skip the prefill "
        "engine (0: disaggregate everything)",
    )
    parser.add_argument(
        "--policy",
        "--routing-policy",
        dest="policy",
        choices=POLICIES,
        default="score",
        help="score: prefix affinity minus load; least_load; round_robin",
    )


def _add_health_arguments(parser: argparse.ArgumentParser) -> None:
    """When an engine counts as down, stalled or gone, and how long a request waits for it."""
    parser.add_argument(
        "--health-interval", type=float, default=2.0, help="seconds between /health polls"
    )
    parser.add_argument(
        "--dead-threshold",
        type=int,
        default=3,
        help="failed polls in a row after which a registered node is dropped",
    )
    parser.add_argument(
        "--startup-grace",
        type=float,
        default=600.0,
        help="seconds a registered node that never answered /health is kept (model loading)",
    )
    parser.add_argument(
        "--forget-after",
        type=float,
        default=600.0,
        help="seconds an engine that was healthy may stay down (stalled, restarting) before "
        "it is dropped; meanwhile it is re-probed with a backoff and re-admitted when it answers",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="seconds a stream (or a prefill step) may make no progress before its engine is "
        "given up (the request goes elsewhere, or the stream ends with an error event); also "
        "how long a request waits for an engine that is expected back",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=3, help="engines tried per step before giving up"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds an engine may take to answer"
    )


def current_namespace(given: str | None) -> str:
    """``given``, else this pod's namespace, else ``default``."""
    if given:
        return given
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def discovery_from_args(
    args: argparse.Namespace,
) -> Callable[[Registry], contextlib.AbstractAsyncContextManager[None]] | None:
    """``--discovery kubernetes``: the pod watch (``--namespace``, ``--selector``); None for
    static nodes only."""
    if args.discovery != "kubernetes":
        return None
    from .discovery import kubernetes_discovery

    return kubernetes_discovery(current_namespace(args.namespace), args.selector)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import build_app
    from .discovery import parse_node_flag

    configure_logging(args.log_level)
    try:
        nodes = [parse_node_flag(v) for v in args.node]
        networks = NodeNetworks(parse_networks(args.allow_node_networks))
    except ValueError as exc:
        logging.getLogger("tandem.proxy").error("bad --node or --allow-node-networks: %s", exc)
        return 2
    app = build_app(_settings(args, nodes, networks))
    logging.getLogger("tandem.proxy").info(
        "proxy on %s:%d with %d static node(s), discovery %s",
        args.host,
        args.port,
        len(nodes),
        args.discovery,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run(sockets=inherited_sockets(args.listen_fd))
    return 0


def _settings(
    args: argparse.Namespace, nodes: list[tuple[str, str]], networks: NodeNetworks
) -> ProxySettings:
    """The app's settings from the flags and the environment (keys from the environment or
    files, never only from arguments that show in ``ps``)."""
    credentials = credentials_from_args(args, os.environ, "TANDEM_PROXY_API_KEY")
    flow = FlowConfig(
        disagg_threshold=args.disagg_threshold,
        policy=args.policy,
        engine_api_key=args.engine_api_key
        or os.environ.get("TANDEM_ENGINE_API_KEY")
        or credentials.internal_key,
        max_attempts=max(1, args.max_attempts),
        request_timeout=args.request_timeout,
        stall_timeout=max(0.5, args.stall_timeout),
    )
    return ProxySettings(
        credentials=credentials,
        flow=flow,
        static_nodes=nodes,
        health_interval=args.health_interval,
        dead_threshold=args.dead_threshold,
        startup_grace=args.startup_grace,
        forget_after=args.forget_after,
        discovery=discovery_from_args(args),
        edge=edge_from_args(args),
        default_max_tokens=args.default_max_tokens or None,
        node_networks=networks,
    )
