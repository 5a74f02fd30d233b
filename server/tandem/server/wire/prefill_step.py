"""The prefill step's request, as both drivers of prefill -> decode send it: the proxy, and a
decode engine the gateway's picker named a prefill engine to (``docs/gateway.md``)."""

from __future__ import annotations

import copy
from typing import Any


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill step's body: the client's request, one token, not streamed, KV kept for a decode."""
    out = copy.deepcopy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("max_completion_tokens", None)
    out["max_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out
