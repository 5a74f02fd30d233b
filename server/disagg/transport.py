"""Moving KV blocks between engines over TCP with pyzmq.

The prefill side runs a ``KVTransportServer`` (a ROUTER socket on its own thread); a decode
side pulls with a ``KVTransportClient`` (a DEALER socket). A pull answers with one frame of
raw bytes, ``[layers, 2, n, block_size, kv_heads, head_dim]`` of the leased blocks, sent
without a copy from the (pinned, when the cache is on a GPU) staging tensor. Messages:
``INFO`` (the KV layout), ``PULL {lease_id, block_ids}``, ``RELEASE {lease_id}``.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch
import zmq

from tandem.server.engine.kv_cache import KVCache

from .kv_transfer import KVLayout

DEFAULT_TIMEOUT_S = 30.0


class TransportError(RuntimeError):
    """A pull or release that did not complete: the remote is gone, refused, or timed out."""


def layout_of(kv_cache: KVCache) -> KVLayout:
    return KVLayout(num_layers=int(kv_cache.data.shape[0]), num_kv_heads=kv_cache.num_kv_heads,
                    head_dim=kv_cache.head_dim, block_size=kv_cache.block_size,
                    dtype=str(kv_cache.dtype).removeprefix("torch."))


class KVTransportServer:
    def __init__(self, kv_cache: KVCache, lookup_lease: Callable[[str], list[int] | None],
                 on_release: Callable[[str], bool], host: str = "127.0.0.1", port: int = 0,
                 layout: KVLayout | None = None) -> None:
        self.kv_cache = kv_cache
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
        self.bytes_sent = 0
        # One staging buffer, reused: filling fresh memory per pull costs more than the copy.
        self._staging: torch.Tensor | None = None
        self._in_flight: zmq.MessageTracker | None = None

    def start(self) -> "KVTransportServer":
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
                reply = self._handle(kind, json.loads(rest[0]) if rest else {})
            except Exception as exc:  # noqa: BLE001 - reported to the peer, the server goes on
                reply = [b"ERR", f"{type(exc).__name__}: {exc}".encode()]
            tracker = self._sock.send_multipart([ident, *reply], copy=False, track=True)
            if kind == b"PULL":
                self._in_flight = tracker  # zmq reads the staging buffer until this is done

    def _handle(self, kind: bytes, body: dict[str, Any]) -> list[Any]:
        if kind == b"INFO":
            return [b"OK", json.dumps(self.layout.to_dict()).encode()]
        if kind == b"RELEASE":
            return [b"OK" if self.on_release(body["lease_id"]) else b"ERR", b"{}"]
        if kind == b"PULL":
            held = self.lookup_lease(body["lease_id"])
            if held is None:
                return [b"ERR", f"lease {body['lease_id']} is unknown, released or expired".encode()]
            wanted = [int(b) for b in body["block_ids"]]
            if not set(wanted) <= set(held):
                return [b"ERR", b"asked for blocks outside the lease"]
            shape, data = self._stage(wanted)
            self.bytes_sent += data.numel()
            header = {"shape": shape, "nbytes": data.numel()}
            return [b"OK", json.dumps(header).encode(), memoryview(data.numpy())]
        return [b"ERR", f"unknown message {kind!r}".encode()]

    def _stage(self, block_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """The blocks ``[layers, 2, n, block_size, kv_heads, head_dim]`` gathered into the
        reused host staging buffer (pinned when the cache is on a GPU), as bytes."""
        data = self.kv_cache.data
        shape = [data.shape[0], 2, len(block_ids), *data.shape[3:]]
        numel = shape[0] * 2 * len(block_ids) * data[0, 0, 0].numel()
        if self._in_flight is not None:
            self._in_flight.wait()
        if self._staging is None or self._staging.numel() < numel or self._staging.dtype != data.dtype:
            self._staging = torch.empty(numel, dtype=data.dtype, pin_memory=data.device.type == "cuda")
        out = self._staging[:numel].view(shape)
        index = torch.tensor(block_ids, dtype=torch.int64, device=data.device)
        if data.device.type == "cpu":
            torch.index_select(data, 2, index, out=out)
        else:
            out.copy_(data.index_select(2, index))
        return shape, out.view(-1).view(torch.uint8)


class KVTransportClient:
    """One connection to one prefill engine; safe to share between threads (calls serialise)."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._lock = threading.RLock()
        self._buffer: torch.Tensor | None = None  # reused receive buffer for block data

    def _call(self, kind: bytes, body: dict[str, Any], into: torch.Tensor | None = None) -> list[bytes]:
        """Send one request; returns the reply's frames. With ``into``, a third (data) frame is
        received straight into that buffer, and the frame list holds its size instead."""
        with self._lock:
            self._sock.send_multipart([kind, json.dumps(body).encode()])
            if not self._sock.poll(self.timeout_ms):
                self._reset()  # a late reply would desynchronise this socket
                raise TransportError(f"no answer from {self.address} within {self.timeout_ms / 1000:.0f}s")
            frames = [self._sock.recv()]
            while self._sock.getsockopt(zmq.RCVMORE):
                if into is not None and len(frames) == 2:
                    size = self._sock.recv_into(into.numpy())
                    frames.append(str(size).encode())
                else:
                    frames.append(self._sock.recv())
        if frames[0] != b"OK":
            detail = frames[1].decode(errors="replace") if len(frames) > 1 else ""
            raise TransportError(f"{self.address} refused {kind.decode()}: {detail}")
        return frames

    def _reset(self) -> None:
        self._sock.close()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def layout(self) -> KVLayout:
        return KVLayout.from_dict(json.loads(self._call(b"INFO", {})[1]))

    def pull(self, lease_id: str, remote_block_ids: list[int], into: KVCache, local_block_ids: list[int]) -> int:
        """Copy the remote blocks into ``local_block_ids`` of ``into``; returns the bytes moved."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        if not remote_block_ids:
            return 0
        data = into.data
        nbytes = data.shape[0] * 2 * len(local_block_ids) * data[0, 0, 0].numel() * data.element_size()
        with self._lock:
            buf = self._receive_buffer(nbytes)
            frames = self._call(b"PULL", {"lease_id": lease_id, "block_ids": remote_block_ids}, into=buf)
            header = json.loads(frames[1])
            shape = header["shape"]
            if int(frames[2]) != nbytes or header["nbytes"] != nbytes or shape[2] != len(local_block_ids):
                raise TransportError("truncated or mis-shaped block transfer")
            blocks = buf.view(into.dtype).view(shape)
            index = torch.tensor(local_block_ids, dtype=torch.int64, device=into.device)
            data.index_copy_(2, index, blocks.to(into.device))
        return nbytes

    def release(self, lease_id: str) -> None:
        self._call(b"RELEASE", {"lease_id": lease_id})

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
