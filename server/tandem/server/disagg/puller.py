"""The decode side's half of the transport: runs the engine's pull tasks off the engine thread.

One client per prefill engine address, its KV layout checked against ours on first contact
(a mismatch fails the pull with a message that names the differing fields). Each finished
pull releases the prefill engine's lease at once rather than waiting for it to expire.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from tandem.server.engine.kv_cache import KVCache
from tandem.server.engine.kv_transfer import KVLayout, PullTask

from .transport import KVTransportClient, TransportError


class KVPuller:
    def __init__(
        self, local_layout: Callable[[], KVLayout], max_workers: int = 4, timeout_s: float = 30.0
    ) -> None:
        self.local_layout = local_layout
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="tandem-pull"
        )
        self._lock = threading.Lock()
        self._clients: dict[str, KVTransportClient] = {}
        self._checked: set[str] = set()

    def connect(self, address: str) -> str | None:
        """Open (or reuse) the connection and check layouts; returns the problem, if any."""
        try:
            client = self._client(address)
            if address not in self._checked:
                problem = self.local_layout().mismatch(client.layout())
                if problem:
                    return f"prefill engine at {address}: {problem}"
                self._checked.add(address)
        except TransportError as exc:
            return str(exc)
        return None

    def drop(self, address: str) -> None:
        with self._lock:
            client = self._clients.pop(address, None)
            self._checked.discard(address)
        if client is not None:
            client.close()

    def submit(
        self, task: PullTask, kv_cache: KVCache, done: Callable[[str, str | None], None]
    ) -> None:
        """Run ``task`` in the pool; ``done(request_id, error_or_None)`` is called from a pool thread."""
        self._pool.submit(self._run, task, kv_cache, done)

    def _run(
        self, task: PullTask, kv_cache: KVCache, done: Callable[[str, str | None], None]
    ) -> None:
        error = self.connect(task.address)
        if error is None:
            try:
                client = self._client(task.address)
                client.pull(task.lease_id, task.remote_block_ids, kv_cache, task.local_block_ids)
            except (TransportError, ValueError, RuntimeError) as exc:
                error = str(exc)
        try:
            self._client(task.address).release(task.lease_id)
        except TransportError:
            pass  # the prefill side frees the blocks when the lease expires
        done(task.request_id, error)

    def _client(self, address: str) -> KVTransportClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = KVTransportClient(address, self.timeout_s)
            return client

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
