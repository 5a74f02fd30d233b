"""The proxy's FastAPI app: OpenAI routes in front, LMDeploy's node and DistServe routes beside.

Everything the app holds (registry, routing state, HTTP client, counters) lives on
``app.state.proxy``, so two proxies in one process (tests) share nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from tandem.server.wire.auth import (
    PROXY_ADMIN_PATHS,
    PROXY_ADMIN_PREFIXES,
    AuthMiddleware,
    Credentials,
)
from tandem.server.wire.body import JSONBodyGuard, ParsedJSONRoute, parsed_body
from tandem.server.wire.edge import (
    DEFAULT_MAX_TOKENS,
    EdgeSettings,
    install_edge,
    request_id_header,
)
from tandem.server.wire.errors import APIError, error_response, install_error_handlers
from tandem.server.wire.ollama import OLLAMA_VERSION, ollama_model
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    METRICS_RESPONSES,
    SSE_RESPONSES,
    AbortRequest,
    APIModel,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EncodeRequest,
    GenerateRequest,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    PoolingRequest,
    SessionId,
    TokenizeRequest,
    UpdateWeightsRequest,
    streamed,
)
from tandem.server.wire.tenancy import request_owner, session_key

from .node_address import NodeNetworks
from .pd_flow import PATHS, FlowConfig, PDFlow
from .registry import (
    DECODE_ROLES,
    PREFILL_ROLES,
    ROLE_IDS,
    UNREACHABLE,
    HealthPoller,
    Registry,
    normalize_url,
    parse_role,
)

log = logging.getLogger("tandem.proxy")


class NodeStatusBody(APIModel):
    """LMDeploy's ``status`` of a node: its role and the models it serves (more is kept)."""

    role: str | int | None = None  # a name, or LMDeploy's number
    models: list[str] | None = None


class NodeBody(APIModel):
    """``/nodes/add``, ``/nodes/remove``, ``/nodes/terminate``: LMDeploy's node request."""

    url: Annotated[str, Field(min_length=1, max_length=2048)]  # "host:port" means http://
    status: NodeStatusBody | None = None
    models: list[str] | None = None


# The body of each route the proxy forwards as is: the engine's model for it.
_ROUTED_BODIES: dict[str, type[BaseModel]] = {
    "generate": GenerateRequest,
    "ollama_generate": OllamaGenerateRequest,
    "ollama_chat": OllamaChatRequest,
    "ollama_show": OllamaShowRequest,
    "embeddings": EmbeddingRequest,
    "pooling": PoolingRequest,
    "encode": EncodeRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
}

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ProxySettings:
    """Everything ``tandem proxy`` configures; the app factory's one argument.

    ``api_key`` is one client key; ``credentials`` the full set (client keys, internal,
    admin; ``docs/security.md``), to which ``api_key`` is added."""

    api_key: str | None = None
    credentials: Credentials = field(default_factory=Credentials)
    flow: FlowConfig = field(default_factory=FlowConfig)
    static_nodes: list[tuple[str, str]] = field(default_factory=list)  # (url, role)
    health_interval: float = 2.0
    dead_threshold: int = 3
    startup_grace: float = 600.0
    # seconds an engine that answered before may stay down (stalled, restarting) before it
    # is forgotten; it is probed with a backoff meanwhile (--forget-after)
    forget_after: float = 600.0
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    # max_tokens the proxy writes into a chat request that sets none (--default-max-tokens).
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    # Started with the app, stopped with it: e.g. Kubernetes discovery. Gets the registry.
    discovery: Callable[[Registry], contextlib.AbstractAsyncContextManager[None]] | None = None
    # Where POST /nodes/add may point (--allow-node-networks); link-local never.
    node_networks: NodeNetworks = field(default_factory=NodeNetworks)


@dataclass
class ProxyState:
    settings: ProxySettings
    registry: Registry
    flow: PDFlow
    client: httpx.AsyncClient
    poller: HealthPoller
    started_at: float = field(default_factory=time.time)
    created: int = field(default_factory=lambda: int(time.time()))


_GENERATION_RESPONSES = SSE_RESPONSES | {502: ERROR_RESPONSES[503], 504: ERROR_RESPONSES[503]}


def _routed_responses(kind: str) -> dict[int | str, dict[str, Any]]:
    """What a forwarded route answers: the engine's answers (a stream for ``/generate`` and
    Ollama's generation routes) and the proxy's own 502/504."""
    if kind == "generate":
        return _GENERATION_RESPONSES
    extra = {502: ERROR_RESPONSES[503], 504: ERROR_RESPONSES[503]}
    if kind in ("ollama_generate", "ollama_chat"):
        return ERROR_RESPONSES | streamed("application/x-ndjson", "one JSON object a line") | extra
    return ERROR_RESPONSES | extra


def get_state(request: Request) -> ProxyState:
    return request.app.state.proxy


def build_app(settings: ProxySettings) -> FastAPI:
    """One proxy. Engines join through ``settings.static_nodes``, ``POST /nodes/add`` or discovery."""
    registry = Registry(
        dead_threshold=settings.dead_threshold,
        startup_grace=settings.startup_grace,
        forget_after=settings.forget_after,
    )
    for url, role in settings.static_nodes:
        registry.add(url, role, None, source="static")
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        timeout=httpx.Timeout(settings.flow.request_timeout, connect=settings.flow.connect_timeout),
    )
    flow = PDFlow(registry, client, settings.flow)
    poller = HealthPoller(
        registry, client, interval=settings.health_interval, secret=settings.flow.engine_api_key
    )
    state = ProxyState(
        settings=settings, registry=registry, flow=flow, client=client, poller=poller
    )
    flow.reprobe = poller.reprobe  # a request waiting on an engine probes it now

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await poller.poll_once()
        task = asyncio.create_task(poller.run())
        async with contextlib.AsyncExitStack() as stack:
            if settings.discovery is not None:
                await stack.enter_async_context(settings.discovery(registry))
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await poller.aclose()
                await flow.aclose()
                await client.aclose()

    app = FastAPI(
        title="Tandem proxy",
        version="0.1.0",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
        description="One OpenAI endpoint over prefill, decode and aggregated Tandem engines.",
    )
    app.router.route_class = ParsedJSONRoute
    app.state.proxy = state
    install_error_handlers(app)
    _add_openai_routes(app)
    _add_node_routes(app)
    _add_ops_routes(app)
    app.add_middleware(JSONBodyGuard)  # inside auth: no body is read for an unknown caller
    credentials = _credentials(settings)
    if not credentials.open:
        app.add_middleware(
            AuthMiddleware,
            credentials=credentials,
            admin_paths=PROXY_ADMIN_PATHS,
            admin_prefixes=PROXY_ADMIN_PREFIXES,
        )
    install_edge(app, settings.edge)
    return app


def _credentials(settings: ProxySettings) -> Credentials:
    """The proxy is the clients' front door: with no client key configured, clients need
    none (the admin and internal planes stay closed)."""
    c = settings.credentials
    clients = c.client_keys | ({settings.api_key} if settings.api_key else set())
    return Credentials(frozenset(clients), c.internal_key, c.admin_key, keyless_clients=True)


def _json_body(request: Request) -> dict[str, Any]:
    """The body ``JSONBodyGuard`` parsed (a copy: routes add fields), if it is an object."""
    body = parsed_body(request)
    if not isinstance(body, dict):
        raise APIError(
            400,
            "the request body must be a JSON object",
            code="invalid_value",
        )
    return dict(body)


def _client_body(body: dict[str, Any], request: Request) -> dict[str, Any]:
    """A client's generation request, already validated against the engine's own model (the
    route's declared body): the P/D handoff field is the proxy's own, never theirs, and a
    session id is scoped to the client's key before it reaches an engine."""
    owner = request_owner(request)
    if owner and body.get("session_id") is not None:
        body = {**body, "session_id": session_key(body["session_id"], owner)}
    if "kv_transfer_params" in body:
        raise APIError(
            403,
            "kv_transfer_params belongs to the internal P/D plane and cannot be sent by clients",
            code="kv_transfer_forbidden",
            param="kv_transfer_params",
        )
    return body


def _add_openai_routes(app: FastAPI) -> None:
    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat_completions(_: ChatCompletionRequest, request: Request) -> Response:
        """Routed to the engines; ``stream: true`` is passed through chunk by chunk."""
        state = get_state(request)
        body = _client_body(_json_body(request), request)
        if state.settings.default_max_tokens and not (
            body.get("max_tokens") or body.get("max_completion_tokens")
        ):
            body["max_tokens"] = state.settings.default_max_tokens
        return await state.flow.handle("chat", body, request)

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(_: CompletionRequest, request: Request) -> Response:
        body = _client_body(_json_body(request), request)
        return await get_state(request).flow.handle("completions", body, request)

    def routed(path: str, kind: str) -> None:
        async def route(_: BaseModel, request: Request) -> Response:
            body = _client_body(_json_body(request), request)
            return await get_state(request).flow.handle(kind, body, request)

        route.__doc__ = f"Routed to an engine serving the model (``{path}`` there)."
        # The engine's own request model: the OpenAPI document declares the body the engine
        # takes, and the proxy refuses what the engine would, before routing it.
        route.__annotations__ = {**route.__annotations__, "_": _ROUTED_BODIES[kind]}
        app.post(path, name=kind, responses=_routed_responses(kind))(route)

    for kind, path in PATHS.items():
        if kind not in ("chat", "completions"):
            routed(path, kind)

    @app.post("/abort_request", responses=ERROR_RESPONSES)
    async def abort_request(_: AbortRequest, request: Request) -> JSONResponse:
        """LMDeploy's abort: a session's requests on the engine holding the session (every
        decode engine if the proxy does not know it), or ``abort_all`` on every engine."""
        state = get_state(request)
        body = _client_body(_json_body(request), request)
        session = body.get("session_id")
        held = state.flow.sessions.get(str(session)) if session not in (None, "", -1) else None
        urls = (
            [held]
            if held and not body.get("abort_all")
            else [n.url for n in state.registry.nodes() if n.healthy]
        )
        headers = {**state.flow.headers, **request_id_header(request)}

        async def one(url: str) -> httpx.Response | None:
            try:
                return await state.client.post(
                    url + "/abort_request", json=body, headers=headers, timeout=10.0
                )
            except httpx.HTTPError:
                return None

        answers = [r for r in await asyncio.gather(*(one(u) for u in urls)) if r is not None]
        refused = next((r for r in answers if r.status_code >= 400), None)
        if refused is not None:
            return JSONResponse(refused.json(), status_code=refused.status_code)
        return JSONResponse({"aborted": sum(int(r.json().get("aborted", 0)) for r in answers)})

    @app.post("/update_weights", responses=ERROR_RESPONSES)
    async def update_weights(_: UpdateWeightsRequest, request: Request) -> JSONResponse:
        """Every healthy engine serving ``model`` (every engine without one) loads the weights,
        all at once, each by its own policy for requests in flight; the answer lists each
        engine's. If any engine refused, the first refusal is the answer (its status and
        error), with the list beside it."""
        state = get_state(request)
        body = _json_body(request)
        model = body.get("model")
        urls = [n.url for n in state.registry.nodes() if n.healthy and n.serves(model)]
        if not urls and not any(n.serves(model) for n in state.registry.nodes()):
            raise APIError(  # the caller's mistake, not an outage
                404, f"The model '{model}' does not exist", code="model_not_found", param="model"
            )
        if not urls:
            raise APIError(503, "no healthy engine serves this model", code="no_engines")
        headers = {**state.flow.headers, **request_id_header(request)}

        async def one(url: str) -> dict[str, Any]:
            try:  # loading and draining take as long as they take
                r = await state.client.post(
                    url + "/update_weights",
                    json=body,
                    headers=headers,
                    timeout=httpx.Timeout(None, connect=10.0),
                )
                return {"url": url, "status": r.status_code, "body": r.json()}
            except (httpx.HTTPError, ValueError) as exc:
                return {"url": url, "status": 502, "body": {"error": f"{type(exc).__name__}"}}

        results = list(await asyncio.gather(*(one(u) for u in urls)))
        refused = next((r for r in results if r["status"] >= 400), None)
        if refused is not None:
            return JSONResponse({**refused["body"], "results": results}, refused["status"])
        return JSONResponse({"success": True, "results": results})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        state = get_state(request)
        if model_id not in state.registry.models():
            raise APIError(
                404,
                f"The model '{model_id}' does not exist",
                code="model_not_found",
                param="model",
            )
        return {"id": model_id, "object": "model", "created": state.created, "owned_by": "tandem"}

    @app.get("/api/tags")
    async def ollama_tags(request: Request) -> dict[str, Any]:
        """Ollama's model list: every model some healthy engine serves."""
        return {"models": [ollama_model(m) for m in get_state(request).registry.models()]}

    @app.get("/api/ps")
    async def ollama_ps(request: Request) -> dict[str, Any]:
        """Ollama's loaded models: here every served model is loaded."""
        return {"models": [ollama_model(m) for m in get_state(request).registry.models()]}

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION}

    @app.delete("/v1/sessions/{session_id}", responses=ERROR_RESPONSES)
    async def delete_session(
        session_id: Annotated[SessionId, Path()], request: Request
    ) -> Response:
        """Free a session's blocks on the engine holding it (every decode engine if unknown)."""
        state = get_state(request)
        session_id = session_key(session_id, request_owner(request)) or str(session_id)
        flow = state.flow
        held = flow.sessions.get(session_id)
        urls = [held] if held else [n.url for n in state.registry.routable(DECODE_ROLES)]
        last: Response = error_response(
            APIError(
                404,
                f"session {session_id!r} does not exist",
                code="session_not_found",
                param="session_id",
            )
        )
        silent = ""  # an engine that did not answer may hold it: not a 404 then
        for url in urls:
            try:
                r = await state.client.delete(
                    f"{url}/v1/sessions/{quote(session_id, safe='')}",
                    headers=flow.headers,
                    timeout=10.0,
                )
            except httpx.HTTPError as exc:
                silent = f"{url}: {type(exc).__name__}"
                continue
            if r.status_code < 400:
                flow.sessions.forget(session_id)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        if silent:
            raise APIError(
                503,
                f"an engine that may hold session {session_id!r} did not answer ({silent})",
                code="no_engine_available",
            )
        return last

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """Every model some healthy engine serves."""
        state = get_state(request)
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": state.created, "owned_by": "tandem"}
                for m in state.registry.models()
            ],
        }


def _add_node_routes(app: FastAPI) -> None:
    def node_fields(body: dict[str, Any]) -> tuple[str, str, list[str] | None]:
        url = body.get("url")
        if not isinstance(url, str) or not url.strip():
            raise APIError(
                400,
                "'url' is a required property",
                code="invalid_value",
                param="url",
            )
        status = body.get("status") or {}
        if not isinstance(status, dict):
            raise APIError(
                400,
                "'status' must be an object",
                code="invalid_value",
                param="status",
            )
        role = status.get("role", body.get("role"))
        try:
            role_name = parse_role(role)
        except ValueError as exc:
            raise APIError(
                400,
                str(exc),
                code="invalid_value",
                param="status.role",
            ) from exc
        models = status.get("models", body.get("models"))
        if models is not None and not (
            isinstance(models, list) and all(isinstance(m, str) for m in models)
        ):
            raise APIError(
                400,
                "'models' must be a list of strings",
                code="invalid_value",
                param="status.models",
            )
        try:
            return normalize_url(url), role_name, models
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value", param="url") from exc

    @app.post("/nodes/add", responses=ERROR_RESPONSES)
    async def add_node(_: NodeBody, request: Request) -> dict[str, Any]:
        """Add (or update) an engine; it takes requests once its ``/health`` answers 200."""
        state = get_state(request)
        body = _json_body(request)
        url, role, models = node_fields(body)
        try:
            await state.settings.node_networks.check_url(url)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value", param="url") from exc
        layout = (body.get("status") or {}).get("kv_layout")  # Tandem's addition, optional
        node = state.registry.add(
            url, role, models, source="registered", kv_layout=str(layout) if layout else None
        )
        await state.poller.probe(url)
        return {
            "url": node.url,
            "role": node.role_id,
            "role_name": node.role,
            "healthy": node.healthy,
        }

    @app.post("/nodes/remove", responses=ERROR_RESPONSES)
    async def remove_node(_: NodeBody, request: Request) -> dict[str, Any]:
        state = get_state(request)
        url, _, _ = node_fields({"status": {}, **(_json_body(request))})
        node = state.registry.remove(url)
        return {"url": url, "removed": node is not None}

    @app.get("/nodes/status")
    async def node_status(request: Request) -> dict[str, Any]:
        """``{url: status}`` as LMDeploy's proxy answers, with health and load added."""
        return {n.url: n.status() for n in get_state(request).registry.nodes()}

    async def terminate(state: ProxyState, url: str) -> dict[str, Any]:
        """Only a registered engine that proved it holds the credential, and only its status
        is reported: the proxy fetches no address a caller names and echoes nothing it read
        (no SSRF, no port scan)."""
        node = state.registry.remove(url)
        if node is None:
            raise APIError(
                404,
                f"{url} is not a registered engine",
                code="node_not_found",
                param="url",
            )
        if not node.verified:  # it never proved it holds the credential: it gets none
            return {"url": url, "was_registered": True, "terminated": False, "detail": UNREACHABLE}
        try:
            r = await state.client.get(url + "/terminate", headers=state.flow.headers, timeout=10.0)
            ok, detail = r.status_code < 400, f"HTTP {r.status_code}"
        except httpx.HTTPError:
            ok, detail = False, UNREACHABLE
        return {"url": url, "was_registered": True, "terminated": ok, "detail": detail}

    @app.post("/nodes/terminate", responses=ERROR_RESPONSES)
    async def terminate_node(_: NodeBody, request: Request) -> dict[str, Any]:
        """Stop one engine (its ``/terminate``: drain, then exit) and drop it."""
        state = get_state(request)
        url, _, _ = node_fields({"status": {}, **(_json_body(request))})
        return await terminate(state, url)

    @app.api_route("/nodes/terminate_all", methods=["GET", "POST"])
    async def terminate_all(request: Request) -> dict[str, Any]:
        state = get_state(request)
        results = await asyncio.gather(*(terminate(state, n.url) for n in state.registry.nodes()))
        return {"terminated": list(results)}

    @app.post("/distserve/connection_warmup")
    async def connection_warmup(request: Request) -> JSONResponse:
        """Have every decode engine connect to every prefill engine now (``p2p_connect``),
        so the first request pays no handshake and a KV layout mismatch shows up here."""
        state = get_state(request)
        return await _warmup(state)

    @app.post("/distserve/gc")
    async def gc(request: Request) -> dict[str, Any]:
        """Sweep expired leases on every prefill engine."""
        state = get_state(request)
        nodes = state.registry.routable(PREFILL_ROLES)

        async def one(url: str) -> dict[str, Any]:
            try:
                r = await state.client.post(
                    url + "/distserve/gc", headers=state.flow.headers, timeout=10.0
                )
                return {"url": url, "status": r.status_code}
            except httpx.HTTPError as exc:
                return {"url": url, "error": f"{type(exc).__name__}: {exc}"}

        return {"results": list(await asyncio.gather(*(one(n.url) for n in nodes)))}


async def _warmup(state: ProxyState) -> JSONResponse:
    client, headers = state.client, state.flow.headers
    prefills = state.registry.routable(PREFILL_ROLES)
    decodes = state.registry.routable(DECODE_ROLES)
    results: list[dict[str, Any]] = []

    async def info(url: str) -> dict[str, Any] | str:
        try:
            r = await client.get(url + "/distserve/engine_info", headers=headers, timeout=10.0)
            return (
                r.json()
                if r.status_code == 200
                else f"engine_info answered {r.status_code}: {r.text[:200]}"
            )
        except (httpx.HTTPError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"

    async def connect(p_url: str, p_info: dict[str, Any], d_url: str) -> dict[str, Any]:
        body = {
            "remote_engine_id": p_info.get("engine_id"),
            "remote_engine_endpoint_info": {
                "zmq_address": (p_info.get("transport") or {}).get("address")
                or p_info.get("address")
            },
            "remote_engine_url": p_url,
        }
        try:
            r = await client.post(
                d_url + "/distserve/p2p_connect", json=body, headers=headers, timeout=30.0
            )
            ok = r.status_code < 400
            return {
                "prefill": p_url,
                "decode": d_url,
                "ok": ok,
                "status": r.status_code,
                **({} if ok else {"error": r.text[:300]}),
            }
        except httpx.HTTPError as exc:
            return {
                "prefill": p_url,
                "decode": d_url,
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
            }

    infos = await asyncio.gather(*(info(p.url) for p in prefills))
    jobs = []
    for p, p_info in zip(prefills, infos):
        if isinstance(p_info, str):
            results.extend(
                {"prefill": p.url, "decode": d.url, "ok": False, "error": p_info} for d in decodes
            )
            continue
        jobs.extend(connect(p.url, p_info, d.url) for d in decodes if d.url != p.url)
    results.extend(await asyncio.gather(*jobs))
    ok = all(r["ok"] for r in results)
    return JSONResponse({"ok": ok, "connections": results}, status_code=200 if ok else 502)


def _add_ops_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 when some decode or aggregated engine can take requests, else 503."""
        state = get_state(request)
        nodes = state.registry.nodes()
        by_role = {role: sum(1 for n in nodes if n.healthy and n.role == role) for role in ROLE_IDS}
        ready = any(n.healthy and n.role in DECODE_ROLES for n in nodes)
        body = {
            "status": "ok" if ready else "no_engines",
            "nodes": len(nodes),
            "healthy_nodes": by_role,
            "uptime_seconds": round(time.time() - state.started_at, 3),
            "in_flight": sum(n.inflight for n in nodes),
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics(request: Request) -> Response:
        """Prometheus text: requests by route/mode/status, failures, fallbacks, nodes."""
        reg = CollectorRegistry()
        reg.register(_ProxyCollector(get_state(request)))
        return Response(generate_latest(reg), media_type=CONTENT_TYPE)


class _ProxyCollector(Collector):
    """The proxy's counters and node gauges, read at scrape time."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        stats = self.state.flow.stats
        c = CounterMetricFamily(
            "tandem_proxy_requests",
            "Requests answered, by route, mode and status",
            labels=["route", "mode", "status"],
        )
        for (route, mode, status), n in sorted(stats.requests.items()):
            c.add_metric([route, mode, str(status)], n)
        yield c
        for name, doc, value in [
            (
                "tandem_proxy_prefill_failures",
                "Prefill steps that failed and were retried elsewhere",
                stats.prefill_failures,
            ),
            ("tandem_proxy_decode_failures", "Decode steps that failed", stats.decode_failures),
            (
                "tandem_proxy_lease_releases",
                "Prefill leases released by the proxy",
                stats.lease_releases,
            ),
            (
                "tandem_proxy_aggregated_fallbacks",
                "Disaggregated requests served on one engine instead",
                stats.fallbacks_aggregated,
            ),
            (
                "tandem_proxy_client_disconnects",
                "Clients that left before their answer",
                stats.client_disconnects,
            ),
            (
                "tandem_proxy_stalls",
                "Engines given up on by a request for making no progress (--stall-timeout)",
                stats.stalls,
            ),
            (
                "tandem_proxy_engine_waits",
                "Requests that waited for an engine expected back (restarting, stalled)",
                stats.waits,
            ),
            (
                "tandem_proxy_unserved_requests",
                "Requests refused because no engine was running (activates a pool at zero)",
                stats.unserved,
            ),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
        yield SummaryMetricFamily(
            "tandem_proxy_request_seconds",
            "Time to the start of the response",
            count_value=stats.latency_count,
            sum_value=stats.latency_sum,
        )
        nodes = self.state.registry.nodes()
        g = GaugeMetricFamily(
            "tandem_proxy_nodes", "Known engines, by role and health", labels=["role", "healthy"]
        )
        for role in ROLE_IDS:
            for healthy in (True, False):
                g.add_metric(
                    [role, str(healthy).lower()],
                    sum(1 for n in nodes if n.role == role and n.healthy == healthy),
                )
        yield g
        g = GaugeMetricFamily(
            "tandem_proxy_in_flight", "Requests the proxy has open, by engine", labels=["node"]
        )
        for n in nodes:
            g.add_metric([n.url], n.inflight)
        yield g
