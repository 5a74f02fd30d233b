"""The P/D handoff at an engine's edge: who may send ``kv_transfer_params``, and signing the
handle a prefill engine hands out (``wire/trust.py``, ``docs/security.md``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tandem.server.wire.errors import APIError
from tandem.server.wire.trust import derive_key, handle_problem, sign_handle

from .state import ServerState


def check_kv_transfer(
    state: ServerState,
    request: Request,
    params: dict[str, Any] | None,
    prompts: list[list[int]],
    driven: bool = False,
) -> None:
    """403 unless the caller holds the internal credential (or the server is open, or this
    engine fetched the handle itself from the prefill engine the picker named: ``driven``)
    and, for a decode, the handle is one a trusted prefill engine signed for this prompt."""
    if params is None or state.settings.credentials.open:
        return
    if not driven and getattr(request.state, "principal", None) != "internal":
        raise APIError(
            403,
            "kv_transfer_params belongs to the internal P/D plane: only the proxy may send it",
            code="kv_transfer_forbidden",
            param="kv_transfer_params",
        )
    if not params.get("do_remote_prefill"):
        return
    if len(prompts) != 1:
        raise APIError(
            400,
            "a disaggregated request takes a single prompt",
            code="invalid_value",
            param="kv_transfer_params",
        )
    problem = handle_problem(_handle_key(state), params, prompts[0])
    if problem is not None:
        raise APIError(403, problem, code="untrusted_kv_handle", param="kv_transfer_params")


def signed(state: ServerState, kv: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """A prefill engine's handle, signed when the engine has the internal credential."""
    if state.settings.internal_api_key is None:
        return kv
    return sign_handle(_handle_key(state), kv, prompt_ids)


def _handle_key(state: ServerState) -> bytes:
    assert state.settings.internal_api_key is not None
    return derive_key(state.settings.internal_api_key, "kv-handle")
