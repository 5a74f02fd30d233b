"""Which engine one gateway request goes to: the proxy's routing plan over the proxy's
registry, from what the gateway hands the picker (the path, the body, a subset hint).

The decision is ``routing.plan``, the one the proxy takes; what differs is only what the
picker can do with it: name the decode engine to the gateway and, for prefill -> decode,
name the prefill engine to the decode engine (``x-prefiller-host-port``, signed with the
internal credential), which then drives the prefill itself (``docs/gateway.md``).
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.proxy import routing
from tandem.server.proxy.pd_flow import PATHS, RETRY_AFTER_SECONDS
from tandem.server.proxy.registry import DECODE_ROLES, PREFILL_ROLES, Node, Registry
from tandem.server.wire.trust import prefiller_signature

KINDS = {path: kind for kind, path in PATHS.items()}
UNAVAILABLE = frozenset({502, 503, 504})
# a released pick no scrape has shown counts as load this long at most (an engine whose
# /metrics does not answer)
UNSCRAPED_SECONDS = 5.0


@dataclass(frozen=True)
class PickerConfig:
    """``tandem epp``'s routing knobs (the proxy's names where they mean the same)."""

    policy: str = "score"
    disagg_threshold: int = 32
    # 429 when every engine that could serve the request has this many waiting (None: never)
    shed_queue: int | None = None
    # signs the prefill endpoint named to a decode engine (the engines' internal credential)
    internal_key: str | None = None
    # up to this many further endpoints after the chosen one, best first, for a gateway that
    # falls back down the list (GIE protocol v0.4); 0: one endpoint (Envoy's ORIGINAL_DST
    # refuses a list: docs/gateway.md)
    fallbacks: int = 0


@dataclass(frozen=True)
class Route:
    """The engine a request goes to (``ip:port``), and the prefill engine it should drive."""

    node: Node
    endpoint: str
    prefiller: tuple[str, str] | None = None  # (ip:port, signature)
    fallbacks: tuple[str, ...] = ()  # further ``ip:port``, best first

    @property
    def endpoints(self) -> str:
        """The protocol's value for header and metadata: ``ip:port[,ip:port...]``."""
        return ",".join((self.endpoint, *self.fallbacks))


@dataclass(frozen=True)
class Refusal:
    """The gateway answers the client itself: no engine, too busy, or no such model."""

    status: int
    message: str
    code: str
    retry_after: int | None = None


def endpoint_of(url: str) -> str:
    """A node's ``http://ip:port`` as the gateway names endpoints: ``ip:port``."""
    return urllib.parse.urlsplit(url).netloc


def engine_load(node: Node, unscraped: int = 0) -> int:
    """A node's load as the picker knows it: the engine's scraped queue and running count
    (``scrape.py``), the requests picked for it and not yet answered (``inflight``), and
    ``unscraped``: those whose exchange ended before any answer (a gateway that sends the
    picker no response phase ends it with the request's body) and that no scrape has shown
    yet. A request is counted twice between the engine admitting it and the next scrape."""
    return node.inflight + node.pending + node.active + unscraped


def session_of(request: dict[str, Any], caller: str) -> str | None:
    """The request's session, scoped to its caller as the engine scopes it (another key naming
    the same id is another session); the key itself is kept only as a digest."""
    value = request.get("session_id")
    if value in (None, "", -1) or not isinstance(value, str | int):
        return None
    return hashlib.sha256(caller.encode()).hexdigest()[:16] + ":" + str(value)


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object, or {} (a bodiless request, or one the engine will refuse
    in its own words: the picker routes it and the engine answers the 400)."""
    try:
        parsed = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _drop_before(released: deque[float], horizon: float) -> None:
    """Forget the releases before ``horizon`` (``released`` is in time order)."""
    while released and released[0] < horizon:
        released.popleft()


class Picker:
    """Chooses engines and keeps what the proxy keeps to choose well: the prompt chunks sent
    to each engine (prefix affinity) and the requests in flight there (load)."""

    def __init__(
        self, registry: Registry, config: PickerConfig, clock: Callable[[], float] = time.time
    ) -> None:
        self.registry = registry
        self.config = config
        self.prefix = routing.PrefixIndex()
        self.sessions = routing.SessionTable()
        self._turn = routing.round_robin_counter()
        self._clock = clock
        # per engine url: when each pick whose exchange has ended was released (monotonic,
        # oldest first: ``load`` drops those past ``UNSCRAPED_SECONDS`` from the left, so
        # counting them costs no more per request as the request rate grows)
        self._released: dict[str, deque[float]] = {}
        # Probe these engines now (the server wires the health poller's ``reprobe``).
        self.suspect: Callable[[list[str]], None] = lambda urls: None
        registry.on_remove(self._forget)

    def choose(
        self, path: str, body: bytes, subset: frozenset[str] | None, caller: str = ""
    ) -> Route | Refusal:
        """Where this request goes; ``caller`` (its ``Authorization``) scopes its session."""
        kind = KINDS.get(path.partition("?")[0], "other")
        request = parse_body(body)
        model = request.get("model") if isinstance(request.get("model"), str) else None
        decoders = self._allowed(DECODE_ROLES, model, subset)
        if not decoders:
            return self._unroutable(model)
        limit = self.config.shed_queue
        if limit is not None and all(n.pending >= limit for n in decoders):
            return Refusal(
                429, "every engine's queue is full; retry shortly", "engine_overloaded", 1
            )
        session = session_of(request, caller)
        held = next((n for n in decoders if n.url == self.sessions.get(session or "")), None)
        if held is not None:  # the engine holding the session's conversation and blocks
            held.inflight += 1
            return Route(held, endpoint_of(held.url))
        text = routing.prompt_text(kind, request)
        root = routing.chain_root(model, self.registry.adapter_parents())
        chunks = routing.chunk_hashes(text, self.prefix.chunk_chars, root)
        prompt_tokens = routing.estimate_tokens(kind, request, text)
        prefillers = self._allowed(PREFILL_ROLES, model, subset)
        plan = routing.plan(
            routing.candidates(decoders, self.prefix, chunks, self.load),
            routing.candidates(prefillers, self.prefix, chunks, self.load),
            prompt_tokens,
            policy=self.config.policy,
            turn=next(self._turn),
            disagg_threshold=self.config.disagg_threshold,
            why_not="session" if session else routing.disaggregatable(kind, request),
        )
        assert plan is not None
        node = next(n for n in decoders if n.url == plan.decode.url)
        fallbacks = () if plan.prefill else self._fallbacks(decoders, node, chunks, prompt_tokens)
        node.inflight += 1
        self.prefix.record(node.url, chunks)
        if session:
            self.sessions.set(session, node.url)
        prefiller = None
        if plan.prefill is not None:
            self.prefix.record(plan.prefill.url, chunks)
            prefiller = self._signed(endpoint_of(plan.prefill.url))
        return Route(node, endpoint_of(node.url), prefiller, fallbacks)

    def release(self, route: Route, answered: bool) -> None:
        """The request stopped holding the in-flight count: the engine's answer began
        (``answered``: the gateway sent the response's headers; an answer has begun or
        ended, and the engine's own gauges cover what is left), or the exchange ended before
        (a gateway that sends no response phase ends it with the request's body): then the
        request counts as load until a scrape begun after now shows it (``scraped``)."""
        route.node.inflight = max(0, route.node.inflight - 1)
        if not answered:
            self._released.setdefault(route.node.url, deque()).append(time.monotonic())

    def scraped(self, url: str, started: float) -> None:
        """A scrape of ``url`` begun at ``started`` (monotonic) answered: the engine's own
        queue and running count now include what was released before then; forget those.
        An engine that is never scraped keeps them for ``UNSCRAPED_SECONDS`` at most."""
        released = self._released.get(url)
        if released:
            _drop_before(released, max(started, time.monotonic() - UNSCRAPED_SECONDS))

    def load(self, node: Node) -> int:
        """``engine_load`` with the picks released there and not yet scraped."""
        released = self._released.get(node.url)
        if not released:
            return engine_load(node)
        _drop_before(released, time.monotonic() - UNSCRAPED_SECONDS)
        return engine_load(node, len(released))

    def _forget(self, node: Node) -> None:
        self.prefix.forget(node.url)
        self.sessions.forget_node(node.url)
        self._released.pop(node.url, None)

    def answered(self, route: Route, status: int, served: str | None = None) -> None:
        """The gateway's answer from the engine: a 502/503/504 (the engine refused the
        connection, died, or is not ready) has it probed at once, not at the next poll.
        ``served``: the ``ip:port`` the gateway says answered (protocol v1.0, for a gateway
        that fell back down the list), when it says; else the chosen engine."""
        if status not in UNAVAILABLE:
            return
        url = route.node.url
        if served and served != route.endpoint:
            url = next((n.url for n in self.registry.nodes() if endpoint_of(n.url) == served), url)
        self.suspect([url])

    def _allowed(
        self, roles: frozenset[str], model: str | None, subset: frozenset[str] | None
    ) -> list[Node]:
        nodes = self.registry.routable(roles, model)
        return nodes if subset is None else [n for n in nodes if endpoint_of(n.url) in subset]

    def _fallbacks(
        self, decoders: list[Node], chosen: Node, chunks: list[bytes], prompt_tokens: int
    ) -> tuple[str, ...]:
        """The next best engines after ``chosen`` (by the same scorer), for a gateway that
        falls back down the list when the first does not answer. None for prefill -> decode:
        the prefill engine is paired with its decode engine's KV layout."""
        others = [n for n in decoders if n is not chosen]
        rest = routing.candidates(others, self.prefix, chunks, self.load)
        ordered: list[str] = []
        while rest and len(ordered) < self.config.fallbacks:
            best = routing.pick(rest, prompt_tokens, self.config.policy, next(self._turn))
            assert best is not None
            rest.remove(best)
            ordered.append(endpoint_of(best.url))
        return tuple(ordered)

    def _signed(self, host_port: str) -> tuple[str, str]:
        key = self.config.internal_key
        return host_port, prefiller_signature(key, host_port, self._clock()) if key else ""

    def _unroutable(self, model: str | None) -> Refusal:
        nodes = self.registry.nodes()
        if model not in (None, "", "default") and nodes and not any(n.serves(model) for n in nodes):
            return Refusal(404, f"The model '{model}' does not exist", "model_not_found")
        return Refusal(
            503,
            "no engine is ready to serve this request; if the pool is scaled to zero it is "
            f"starting now: retry after {RETRY_AFTER_SECONDS} seconds",
            "no_engine_available",
            RETRY_AFTER_SECONDS,
        )
