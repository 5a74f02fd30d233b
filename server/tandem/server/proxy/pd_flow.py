"""One client request through the proxy: route it, then run it aggregated or as prefill -> decode.

The two-step flow (docs/proxy.md, "The two-step flow"):

1. the prefill engine P gets the request with ``max_tokens: 1``, ``stream: false`` and
   ``kv_transfer_params: {do_remote_decode: true}``; it answers the first token and a lease
   on the KV blocks it keeps for the decode side;
2. the decode engine D gets the client's original request plus P's ``kv_transfer_params``
   (and P's URL); it pulls the blocks, releases P's lease and answers as any engine would,
   streamed or not (when P's one token already ended the request, D answers with it and
   only releases the lease). The proxy passes D's answer through untouched, chunk by chunk:
   it reads ``kv_transfer_params`` out of P's answer and nothing else out of any body.

Failure rules, so that no engine holds blocks for nobody:

- a client that goes away cancels the upstream HTTP request of whichever step is running;
  the engine sees its client disconnect and aborts the request (freeing its blocks);
- when the decode step ends without D having answered anything (connect error, an error
  status, the client gone), the proxy releases P's lease itself (``/distserve/free_cache``);
  a D that dies after it answered has pulled already, and P's lease expiry covers the rest;
- a prefill engine that cannot be reached or fails (5xx) is marked unhealthy and the next
  one is tried; when none is left the request runs aggregated on the decode side;
- a decode engine that cannot be reached is marked unhealthy and the request runs
  aggregated on another one; one that dies mid-answer ends the request with a clear error
  (HTTP 502, or an error event in a stream: the tokens already sent cannot be unsent).

No request hangs on a stalled engine (``FlowConfig.stall_timeout``). Each request has one
``Deadline``: ``stall_timeout`` seconds from its arrival or from the last byte passed to its
client, shared by every wait inside it (a stream's next byte, the prefill step, failing over,
waiting for an engine expected back), so a client never waits longer than that in total. An
engine silent for ``SUSPECT_AFTER_S`` is re-probed at once (``reprobe``); one the poller
found not answering is given up after ``STALL_CONFIRM_S`` of silence. If nothing reached the
client yet the request goes to another engine (or, for a prefill, aggregated to the decode
side), else the stream ends with an error event and ``[DONE]``. A request that finds no
healthy engine while one is expected back (stalled, restarting) re-probes it and waits for it
while its deadline lasts instead of failing at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response

from tandem.server.wire.edge import request_id_header
from tandem.server.wire.errors import APIError, ClientDisconnected, error_body, error_response
from tandem.server.wire.prefill_step import prefill_request
from tandem.server.wire.sse import (
    SSE_HEADERS,
    DisconnectAwareStreamingResponse,
    error_event,
    ndjson_line,
)
from tandem.server.wire.tenancy import TENANT_HEADER, request_tenant

from . import routing
from .deadline import Deadline
from .registry import DECODE_ROLES, PREFILL_ROLES, Node, Registry

log = logging.getLogger("tandem.proxy")

T = TypeVar("T")

# Every engine route the proxy routes, by kind. Only "chat" and "completions" can run as
# prefill -> decode (the handoff speaks OpenAI's shapes); ``routing.disaggregatable`` says why
# the others run on one engine.
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
    "ollama_generate": "/api/generate",
    "ollama_chat": "/api/chat",
    "ollama_show": "/api/show",
    "ollama_embed": "/api/embed",
    "ollama_embeddings": "/api/embeddings",
    "ollama_pull": "/api/pull",
    "embeddings": "/v1/embeddings",
    "pooling": "/pooling",
    "encode": "/v1/encode",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "count_tokens": "/v1/messages/count_tokens",
}
STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
DISCONNECT_POLL_S = 0.2
# Statuses after which the same request may succeed on another engine (nothing ran there).
RETRYABLE_STATUS = frozenset({502, 503, 504})
RETRY_AFTER_SECONDS = 15  # a 503 for want of engines: about one autoscaler poll
# Silence after which a request gives up on an engine the health poller already found down.
STALL_CONFIRM_S = 2.0
# Silence after which an engine is suspected and re-probed at once (not at the next poll).
SUSPECT_AFTER_S = 1.0
# The prefill step's share of a request's deadline: the rest is the decode side's.
PREFILL_SHARE = 0.5


def tenant_header(request: Request) -> dict[str, str]:
    """The caller's prefix-cache partition for the engine (``tenancy.request_tenant``): the
    engine sees only the proxy's internal credential, so the proxy names whose request it is,
    and every engine of a P/D pair salts its cache the same way."""
    tenant = request_tenant(request)
    return {TENANT_HEADER: tenant} if tenant else {}


@dataclass
class FlowConfig:
    """The proxy's routing and retry knobs (``tandem proxy`` flags)."""

    disagg_threshold: int = 32
    policy: str = "score"
    engine_api_key: str | None = None
    max_attempts: int = 3  # engines tried per step before giving up on that step
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    stall_timeout: float = 10.0  # seconds without progress before an engine is given up


@dataclass
class FlowStats:
    """Counters the proxy's /metrics reports; plain ints, owned by one app."""

    requests: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (route, mode, status)
    prefill_failures: int = 0
    decode_failures: int = 0
    lease_releases: int = 0
    fallbacks_aggregated: int = 0
    client_disconnects: int = 0
    unserved: int = 0  # refused for want of any engine: scale-from-zero demand
    stalls: int = 0  # engines given up on for making no progress
    waits: int = 0  # requests that waited for an engine expected back
    latency_sum: float = 0.0
    latency_count: int = 0

    def count(self, route: str, mode: str, status: int) -> None:
        key = (route, mode, status)
        self.requests[key] = self.requests.get(key, 0) + 1


@dataclass
class Job:
    """One client request on its disaggregated way: what it asks (``kind``, ``body``), who
    asks (``request``, watched for leaving), its prompt's prefix chunks and estimated length
    (routing affinity) and its one deadline for progress."""

    kind: str
    body: dict[str, Any]
    request: Request
    chunks: list[bytes]
    prompt_tokens: int
    deadline: Deadline


class PDFlow:
    """Routes and runs requests; one per proxy app."""

    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        config: FlowConfig,
        prefix: routing.PrefixIndex | None = None,
        sessions: routing.SessionTable | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.config = config
        self.prefix = prefix or routing.PrefixIndex()
        self.sessions = sessions or routing.SessionTable()
        self.stats = FlowStats()
        self._turn = routing.round_robin_counter()
        self._background: set[asyncio.Task] = set()
        # Probe these engines now (the app wires the health poller's ``reprobe``).
        self.reprobe: Callable[[list[str]], None] = lambda urls: None
        registry.on_remove(lambda n: (self.prefix.forget(n.url), self.sessions.forget_node(n.url)))

    # --- helpers ----------------------------------------------------------------------------
    @property
    def headers(self) -> dict[str, str]:
        return (
            {"Authorization": f"Bearer {self.config.engine_api_key}"}
            if self.config.engine_api_key
            else {}
        )

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.config.request_timeout, connect=self.config.connect_timeout)

    def _pick(
        self, nodes: list[Node], chunks: list[bytes], prompt_tokens: int
    ) -> tuple[Node, int] | None:
        """The best node and the prompt tokens it likely has cached."""
        c = routing.pick(
            routing.candidates(nodes, self.prefix, chunks),
            prompt_tokens,
            self.config.policy,
            next(self._turn),
        )
        if c is None:
            return None
        return next(n for n in nodes if n.url == c.url), c.cached_tokens

    def _spawn(self, aw: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(aw)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def deadline(self) -> Deadline:
        """A fresh request's deadline for progress."""
        return Deadline(self.config.stall_timeout)

    async def aclose(self) -> None:
        for t in list(self._background):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(t, 2.0)

    async def free_cache(self, prefill: Node | str, kv: dict[str, Any]) -> None:
        """Release a prefill engine's lease (best effort: the lease expires anyway)."""
        url = prefill if isinstance(prefill, str) else prefill.url
        body = {
            "remote_engine_id": kv.get("remote_engine_id"),
            "remote_lease_id": kv.get("remote_lease_id"),
        }
        self.stats.lease_releases += 1
        try:
            r = await self.client.post(
                url + "/distserve/free_cache", json=body, headers=self.headers, timeout=10.0
            )
            if r.status_code >= 400:
                log.debug("free_cache on %s answered %d: %s", url, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            log.info("free_cache on %s failed (%s); the lease expires on its own", url, exc)

    # --- entry point ------------------------------------------------------------------------
    async def handle(self, kind: str, body: dict[str, Any], request: Request) -> Response:
        """Serve one ``/v1/chat/completions`` (kind "chat") or ``/v1/completions`` request."""
        start = time.monotonic()
        mode = "direct"
        try:
            response, mode = await self._handle(kind, body, request, self.deadline())
        except APIError as err:
            self.stats.client_disconnects += isinstance(err, ClientDisconnected)
            response = error_response(err)
        self.stats.count(kind, mode, response.status_code)
        self.stats.latency_sum += time.monotonic() - start
        self.stats.latency_count += 1
        return response

    async def _handle(
        self, kind: str, body: dict[str, Any], request: Request, deadline: Deadline
    ) -> tuple[Response, str]:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, "'model' must be a string", code="invalid_value", param="model")
        decoders = self.registry.routable(DECODE_ROLES, model)
        if not decoders:
            decoders = await self._await_engines(model, request, deadline)
        if not decoders:
            self._raise_unroutable(model)
        text = routing.prompt_text(kind, body)
        root = routing.chain_root(model, self.registry.adapter_parents())
        chunks = routing.chunk_hashes(text, self.prefix.chunk_chars, root)
        prompt_tokens = routing.estimate_tokens(kind, body, text)

        session = body.get("session_id")
        session_key = str(session) if session not in (None, "", -1) else None
        if session_key is not None:
            sticky = self.sessions.get(session_key)
            held = next((n for n in decoders if n.url == sticky), None)
            if held is not None:
                return await self.forward(
                    held, kind, body, request, chunks, decoders, session_key, deadline
                ), "session"
        prefillers = self.registry.routable(PREFILL_ROLES, model)
        why_not = routing.disaggregatable(kind, body)
        if session_key is not None:
            why_not = "session"  # a session's blocks stay on the engine that holds it
        route = routing.plan(
            routing.candidates(decoders, self.prefix, chunks),
            routing.candidates(prefillers, self.prefix, chunks),
            prompt_tokens,
            policy=self.config.policy,
            turn=next(self._turn),
            disagg_threshold=self.config.disagg_threshold,
            why_not=why_not,
        )
        assert route is not None
        decode = next(n for n in decoders if n.url == route.decode.url)
        if route.prefill is not None:
            # Pair only engines of one KV layout: mid-rollout, old prefill and new decode meet.
            prefillers = [p for p in prefillers if p.kv_layout == decode.kv_layout]
            same_layout = [d for d in decoders if d.kv_layout == decode.kv_layout]
            job = Job(kind, body, request, chunks, prompt_tokens, deadline)
            return await self.disaggregated(job, prefillers, decode, same_layout)
        return await self.forward(
            decode, kind, body, request, chunks, decoders, session_key, deadline
        ), "direct"

    def _raise_unroutable(self, model: str | None) -> None:
        nodes = self.registry.nodes()
        if model not in (None, "", "default") and nodes and not any(n.serves(model) for n in nodes):
            served = sorted({m for n in nodes for m in n.models})
            raise APIError(
                404,
                f"The model '{model}' does not exist; this proxy serves "
                f"{', '.join(repr(m) for m in served) or 'no model yet'}",
                code="model_not_found",
                param="model",
            )
        # Scaled to zero, or starting: this request is the demand that activates the pool
        # (the unserved counter); the client is told when to come back.
        self.stats.unserved += 1
        raise APIError(
            503,
            "no engine is running to serve this request (no healthy decode or aggregated "
            "engine" + (f" for model {model!r}" if model else "") + "); if the pool is "
            f"scaled to zero it is starting now: retry after {RETRY_AFTER_SECONDS} seconds",
            code="no_engine_available",
            retry_after=RETRY_AFTER_SECONDS,
        )

    # --- aggregated: one engine serves the whole request ---------------------------------------
    async def forward(
        self,
        first: Node,
        kind: str,
        body: dict[str, Any],
        request: Request,
        chunks: list[bytes],
        alternatives: list[Node],
        session_key: str | None = None,
        deadline: Deadline | None = None,
    ) -> Response:
        """Send the request as is to ``first``; on a connect failure, a stall before anything
        reached the client or a retryable status, to the next best of ``alternatives``; when
        none is left but one is expected back (restarting, stalled), wait for it once. Every
        wait draws on ``deadline`` (a fresh one if not given)."""
        deadline = deadline or self.deadline()
        last_error = "no engine tried"
        tried: set[str] = set()
        for _ in range(2):
            for node in self._attempts(alternatives, chunks, 0, tried, first, deadline):
                try:
                    bound = self._bound(body, deadline)
                    resp = await self._open(node, kind, body, request, bound)
                    if resp.status_code in RETRYABLE_STATUS:
                        last_error = f"{node.url} answered {resp.status_code}"
                        await resp.aclose()
                        continue
                    self.prefix.record(node.url, chunks)
                    if session_key is not None and resp.status_code < 400:
                        self.sessions.set(session_key, node.url)
                    return await self._relay(node, resp, request, body, deadline=deadline)
                except _Unreachable as exc:
                    last_error = str(exc)
                    self._record_down(node, exc)
            alternatives = await self._await_engines(body.get("model"), request, deadline)
            first, tried = None, set()
        if deadline.expired():
            last_error = (
                f"no progress within the stall timeout ({deadline.budget:g}s); {last_error}"
            )
        raise APIError(
            503, f"no engine could take the request: {last_error}", code="no_engine_available"
        )

    def _bound(self, body: dict[str, Any], deadline: Deadline) -> Deadline | None:
        """How long an answer may make no progress: a stream must show bytes within its
        request's deadline; a whole non-streamed answer may take as long as it takes, and is
        given up only once the health poller finds its engine down."""
        return deadline if body.get("stream") else None

    def _record_down(self, node: Node, exc: Exception) -> None:
        """Count a failed engine against it; a request given up on its deadline after only a
        short silence there (the budget went elsewhere) re-probes the engine instead."""
        stalled = isinstance(exc, _Stalled)
        if stalled and exc.silent < STALL_CONFIRM_S and node.healthy:
            self.reprobe([node.url])
            return
        self.stats.stalls += stalled
        self.registry.record_failure(node.url, str(exc), stalled=stalled)

    async def _await_engines(
        self, model: Any, request: Request, deadline: Deadline | None = None
    ) -> list[Node]:
        """No healthy decode engine: if one is expected back (restarting under ``tandem up``,
        stalled, loading), re-probe it now and wait for it while the request's deadline lasts
        rather than fail at once."""
        model = model if isinstance(model, str) else None
        deadline = deadline or self.deadline()
        waited = False
        while not (nodes := self.registry.routable(DECODE_ROLES, model)):
            returning = self.registry.returning(DECODE_ROLES, model)
            if deadline.expired() or not returning:
                break
            self.stats.waits += not waited
            waited = True
            self.reprobe([n.url for n in returning])  # rate-limited by the poller
            await watch_progress(asyncio.sleep(min(0.1, deadline.remaining())), request)
        return nodes

    def _attempts(
        self,
        nodes: list[Node],
        chunks: list[bytes],
        prompt_tokens: int,
        tried: set[str],
        first: Node | None = None,
        deadline: Deadline | None = None,
    ) -> Iterator[Node]:
        """The nodes to try in turn: ``first``, then the best healthy node of ``nodes`` not in
        ``tried``, until ``max_attempts`` are tried, none is left or ``deadline`` expired.
        Each joins ``tried``."""
        node = first
        while len(tried) < self.config.max_attempts:
            if deadline is not None and deadline.expired():
                return
            if node is None:
                rest = [n for n in nodes if n.healthy and n.url not in tried]
                picked = self._pick(rest, chunks, prompt_tokens)
                if picked is None:
                    return
                node = picked[0]
            tried.add(node.url)
            yield node
            node = None

    async def _open(
        self,
        node: Node,
        kind: str,
        body: dict[str, Any],
        request: Request,
        bound: Deadline | None = None,
    ) -> httpx.Response:
        """Send the request and wait for the status line (streamed body left open), watching
        the client: if it leaves, the upstream request is cancelled and ClientDisconnected raised.
        No status line by ``bound`` (or the engine found down) raises _Stalled."""
        req = self.client.build_request(
            "POST",
            node.url + PATHS[kind],
            json=body,
            headers={**self.headers, **request_id_header(request), **tenant_header(request)},
            timeout=self._timeout(),
        )
        node.inflight += 1
        try:
            return await self._watch(self.client.send(req, stream=True), request, node, bound)
        except (
            httpx.ConnectError,
            httpx.ConnectTimeout,
            httpx.RemoteProtocolError,
            httpx.ReadError,
            httpx.WriteError,
            httpx.ReadTimeout,
            httpx.PoolTimeout,
        ) as exc:
            raise _Unreachable(f"{node.url}: {type(exc).__name__}: {exc}") from exc
        finally:
            node.inflight -= 1

    async def _relay(
        self,
        node: Node,
        resp: httpx.Response,
        request: Request,
        body: dict[str, Any],
        on_end: Callable[[bool], Awaitable[None]] | None = None,
        deadline: Deadline | None = None,
    ) -> Response:
        """Pass an engine's open response to the client: a stream chunk by chunk, anything else whole.

        ``on_end(got_data)`` runs once the engine's response is over (or abandoned), with
        whether any of it reached the proxy. A stream's bytes are due by ``deadline``, which
        starts over with each chunk passed to the client.
        """
        deadline = deadline or self.deadline()
        media = resp.headers.get("content-type", "").split(";")[0].strip()
        is_stream = resp.status_code == 200 and media in STREAM_TYPES
        if not is_stream:
            got = False
            try:
                content = await self._watch(resp.aread(), request, node)
                got = True
            except (httpx.HTTPError, _Stalled) as exc:
                self.registry.record_failure(node.url, f"{type(exc).__name__}: {exc}")
                raise APIError(
                    502,
                    f"the engine at {node.url} failed mid-request: {type(exc).__name__}: {exc}",
                    type="upstream_error",
                    code="engine_failed",
                ) from exc
            finally:
                await resp.aclose()
                if on_end is not None:
                    await on_end(got)
            headers = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type",)}
            return Response(content, status_code=resp.status_code, headers=headers)

        chunks = resp.aiter_raw()
        try:  # nothing has reached the client yet: a stall here can still go elsewhere
            first = await self._next_chunk(chunks, node, request, deadline)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
                if on_end is not None:
                    await on_end(False)
            if isinstance(exc, httpx.HTTPError):
                raise _Unreachable(f"{node.url}: {type(exc).__name__}: {exc}") from exc
            raise
        return DisconnectAwareStreamingResponse(
            self._passthrough(node, resp, chunks, first, media, on_end, deadline),
            media_type=media,
            headers=SSE_HEADERS,
        )

    async def _next_chunk(
        self,
        chunks: AsyncIterator[bytes],
        node: Node,
        request: Request | None,
        deadline: Deadline,
    ) -> bytes | None:
        """The next non-empty chunk of an engine's stream (None at its end), or _Stalled once
        ``deadline`` passed without one."""
        while True:
            try:
                chunk = await self._watch(chunks.__anext__(), request, node, deadline)
            except StopAsyncIteration:
                return None
            if chunk:
                return chunk

    async def _passthrough(
        self,
        node: Node,
        resp: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes | None,
        media: str,
        on_end: Callable[[bool], Awaitable[None]] | None,
        deadline: Deadline,
    ) -> AsyncIterator[bytes]:
        """The engine's stream, byte for byte; if the engine fails or stalls mid-stream, an
        error event in OpenAI's shape and ``[DONE]`` (an NDJSON error line), never a hang."""
        got = first is not None
        tail = first[-2:] if first else b"\n\n"
        node.inflight += 1
        try:
            chunk = first
            while chunk is not None:
                tail = chunk[-2:]
                yield chunk
                deadline.progress()  # the client got bytes: its wait starts over
                chunk = await self._next_chunk(chunks, node, None, deadline)
        except (httpx.HTTPError, _Stalled) as exc:
            self._record_down(node, exc)
            self.stats.decode_failures += 1
            log.warning("engine %s failed mid-stream: %s", node.url, exc)
            yield _stream_error(node, exc, media, tail)
        finally:
            node.inflight -= 1
            with anyio.CancelScope(shield=True):
                await resp.aclose()
                if on_end is not None:
                    await on_end(got)

    async def _watch(
        self, aw: Awaitable[T], request: Request | None, node: Node, bound: Deadline | None = None
    ) -> T:
        """``watch_progress`` that re-probes ``node`` once it has been silent a while."""
        return await watch_progress(aw, request, node, bound, lambda n: self.reprobe([n.url]))

    # --- disaggregated: prefill on P, decode on D ------------------------------------------------
    async def disaggregated(
        self, job: Job, prefillers: list[Node], decode: Node, decoders: list[Node]
    ) -> tuple[Response, str]:
        """Prefill on one of ``prefillers``, hand the KV over, decode on ``decode`` (or the next
        of ``decoders``). Whatever fails before the client got anything runs aggregated, each
        way its own exit: no handoff (``_no_handoff``), D's KV pull failed (``_pull_failed``),
        no decode engine took the handoff (``_no_decoder``)."""
        step = await self._prefill(job, prefillers)
        if isinstance(step, Response):  # P refused the request itself: any engine would
            return step, "disaggregated"
        kv = self._handoff(step)
        if step is None or kv is None:
            return await self._no_handoff(job, decode, decoders)
        prefill = step[0]
        self.prefix.record(prefill.url, job.chunks)
        tried: set[str] = set()
        served = await self._decode(job, decoders, decode, prefill, kv, tried)
        if served is not None:
            return served
        return await self._no_decoder(job, decoders, tried)

    async def _prefill(
        self, job: Job, prefillers: list[Node]
    ) -> tuple[Node, Any] | Response | None:
        """The prefill step: (the engine, its parsed answer), the engine's 4xx answer to pass
        on, or None when no prefill engine took it. It may use ``PREFILL_SHARE`` of the
        request's deadline; the rest is left to the decode side."""
        bound = job.deadline.capped(job.deadline.budget * PREFILL_SHARE)
        prefill_body = prefill_request(job.body)
        for prefill in self._attempts(
            prefillers, job.chunks, job.prompt_tokens, set(), None, bound
        ):
            try:
                resp = await self._open(prefill, job.kind, prefill_body, job.request, bound)
                try:
                    content = await self._watch(resp.aread(), job.request, prefill, bound)
                finally:
                    await resp.aclose()
            except (_Unreachable, httpx.HTTPError) as exc:
                self.stats.prefill_failures += 1
                self._record_down(prefill, exc)
                log.warning("prefill on %s failed (%s); trying another", prefill.url, exc)
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                self.stats.prefill_failures += 1
                log.warning(
                    "prefill on %s answered %d: %s", prefill.url, resp.status_code, content[:200]
                )
                if resp.status_code not in (429, 503):
                    self.registry.record_failure(
                        prefill.url, f"prefill answered {resp.status_code}"
                    )
                continue
            if resp.status_code >= 400:  # the request itself is wrong: any engine would say so
                return _as_response(resp, content)
            try:
                return prefill, json.loads(content)
            except ValueError:
                log.warning("prefill on %s answered invalid JSON", prefill.url)
        return None

    @staticmethod
    def _handoff(step: tuple[Node, Any] | None) -> dict[str, Any] | None:
        """The prefill answer's ``kv_transfer_params``, or None when it handed no KV over (an
        engine without P/D support: the request is decoded aggregated)."""
        if step is None:
            return None
        prefill, answer = step
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            log.warning("prefill engine %s returned no kv_transfer_params", prefill.url)
            return None
        return kv

    async def _decode(
        self,
        job: Job,
        decoders: list[Node],
        decode: Node,
        prefill: Node,
        kv: dict[str, Any],
        tried: set[str],
    ) -> tuple[Response, str] | None:
        """The decode step on ``decode``, then the next of ``decoders``: the answer, or None
        when none took the handoff (P's lease released; the caller runs it aggregated)."""
        decode_body = {**job.body, "kv_transfer_params": {**kv, "remote_engine_url": prefill.url}}
        bound = self._bound(job.body, job.deadline)
        for node in self._attempts(
            decoders, job.chunks, job.prompt_tokens, tried, decode, job.deadline
        ):
            try:
                resp = await self._open(node, job.kind, decode_body, job.request, bound)
            except _Unreachable as exc:
                self.stats.decode_failures += 1
                self._record_down(node, exc)
                log.warning("decode on %s unreachable (%s)", node.url, exc)
                continue
            except ClientDisconnected:
                self._spawn(self.free_cache(prefill, kv))
                raise
            if resp.status_code >= 400:
                return await self._decode_refused(job, node, resp, decoders, prefill, kv)
            self.prefix.record(node.url, job.chunks)

            async def on_end(got_data: bool, pf: Node = prefill) -> None:
                if not got_data:  # in the background: a stalled P must not hold the client
                    self._spawn(self.free_cache(pf, kv))

            try:
                relayed = await self._relay(node, resp, job.request, job.body, on_end, job.deadline)
                return relayed, "disaggregated"
            except _Unreachable as exc:  # D stalled before its first byte; on_end freed P's lease
                self.stats.decode_failures += 1
                self._record_down(node, exc)
                return None
        # No decode engine took the handoff: release P's blocks.
        self._spawn(self.free_cache(prefill, kv))
        return None

    async def _decode_refused(
        self,
        job: Job,
        node: Node,
        resp: httpx.Response,
        decoders: list[Node],
        prefill: Node,
        kv: dict[str, Any],
    ) -> tuple[Response, str]:
        """D refused or failed before answering: it freed its own blocks; P's lease goes too.
        Its answer is the client's, unless it is a 502: its KV pull failed (``_pull_failed``)."""
        self.stats.decode_failures += resp.status_code >= 500
        self._spawn(self.free_cache(prefill, kv))
        if resp.status_code != 502:
            return await self._relay(node, resp, job.request, job.body), "disaggregated"
        await resp.aclose()
        return await self._pull_failed(job, node, prefill, decoders)

    # --- the aggregated fallbacks: what failed before the client got anything ------------------
    async def _no_handoff(
        self, job: Job, decode: Node, decoders: list[Node]
    ) -> tuple[Response, str]:
        """No prefill engine handed KV over (none took the request, or one without P/D support
        answered it): the whole request runs on the decode engine it was routed to."""
        return await self._aggregated(job, decode, decoders, "no prefill handoff for the request")

    async def _pull_failed(
        self, job: Job, node: Node, prefill: Node, decoders: list[Node]
    ) -> tuple[Response, str]:
        """D's KV pull from P failed (D answered 502: P died or hung after answering): P is
        suspect, and the request runs aggregated on D, never on the same failed pair again."""
        self.stats.prefill_failures += 1
        self.registry.record_failure(prefill.url, "a decode engine's KV pull from it failed")
        why = f"KV pull from {prefill.url} to {node.url} failed"
        return await self._aggregated(job, node, decoders, why)

    async def _no_decoder(
        self, job: Job, decoders: list[Node], tried: set[str]
    ) -> tuple[Response, str]:
        """No decode engine took the handoff (P's lease is released): the whole request runs
        on a decode engine not tried yet, or on one coming back; a 503 when there is none."""
        rest = [n for n in decoders if n.healthy and n.url not in tried]
        rest = rest or await self._await_engines(job.body.get("model"), job.request, job.deadline)
        if not rest:
            raise APIError(
                503, "no decode engine could take the request", code="no_engine_available"
            )
        return await self._aggregated(job, rest[0], rest, "no decode engine took the handoff")

    async def _aggregated(
        self, job: Job, first: Node, alternatives: list[Node], why: str
    ) -> tuple[Response, str]:
        """Serve a request meant for P/D whole on ``first`` (or the next of ``alternatives``),
        counted as an aggregated fallback."""
        self.stats.fallbacks_aggregated += 1
        log.warning("%s; serving it aggregated on %s", why, first.url)
        response = await self.forward(
            first, job.kind, job.body, job.request, job.chunks, alternatives, deadline=job.deadline
        )
        return response, "aggregated_fallback"


def _as_response(resp: httpx.Response, content: bytes) -> Response:
    headers = {"content-type": resp.headers.get("content-type", "application/json")}
    return Response(content, status_code=resp.status_code, headers=headers)


def _stream_error(node: Node, exc: Exception, media: str, tail: bytes) -> bytes:
    """The last bytes of a stream its engine failed: an OpenAI-shaped error event and
    ``[DONE]`` (an NDJSON error line for Ollama's framing), after a separator if needed."""
    stalled = isinstance(exc, _Stalled)
    what = "stalled" if stalled else "failed"
    err = error_body(
        504 if stalled else 502,
        f"the engine at {node.url} {what} mid-stream: {exc}",
        type="upstream_error",
        code="engine_stalled" if stalled else "engine_failed",
    )
    if media == "application/x-ndjson":
        sep = b"" if tail.endswith(b"\n") else b"\n"
        return sep + ndjson_line({**err, "done": True})
    sep = b"" if tail == b"\n\n" else b"\n\n"
    return sep + error_event(err)


class _Unreachable(Exception):
    """The engine could not be reached or dropped the connection before answering."""


class _Stalled(_Unreachable):
    """The engine took the request and made no progress in time (stopped, hung, swapping)."""

    def __init__(self, message: str, silent: float = 0.0) -> None:
        super().__init__(message)
        self.silent = silent  # how long this engine was silent before it was given up


def _gave_up(node: Node | None, waited: float, bound: Deadline | None) -> bool:
    """``bound`` passed, or silence for ``STALL_CONFIRM_S`` from an engine the health poller
    has found not answering (a 503 while draining is an answer: not given up)."""
    if bound is not None and bound.expired():
        return True
    return node is not None and node.failures > 0 and not node.healthy and waited >= STALL_CONFIRM_S


async def watch_client(aw: Awaitable[T], request: Request | None) -> T:
    """Await ``aw`` unless the client disconnects first; then cancel it (closing the upstream
    connection, which makes the engine abort) and raise ClientDisconnected."""
    return await watch_progress(aw, request)


async def watch_progress(
    aw: Awaitable[T],
    request: Request | None,
    node: Node | None = None,
    bound: Deadline | None = None,
    suspect: Callable[[Node], None] | None = None,
) -> T:
    """``watch_client``, and give up on ``node`` (cancel ``aw``, raise _Stalled) when it makes
    no progress by ``bound``: a stalled engine never holds its clients longer than the stall
    timeout. A bounded wait silent for ``SUSPECT_AFTER_S`` calls ``suspect(node)`` once."""
    task = asyncio.ensure_future(aw)
    start = time.monotonic()
    suspected = False
    try:
        while True:
            timeout = (
                DISCONNECT_POLL_S if bound is None else min(DISCONNECT_POLL_S, bound.remaining())
            )
            done, _ = await asyncio.wait({task}, timeout=max(timeout, 0.01))
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                raise ClientDisconnected()
            waited = time.monotonic() - start
            if _gave_up(node, waited, bound):
                url = node.url if node is not None else "engine"
                raise _Stalled(f"{url}: no progress for {waited:.1f}s", waited)
            if suspect and node and bound and not suspected and waited >= SUSPECT_AFTER_S:
                suspected = True
                suspect(node)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
