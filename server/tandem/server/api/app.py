"""The FastAPI app factory: routes, error handlers, auth, and the engine loop's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from tandem.server.engine import LLMEngine
from tandem.server.wire import agent_routes
from tandem.server.wire.auth import AuthMiddleware
from tandem.server.wire.body import JSONBodyGuard
from tandem.server.wire.edge import install_edge
from tandem.server.wire.errors import install_error_handlers
from tandem.server.wire.protocol import ERROR_RESPONSES

from . import (
    agent_apis,
    distserve_routes,
    embedding_routes,
    lora_routes,
    native_routes,
    ollama,
    openai_routes,
    ops_routes,
    token_routes,
    weights_routes,
)
from .chat_history import ChatHistories
from .engine_loop import AsyncEngine
from .lora_config import watch_lora_config
from .metrics import ServerMetrics
from .state import ServerSettings, ServerState

log = logging.getLogger("tandem.api")


def build_app(
    settings: ServerSettings,
    build_engine: Callable[[], LLMEngine],
    *,
    tokenizer: Any,
    vocab_size: int,
    on_engine_failure: Callable[[BaseException], None] | None = None,
    kv_transfer_host: str = "127.0.0.1",
    kv_transfer_port: int = 0,
    kv_transfer_timeout: float = 5.0,
    registration: ProxyRegistration | None = None,
) -> FastAPI:
    """One server: the engine is built by ``build_engine`` on the engine thread at startup (the
    app answers 503 until it is ready) and stopped at shutdown.

    ``tokenizer`` is the API's own copy (chat templates, prompt encoding, logprob token
    text); the engine keeps its own, so the two threads never share one.
    """
    holder: dict[str, ServerState] = {}
    metrics = ServerMetrics(
        settings.served_model_name,
        engine=lambda: holder["s"].engine,
    )
    transport = _KVTransport(
        settings.role,
        kv_transfer_host,
        kv_transfer_port,
        transport_key(settings.internal_api_key),
        kv_transfer_timeout,
    )
    engine = AsyncEngine(
        build_engine,
        max_waiting=settings.max_waiting_requests,
        session_ttl=settings.session_ttl,
        metrics=metrics,
        on_failure=on_engine_failure,
        on_ready=transport.start,
        puller=transport.puller,
    )
    state = holder["s"] = ServerState(
        settings=settings,
        engine=engine,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        metrics=metrics,
        histories=ChatHistories(settings.session_ttl),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        announce = (
            asyncio.ensure_future(registration.announce(engine, settings)) if registration else None
        )
        lora_config = asyncio.ensure_future(watch_lora_config(state))
        try:
            yield
        finally:
            state.draining = True
            lora_config.cancel()
            if announce is not None:
                announce.cancel()
                await registration.withdraw(settings)
            engine.shutdown()
            transport.close()
            state.tokenizer_pool.shutdown(wait=False)

    app = FastAPI(
        title="Tandem engine",
        version="0.1.0",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
        description="OpenAI-compatible API with LMDeploy's and Ollama's native routes. Unknown request "
        "fields are accepted and ignored; known fields are type-checked strictly (400).",
    )
    app.state.tandem = state
    install_error_handlers(app)
    app.include_router(openai_routes.router, tags=["openai"])
    app.state.agent_apis = agent_apis.agent_apis()
    app.include_router(agent_routes.router, tags=["agents"])
    app.include_router(agent_apis.router, tags=["agents"])
    app.include_router(native_routes.router, tags=["native"])
    app.include_router(ollama.router, tags=["ollama"])
    app.include_router(token_routes.router, tags=["tokens"])
    app.include_router(embedding_routes.router, tags=["embeddings"])
    app.include_router(ops_routes.router, tags=["ops"])
    app.include_router(distserve_routes.router, tags=["distserve"])
    app.include_router(weights_routes.router, tags=["ops"])
    app.include_router(lora_routes.router, tags=["ops"])
    app.add_middleware(JSONBodyGuard)  # inside auth: no body is read for an unknown caller
    if not settings.credentials.open:
        app.add_middleware(AuthMiddleware, credentials=settings.credentials)
    install_edge(app, settings.edge)  # outermost: a 401 carries the request id too
    return app


def transport_key(internal_api_key: str | None) -> bytes | None:
    from tandem.server.wire.trust import derive_key

    return derive_key(internal_api_key, "kv-transport") if internal_api_key else None


class _KVTransport:
    """The engine's P/D transport: a prefill-capable engine serves its leased blocks, a
    decode-capable one pulls. Started on the engine thread once the KV cache exists."""

    def __init__(
        self, role: str, host: str, port: int, key: bytes | None, timeout_s: float
    ) -> None:
        from tandem.server.disagg.puller import KVPuller

        self.role, self.host, self.port, self.key = role, host, port, key
        self.server: Any = None
        self._engine: LLMEngine | None = None
        self.puller = (
            KVPuller(lambda: self._engine.kv_layout, timeout_s=timeout_s, key=key)
            if role in ("decode", "both")
            else None
        )

    def start(self, engine: LLMEngine) -> None:
        from tandem.server.disagg.transport import KVTransportServer

        self._engine = engine
        if self.role in ("prefill", "both"):
            self.server = KVTransportServer(
                engine.kv_cache,
                engine.leased_blocks,
                engine.release_lease,
                host=self.host,
                port=self.port,
                layout=engine.kv_layout,
                key=self.key,
            ).start()
            engine.transport_address = self.server.address
            log.info("KV transport listening on %s", self.server.address)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            self.puller.close()


@dataclass(frozen=True)
class ProxyRegistration:
    """``--proxy-url``: join the proxy's node registry once the engine is ready, leave on shutdown."""

    proxy_url: str
    engine_url: str
    api_key: str | None = None

    async def announce(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        from tandem.server.api.announce import register_engine

        while engine.state == "loading":
            await asyncio.sleep(0.2)
        if engine.state != "ready":
            return
        try:
            await register_engine(
                self.proxy_url,
                self.engine_url,
                settings.role,
                [settings.served_model_name],
                self.api_key,
            )
        except RuntimeError as exc:
            log.error("%s", exc)

    async def withdraw(self, settings: ServerSettings) -> None:
        from tandem.server.api.announce import deregister_engine

        await deregister_engine(
            self.proxy_url,
            self.engine_url,
            settings.role,
            [settings.served_model_name],
            self.api_key,
        )
