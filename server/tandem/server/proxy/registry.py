"""The node registry: which engines exist, their roles, and whether they can take requests.

Nodes come from three places (``--node`` flags, ``POST /nodes/add`` by engines started
with ``--proxy-url``, Kubernetes discovery) and all land here. Health comes from polling
each engine's ``/health``: a 200 makes a node routable, a 503 (loading, asleep, draining)
makes it unroutable without counting against it, and failures to answer count. After
``dead_threshold`` failures in a row a registered or discovered node is dropped (the
engine is gone; if it comes back it registers again); a static node stays listed, marked
dead, and comes back when it answers. A request that cannot reach a node marks it
unhealthy at once, so the retry that follows picks another.

An engine that was healthy and stops answering is not forgotten at once: it may be stalled
(``SIGSTOP``, a long GC, a swap storm: the connection opens, no answer comes) or dead (the
connection is refused) and coming back (``tandem up`` restarts it on the same address). Such
a node stays listed, out of routing, and is probed with a backoff until it answers again
(then it is re-admitted) or has been down ``forget_after`` seconds. Requests that find no
healthy engine while one is expected back wait for it a little (``PDFlow``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.server.wire.roles import ROLE_IDS, parse_role
from tandem.server.wire.trust import CHALLENGE_HEADER, PROOF_HEADER, new_nonce, proof_valid

log = logging.getLogger("tandem.proxy")

# Which roles serve which step: decode engines also answer plain requests (aggregated).
DECODE_ROLES = frozenset({"decode", "both"})
PREFILL_ROLES = frozenset({"prefill"})
# What /nodes/status says of any node that did not answer as an engine holding the
# credential: refused, timed out, another server, no proof alike (no port-scan oracle).
UNREACHABLE = "unreachable"
# What /nodes/status says of a node's health (``Node.health``).
HEALTHY, NOT_READY, STARTING, STALLED, DEAD = "healthy", "not_ready", "starting", "stalled", "dead"
MAX_PROBE_BACKOFF = 8.0  # seconds: a node that comes back is re-admitted this soon at worst
SUSPECT_PROBE_TIMEOUT = 2.0  # seconds a suspected node (down, or silent on a request) may take
REPROBE_MIN_INTERVAL = 0.5  # seconds between on-demand probes of one node


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` (the registry's key).

    A node is a scheme, a host and a port, nothing else: the proxy appends its own paths and
    sends the internal credential there, so a path, query, fragment or ``user@`` (which would
    aim those requests elsewhere) is a ValueError, as is anything but http(s) with a host."""
    url = url.strip()
    if not url:
        raise ValueError("empty node url")
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"node url {url!r}: the scheme must be http or https")
    if not parts.hostname or any(c.isspace() for c in url):
        raise ValueError(f"node url {url!r} has no valid host")
    if parts.path not in ("", "/") or "?" in url or "#" in url or "@" in parts.netloc:
        raise ValueError(
            f"node url {url!r}: only a scheme, host and port (no path, query, fragment or user)"
        )
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"node url {url!r}: {exc}") from None
    return url.rstrip("/")


@dataclass
class Node:
    """One engine as the proxy sees it."""

    url: str
    role: str
    models: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)  # its LoRA adapters (its /health says)
    source: str = "registered"  # "static" | "registered" | "kubernetes"
    kv_layout: str | None = None
    """Hash of the engine's KV-layout settings (Kubernetes discovery reads it from the pod):
    a prefill engine hands KV blocks only to a decode engine of the same layout."""
    healthy: bool = False
    ever_healthy: bool = False
    verified: bool = False  # its last /health proved it holds the credential (HealthPoller)
    failures: int = 0  # consecutive failures to answer (health polls or requests)
    inflight: int = 0  # requests the proxy has open there
    pending: int = 0  # the engine's reported waiting queue
    active: int = 0  # the engine's reported running requests
    free_blocks: int | None = None
    total_blocks: int | None = None
    kv_usage: float | None = None  # the engine's vllm:kv_cache_usage_perc (the picker scrapes it)
    details: dict[str, Any] | None = None  # its /health's description of its weights
    added_at: float = 0.0
    last_error: str | None = None
    last_status: str | None = None
    stalled: bool = False  # its last failure was a timeout on an open connection
    down_since: float | None = None  # when it last stopped answering (None: answering)
    next_probe_at: float = 0.0  # the poller's backoff for a node that does not answer

    @property
    def role_id(self) -> int:
        return ROLE_IDS[self.role]

    @property
    def load(self) -> int:
        return self.inflight + self.pending

    @property
    def health(self) -> str:
        """healthy, not_ready (answered 503), starting (never answered yet), stalled (answered
        before, now accepts connections and says nothing), dead (answered before, now refuses),
        or ``unreachable`` for a node never proven to be an engine: what happened to a
        connection is told only of engines that proved themselves (no port-scan oracle)."""
        if self.healthy:
            return HEALTHY
        if self.failures == 0:
            return NOT_READY if self.ever_healthy or self.last_status else STARTING
        if not self.ever_healthy:
            return UNREACHABLE
        return STALLED if self.stalled else DEAD

    def serves(self, model: str | None) -> bool:
        """A node that lists no models serves whatever it is asked (Kubernetes discovery);
        ``default`` (ZSE's) is any node's model, and Ollama's ``:latest`` tag names the same;
        a LoRA adapter's requests go only to the nodes that have it loaded."""
        if model in (None, "", "default") or model in self.adapters:
            return True
        if not self.models:
            return True
        return model in self.models or model.removesuffix(":latest") in self.models

    def status(self) -> dict[str, Any]:
        """The node's entry in ``/nodes/status`` (LMDeploy's fields plus Tandem's)."""
        return {
            "models": list(self.models),
            "lora_adapters": list(self.adapters),
            "role": self.role_id,
            "role_name": self.role,
            "unfinished": self.inflight,
            "healthy": self.healthy,
            "health": self.health,
            "source": self.source,
            "pending_requests": self.pending,
            "active_requests": self.active,
            "free_blocks": self.free_blocks,
            "total_blocks": self.total_blocks,
            "consecutive_failures": self.failures,
            "last_error": self.last_error,
            "engine_status": self.last_status,
        }


class Registry:
    """All known nodes, keyed by base URL. Mutated only on the proxy's event loop."""

    def __init__(
        self,
        dead_threshold: int = 3,
        startup_grace: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        forget_after: float = 600.0,
    ) -> None:
        if dead_threshold < 1:
            raise ValueError("dead_threshold must be >= 1")
        self.dead_threshold = dead_threshold
        self.startup_grace = startup_grace
        self.forget_after = forget_after
        self._clock = clock
        self._nodes: dict[str, Node] = {}
        self._on_remove: list[Callable[[Node], None]] = []

    # --- membership -------------------------------------------------------------------------
    def add(
        self,
        url: str,
        role: Any = "both",
        models: list[str] | None = None,
        *,
        source: str = "registered",
        kv_layout: str | None = None,
    ) -> Node:
        """Add or update a node; re-adding keeps its counters (an engine re-registering after
        a proxy restart or a discovery resync is the same engine)."""
        key = normalize_url(url)
        role_name = parse_role(role)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = Node(
                url=key,
                role=role_name,
                models=list(models or []),
                source=source,
                added_at=self._clock(),
            )
            log.info("node added: %s (%s, %s)", key, role_name, source)
        else:
            if node.role != role_name:
                log.info("node %s changed role %s -> %s", key, node.role, role_name)
            node.role = role_name
            if models is not None:
                node.models = list(models)
            if source == "static" or node.source != "static":
                node.source = source
        node.kv_layout = kv_layout
        return node

    def remove(self, url: str) -> Node | None:
        node = self._nodes.pop(normalize_url(url), None)
        if node is not None:
            log.info("node removed: %s", node.url)
            for cb in self._on_remove:
                cb(node)
        return node

    def on_remove(self, callback: Callable[[Node], None]) -> None:
        """Called with each node dropped (routing state about it is forgotten)."""
        self._on_remove.append(callback)

    def get(self, url: str) -> Node | None:
        return self._nodes.get(normalize_url(url))

    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def routable(self, roles: frozenset[str], model: str | None = None) -> list[Node]:
        """Healthy nodes in ``roles`` serving ``model``, in a stable order (by URL)."""
        return sorted(
            (n for n in self._nodes.values() if n.healthy and n.role in roles and n.serves(model)),
            key=lambda n: n.url,
        )

    def expected_back(self, roles: frozenset[str], model: str | None = None) -> bool:
        """Whether a node in ``roles`` serving ``model`` is down but may well return soon."""
        return bool(self.returning(roles, model))

    def returning(self, roles: frozenset[str], model: str | None = None) -> list[Node]:
        """The nodes in ``roles`` serving ``model`` that are down but may well return soon:
        healthy before and stopped answering (stalled, or restarting on its address), or
        registered and still loading. A request finding no healthy node waits for them."""
        now = self._clock()
        return [
            n
            for n in self._nodes.values()
            if not n.healthy
            and n.role in roles
            and n.serves(model)
            and (n.ever_healthy or now - n.added_at < self.startup_grace)
        ]

    def clock(self) -> float:
        return self._clock()

    def models(self) -> list[str]:
        """Every model name a healthy node serves, LoRA adapters included, in first-seen order."""
        seen: dict[str, None] = {}
        for n in self._nodes.values():
            if n.healthy:
                for m in [*n.models, *n.adapters]:
                    seen.setdefault(m, None)
        return list(seen)

    def adapter_parents(self) -> dict[str, str]:
        """Each LoRA adapter a healthy node serves -> the base model it adapts."""
        return {
            a: n.models[0]
            for n in self._nodes.values()
            if n.healthy and n.models
            for a in n.adapters
        }

    def model_details(self, model: str) -> dict[str, Any] | None:
        """What the weights of ``model`` are, as the first healthy engine serving it says."""
        for n in self._nodes.values():
            if n.healthy and model in n.models and n.details:
                return n.details
        return None

    # --- health -----------------------------------------------------------------------------
    def record_health(
        self,
        url: str,
        status_code: int | None,
        body: dict[str, Any] | None,
        error: str | None = None,
    ) -> None:
        """Apply one ``/health`` probe's outcome: status 200 healthy, 503 not ready, anything
        else (or no answer) a failure."""
        node = self.get(url)
        if node is None:
            return
        if isinstance(body, dict):
            node.last_status = body.get("status")
            node.pending = _int(body.get("pending_requests"), node.pending)
            node.active = _int(body.get("active_requests"), node.active)
            pool = body.get("block_pool") or {}
            if isinstance(pool, dict):
                node.free_blocks = _int(pool.get("free_blocks"), node.free_blocks)
                node.total_blocks = _int(pool.get("total_blocks"), node.total_blocks)
            if isinstance(body.get("details"), dict):
                node.details = body["details"]
            role = body.get("role")
            if role is not None:
                try:
                    node.role = parse_role(role)
                except ValueError:
                    pass
            model = body.get("model")
            if isinstance(model, str) and model and not node.models:
                node.models = [model]
            adapters = body.get("lora_adapters")
            if isinstance(adapters, list):
                node.adapters = [a for a in adapters if isinstance(a, str)]
        if status_code == 200:
            if not node.healthy:
                log.info("node healthy: %s", node.url)
            node.healthy = node.ever_healthy = True
            node.failures = 0
            node.last_error = None
            node.stalled = False
            node.down_since = None
            node.next_probe_at = 0.0
        elif status_code == 503:
            node.healthy = False
            node.failures = 0
            node.stalled = False
            node.last_error = f"not ready ({node.last_status or 'unavailable'})"
        else:
            self.record_failure(url, error or f"/health answered {status_code}")

    def record_failure(self, url: str, error: str, *, stalled: bool = False) -> bool:
        """A node failed to answer (a probe or a request); ``stalled``: it took the connection
        and said nothing in time. Returns True if it was dropped."""
        node = self.get(url)
        if node is None:
            return False
        if node.healthy:  # the detail goes to the log, never to an API answer
            log.warning("node %s: %s: %s", "stalled" if stalled else "unhealthy", node.url, error)
        else:
            log.debug("node %s failed: %s", node.url, error)
        now = self._clock()
        node.healthy = False
        node.failures += 1
        node.stalled = stalled
        node.last_error = UNREACHABLE
        if node.down_since is None:
            node.down_since = now
        if self._forget(node, now):
            log.warning("node down after %d failures, dropped: %s", node.failures, node.url)
            self.remove(url)
            return True
        return False

    def _forget(self, node: Node, now: float) -> bool:
        """A static node is never dropped. A node that never answered goes after
        ``dead_threshold`` failures once its startup grace is over; one that answered before
        is kept (stalled or restarting) and probed until it has been down ``forget_after``."""
        if node.source == "static" or node.failures < self.dead_threshold:
            return False
        if not node.ever_healthy:
            return now - node.added_at >= self.startup_grace
        return node.down_since is not None and now - node.down_since >= self.forget_after

    def probe_due(self, node: Node) -> bool:
        """The poller's backoff: a node that does not answer is probed after 1, 2, 4 ...
        poll intervals (at most ``MAX_PROBE_BACKOFF`` s), so a dead node costs little and a
        revived one is re-admitted soon."""
        return self._clock() >= node.next_probe_at

    def backoff(self, node: Node, interval: float) -> None:
        if node.failures > 0:
            delay = min(max(interval, MAX_PROBE_BACKOFF), interval * 2.0 ** (node.failures - 1))
            node.next_probe_at = self._clock() + delay


def _int(value: Any, default: Any) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class HealthPoller:
    """Polls every node's ``/health`` each ``interval`` seconds, all nodes concurrently.

    Each poll carries a fresh challenge and no credential. With ``secret`` (the credential the
    proxy sends engines) a node is healthy only if it answers with ``node_proof`` of the
    challenge: the proxy sends the credential only to nodes that proved they hold it, so
    registering an address (``/nodes/add``) cannot make the proxy hand it over."""

    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        interval: float = 2.0,
        timeout: float = 5.0,
        secret: str | None = None,
        suspect_timeout: float = SUSPECT_PROBE_TIMEOUT,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.suspect_timeout = min(timeout, suspect_timeout)
        self.secret = secret
        self._probing: set[str] = set()
        self._reprobed: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()

    def probe_timeout(self, node: Node | None) -> float:
        """A node already down is suspected: it gets the shorter ``suspect_timeout``."""
        return self.suspect_timeout if node is not None and node.failures > 0 else self.timeout

    def reprobe(self, urls: list[str]) -> None:
        """Probe these nodes now (a request waits on them, or they went silent on one), with
        the suspect timeout; at most once per ``REPROBE_MIN_INTERVAL`` per node, never twice
        at once. Returns at once: the probes run as tasks."""
        now = self.registry.clock()
        for url in urls:
            if url in self._probing or now - self._reprobed.get(url, -1e9) < REPROBE_MIN_INTERVAL:
                continue
            self._reprobed[url] = now
            task = asyncio.ensure_future(self.probe(url, self.suspect_timeout))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def probe(self, url: str, timeout: float | None = None) -> None:
        """Probe one node and record the outcome (one probe per node at a time)."""
        if url in self._probing:
            return
        self._probing.add(url)
        try:
            await self._probe(url, timeout or self.probe_timeout(self.registry.get(url)))
        finally:
            self._probing.discard(url)

    async def _probe(self, url: str, timeout: float) -> None:
        nonce = new_nonce()
        try:
            r = await self.client.get(
                url + "/health", timeout=timeout, headers={CHALLENGE_HEADER: nonce}
            )
        except (httpx.HTTPError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._verified(url, False)
            # connected, then silence: the process is there and not answering (stalled)
            stalled = isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout))
            self.registry.record_failure(url, error, stalled=stalled)
            self._backoff(url)
            return
        if self.secret and not proof_valid(self.secret, nonce, r.headers.get(PROOF_HEADER)):
            error = f"/health answered {r.status_code} without proof of the credential"
            self._verified(url, False)
            self.registry.record_health(url, None, None, error=error)
            self._backoff(url)
            return
        self._verified(url, True)
        try:
            body = r.json()
        except ValueError:
            body = None
        self.registry.record_health(url, r.status_code, body if isinstance(body, dict) else None)

    def _backoff(self, url: str) -> None:
        node = self.registry.get(url)
        if node is not None:
            self.registry.backoff(node, self.interval)

    def _verified(self, url: str, ok: bool) -> None:
        node = self.registry.get(url)
        if node is not None:
            node.verified = ok

    async def poll_once(self) -> None:
        urls = [n.url for n in self.registry.nodes() if self.registry.probe_due(n)]
        if urls:
            await asyncio.gather(*(self.probe(u) for u in urls))

    async def run(self) -> None:
        """Poll until cancelled."""
        await every(self.interval, self.poll_once, "health poll")


async def every(interval: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled: a poller outlives any one
    bad round (logged)."""
    while True:
        try:
            await step()
        except Exception:  # noqa: BLE001 - one bad answer must not stop the polling
            log.exception("%s failed", what)
        await asyncio.sleep(interval)
