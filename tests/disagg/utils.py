"""Helpers for the P/D tests: a prefill and a decode engine joined by the real KV transport,
driven by hand (what the server's engine loop does, inline)."""

from __future__ import annotations

import time

from tandem.server.disagg.transport import KVTransportClient, TransportError
from tandem.server.engine import LLMEngine, SamplingParams


def drain_one(engine: LLMEngine, rid: str, stream: bool = False):
    """The request's whole output (a stream's deltas merged)."""
    out = None
    deadline = time.monotonic() + 60
    while out is None or not out.finished:
        assert time.monotonic() < deadline
        for o in engine.step():
            if o.request_id == rid:
                out = out.merge(o) if stream and out is not None else o
    return out


def run_pulls(engine: LLMEngine, client: KVTransportClient) -> None:
    """What the server's engine loop does with pull tasks, inline."""
    for task in engine.take_pull_tasks():
        try:
            client.pull(task.lease_id, task.remote_block_ids, engine.kv_cache, task.local_block_ids)
            client.release(task.lease_id)
            engine.complete_pull(task.request_id)
        except TransportError as exc:
            engine.complete_pull(task.request_id, str(exc))


def prefill_handoff(
    prefill: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> dict:
    prefill.add_request(rid, prompt, params, kv_transfer={"do_remote_decode": True})
    out = drain_one(prefill, rid)
    assert len(out.token_ids) == 1 and out.kv_transfer_params is not None
    return out.kv_transfer_params
