"""The decode side's half of the transport: runs the engine's pull tasks off the engine thread.

One client per prefill engine address, its KV layout checked against ours on first contact
(a mismatch fails the pull with a message that names the differing fields). Each finished
pull releases the prefill engine's lease at once rather than waiting for it to expire.

Bounded whatever peers do: clients share one ZMQ context (one I/O thread), at most
``max_peers`` are kept (the least recently used is closed), a peer that fails is dropped
at once, and one peer's pulls hold at most ``max_workers // 2`` workers, so a dead or
silent prefill engine cannot stall the pulls from the others.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import zmq

from tandem.server.engine.kv_cache import KVCache
from tandem.server.engine.kv_transfer import KVLayout, PullTask

from .transport import DEFAULT_TIMEOUT_S, KVTransportClient, TransportError

Done = Callable[[str, str | None], None]


class KVPuller:
    def __init__(
        self,
        local_layout: Callable[[], KVLayout],
        max_workers: int = 4,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        key: bytes | None = None,
        max_peers: int = 32,
    ) -> None:
        self.local_layout = local_layout
        self.timeout_s = timeout_s
        self.key = key
        self.max_peers = max_peers
        self.per_peer = max(1, max_workers // 2)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="tandem-pull"
        )
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._clients: collections.OrderedDict[str, KVTransportClient] = collections.OrderedDict()
        self._checked: set[str] = set()
        self._queued: dict[str, collections.deque[tuple[PullTask, KVCache, Done]]] = {}
        self._active: collections.Counter[str] = collections.Counter()

    @property
    def num_peers(self) -> int:
        with self._lock:
            return len(self._clients)

    def connect(self, address: str) -> str | None:
        """Open (or reuse) the connection and check layouts; returns the problem, if any.
        A peer that fails is not kept: its socket is closed at once."""
        try:
            client = self._client(address)
            if address not in self._checked:
                problem = self.local_layout().mismatch(client.layout())
                if problem:
                    self.drop(address)
                    return f"prefill engine at {address}: {problem}"
                self._checked.add(address)
        except (TransportError, zmq.ZMQError) as exc:
            self.drop(address)
            return str(exc) or type(exc).__name__
        return None

    def drop(self, address: str) -> None:
        with self._lock:
            client = self._clients.pop(address, None)
            self._checked.discard(address)
        if client is not None:
            client.close()

    def submit(self, task: PullTask, kv_cache: KVCache, done: Done) -> None:
        """Run ``task`` in the pool; ``done(request_id, error_or_None)`` is called from a pool thread."""
        with self._lock:
            self._queued.setdefault(task.address, collections.deque()).append(
                (task, kv_cache, done)
            )
        self._dispatch(task.address)

    def _dispatch(self, address: str) -> None:
        """Start the peer's next queued pull if it holds fewer than ``per_peer`` workers."""
        with self._lock:
            queue = self._queued.get(address)
            if not queue or self._active[address] >= self.per_peer:
                return
            item = queue.popleft()
            if not queue:
                del self._queued[address]
            self._active[address] += 1
        try:
            self._pool.submit(self._run_counted, *item)
        except RuntimeError:  # shut down: the engine is stopping
            pass

    def _run_counted(self, task: PullTask, kv_cache: KVCache, done: Done) -> None:
        try:
            self._run(task, kv_cache, done)
        finally:
            with self._lock:
                self._active[task.address] -= 1
                if self._active[task.address] <= 0:
                    del self._active[task.address]
            self._dispatch(task.address)

    def _run(self, task: PullTask, kv_cache: KVCache, done: Done) -> None:
        error = self.connect(task.address)
        if error is None:
            try:
                client = self._client(task.address)
                client.pull(task.lease_id, task.remote_block_ids, kv_cache, task.local_block_ids)
                client.release(task.lease_id)
            except (TransportError, ValueError, RuntimeError, zmq.ZMQError) as exc:
                error = str(exc) or type(exc).__name__
                self.drop(task.address)  # the prefill side frees the blocks when the lease expires
        done(task.request_id, error)

    def _client(self, address: str) -> KVTransportClient:
        evicted: list[Any] = []
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = KVTransportClient(
                    address, self.timeout_s, key=self.key, context=self._ctx
                )
                while len(self._clients) > self.max_peers:
                    old, gone = self._clients.popitem(last=False)
                    self._checked.discard(old)
                    evicted.append(gone)
            self._clients.move_to_end(address)
        for gone in evicted:
            gone.close()
        return client

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), collections.OrderedDict()
        for client in clients:
            client.close(wait=False)
        # The context is not terminated: a pull still blocked on a silent peer holds a socket,
        # and term() would wait for it; the process is stopping anyway.
