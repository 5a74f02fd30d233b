"""Moving KV blocks between engines over TCP with pyzmq.

The prefill side runs a ``KVTransportServer`` (a ROUTER socket on its own thread); a decode
side pulls with a ``KVTransportClient`` (a DEALER socket). Messages: ``INFO`` (the KV
layout), ``PULL {lease_id, block_ids}``, ``RELEASE {lease_id}``. A pull is answered by a
header and then one message per layer, ``[2, n, block_size, kv_heads, head_dim]`` raw bytes
sent without a copy from a reused staging buffer (pinned when the cache is on a GPU): the
server gathers layer i+1 while layer i is on the wire, and the client scatters each layer
into its blocks as it arrives, so the gather, the transfer and the scatter overlap.

With a transport key (derived from the internal credential, ``wire/trust.py``) every request
carries a nonce and a MAC and every answer's first message a MAC bound to that nonce: the
server answers only peers holding the secret, and the client reads only from such a server.
A silent or dead peer costs a client ``timeout_s`` (a few seconds) per message, no more.
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable
from typing import Any

import torch
import zmq

from tandem.server.engine.kv_cache import KVCache
from tandem.server.engine.kv_transfer import KVLayout
from tandem.server.wire import trust

DEFAULT_TIMEOUT_S = 5.0


class TransportError(RuntimeError):
    """A pull or release that did not complete: the remote is gone, refused, or timed out."""


def layout_of(kv_cache: KVCache) -> KVLayout:
    return KVLayout(
        num_layers=int(kv_cache.data.shape[0]),
        num_kv_heads=kv_cache.num_kv_heads,
        head_dim=kv_cache.head_dim,
        block_size=kv_cache.block_size,
        dtype=str(kv_cache.dtype).removeprefix("torch."),
    )


class KVTransportServer:
    def __init__(
        self,
        kv_cache: KVCache,
        lookup_lease: Callable[[str], list[int] | None],
        on_release: Callable[[str], bool],
        host: str = "127.0.0.1",
        port: int = 0,
        layout: KVLayout | None = None,
        key: bytes | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.key = key
        self.lookup_lease = lookup_lease
        self.on_release = on_release
        self.layout = layout or layout_of(kv_cache)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tandem-kv-server", daemon=True)
        # One staging buffer, reused: filling fresh memory per pull costs more than the copy.
        self._staging: torch.Tensor | None = None
        self._in_flight: list[zmq.MessageTracker] = []

    def start(self) -> KVTransportServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self._sock.close()
        self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, kind, *rest = self._sock.recv_multipart()
            try:
                body = json.loads(rest[0]) if rest else {}
                if self.key is not None and not trust.request_authentic(self.key, kind, body):
                    reply = [b"ERR", b"unauthenticated: this transport serves trusted peers only"]
                elif kind == b"PULL" and (refusal := self._refusal(body)) is None:
                    self._send_blocks(ident, [int(b) for b in body["block_ids"]], body)
                    continue
                elif kind == b"PULL":
                    reply = [b"ERR", refusal.encode()]
                else:
                    reply = self._sealed(self._handle(kind, body), body)
            except Exception as exc:  # noqa: BLE001 - reported to the peer, the server goes on
                reply = [b"ERR", f"{type(exc).__name__}: {exc}".encode()]
            self._sock.send_multipart([ident, *reply])

    def _sealed(self, reply: list[bytes], body: dict[str, Any]) -> list[bytes]:
        """An OK answer with its MAC appended, when this transport is keyed."""
        if self.key is None or reply[0] != b"OK":
            return reply
        return [*reply, trust.reply_mac(self.key, str(body["nonce"]), reply[1])]

    def _handle(self, kind: bytes, body: dict[str, Any]) -> list[bytes]:
        if kind == b"INFO":
            return [b"OK", json.dumps(self.layout.to_dict()).encode()]
        if kind == b"RELEASE":
            return [b"OK" if self.on_release(body["lease_id"]) else b"ERR", b"{}"]
        return [b"ERR", f"unknown message {kind!r}".encode()]

    def _refusal(self, body: dict[str, Any]) -> str | None:
        held = self.lookup_lease(body["lease_id"])
        if held is None:
            return f"lease {body['lease_id']} is unknown, released or expired"
        if not {int(b) for b in body["block_ids"]} <= set(held):
            return "asked for blocks outside the lease"
        return None

    def _send_blocks(self, ident: bytes, block_ids: list[int], body: dict[str, Any]) -> None:
        data = self.kv_cache.data  # [L, 2, blocks, bs, H, D]
        per_layer = [2, len(block_ids), *data.shape[3:]]
        layer_numel = 2 * len(block_ids) * data[0, 0, 0].numel()
        for tracker in self._in_flight:  # zmq may still be reading the staging buffer
            tracker.wait()
        self._in_flight = []
        total = layer_numel * data.shape[0]
        if (
            self._staging is None
            or self._staging.numel() < total
            or self._staging.dtype != data.dtype
        ):
            self._staging = torch.empty(
                total, dtype=data.dtype, pin_memory=data.device.type == "cuda"
            )
        index = torch.tensor(block_ids, dtype=torch.int64, device=data.device)
        header = {
            "layers": data.shape[0],
            "shape": per_layer,
            "nbytes": total * data.element_size(),
        }
        self._sock.send_multipart(
            [ident, *self._sealed([b"OK", json.dumps(header).encode()], body)]
        )
        for layer in range(data.shape[0]):
            out = self._staging[layer * layer_numel : (layer + 1) * layer_numel].view(per_layer)
            if data.device.type == "cpu":
                torch.index_select(data[layer], 1, index, out=out)
            else:
                out.copy_(data[layer].index_select(1, index))
            payload = memoryview(out.view(-1).view(torch.uint8).numpy())
            self._in_flight.append(
                self._sock.send_multipart([ident, b"L", payload], copy=False, track=True)
            )


class KVTransportClient:
    """One connection to one prefill engine; safe to share between threads (calls serialise).

    ``context``: a shared ZMQ context (the puller's), so peers cost a socket each, not an I/O
    thread each; without one the client owns a private context.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        key: bytes | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.timeout_ms = int(timeout_s * 1000)
        self.key = key
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._lock = threading.Lock()

    def _recv(self, copy: bool = True) -> list[Any]:
        if not self._sock.poll(self.timeout_ms):
            self._reset()  # a late reply would desynchronise this socket
            raise TransportError(
                f"no answer from {self.address} within {self.timeout_ms / 1000:.0f}s"
            )
        return self._sock.recv_multipart(copy=copy)

    def _reset(self) -> None:
        self._sock.close()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)

    def _request(self, kind: bytes, body: dict[str, Any]) -> list[bytes]:
        """Send one request and take the first reply message; an ``ERR`` becomes a TransportError."""
        if self.key is not None:
            body = {**body, "nonce": trust.new_nonce()}
            body["mac"] = trust.request_mac(self.key, kind, body)
        self._sock.send_multipart([kind, json.dumps(body).encode()])
        frames = self._recv()
        if frames[0] != b"OK":
            detail = frames[1].decode(errors="replace") if len(frames) > 1 else ""
            raise TransportError(f"{self.address} refused {kind.decode()}: {detail}")
        if self.key is not None and (
            len(frames) < 3
            or not hmac.compare_digest(
                frames[2], trust.reply_mac(self.key, body["nonce"], frames[1])
            )
        ):
            self._reset()  # whatever follows comes from a peer we do not trust
            raise TransportError(f"{self.address} is not a trusted peer (unauthenticated answer)")
        return frames

    def layout(self) -> KVLayout:
        with self._lock:
            return KVLayout.from_dict(json.loads(self._request(b"INFO", {})[1]))

    def pull(
        self, lease_id: str, remote_block_ids: list[int], into: KVCache, local_block_ids: list[int]
    ) -> int:
        """Copy the remote blocks into ``local_block_ids`` of ``into``; returns the bytes moved."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        if not remote_block_ids:
            return 0
        data = into.data
        expected = [2, len(local_block_ids), *data.shape[3:]]
        index = torch.tensor(local_block_ids, dtype=torch.int64, device=data.device)
        with self._lock:
            header = json.loads(
                self._request(b"PULL", {"lease_id": lease_id, "block_ids": remote_block_ids})[1]
            )
            if header["layers"] != data.shape[0] or header["shape"] != expected:
                self._reset()  # the layer messages that follow are not ours to read
                raise TransportError(
                    f"mis-shaped block transfer: {header} for {data.shape[0]} layers of {expected}"
                )
            for layer in range(header["layers"]):
                kind, payload = self._recv(copy=False)
                blocks = (
                    torch.frombuffer(payload.buffer, dtype=torch.uint8)
                    .view(data.dtype)
                    .view(expected)
                )
                data[layer].index_copy_(1, index, blocks.to(data.device))
        return header["nbytes"]

    def release(self, lease_id: str) -> None:
        with self._lock:
            self._request(b"RELEASE", {"lease_id": lease_id})

    def close(self, wait: bool = True) -> None:
        """Close the socket, never under a call in flight on another thread: with ``wait``
        False a busy socket is left to the process's exit."""
        if not self._lock.acquire(timeout=-1 if wait else 0):
            return
        try:
            self._sock.close()
        finally:
            self._lock.release()
        if self._own_ctx:
            self._ctx.term()
