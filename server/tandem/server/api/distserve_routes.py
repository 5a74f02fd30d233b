"""LMDeploy's DistServe routes: the handshake and lease bookkeeping between P/D engines."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ERROR_RESPONSES, APIModel

from .state import get_state

P2P_CONNECT_TIMEOUT_S = 5.0
router = APIRouter(prefix="/distserve")


# tcp://host:port, port 1-65535: an address ZMQ refuses to connect to is the caller's 400.
_PORT = r"(6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})"
# A peer that cannot be reached answers 502 (refused, failed) or 504 (silent).
_PEER_RESPONSES = ERROR_RESPONSES | {s: ERROR_RESPONSES[503] for s in (502, 504)}


class EndpointInfo(APIModel):
    zmq_address: str = Field(pattern=rf"^tcp://[A-Za-z0-9.-]+:{_PORT}$", max_length=256)


class P2PConnectRequest(APIModel):
    remote_engine_id: str
    remote_engine_endpoint_info: EndpointInfo
    protocol: int | None = Field(
        default=None, description="LMDeploy's MigrationProtocol; TCP is used here"
    )
    remote_kvtransfer_endpoint_info: list[dict[str, Any]] | None = None
    remote_engine_url: str | None = None


class P2PInitializeRequest(APIModel):
    local_engine_id: str | None = None
    local_engine_config: dict[str, Any] | None = None
    protocol: int | None = None
    rank: int | None = None


class DropConnectRequest(APIModel):
    remote_engine_id: str | None = None
    remote_engine_endpoint_info: EndpointInfo | None = None


class FreeCacheRequest(APIModel):
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [{"required": ["remote_lease_id"]}, {"required": ["remote_session_id"]}]
        }
    )

    remote_engine_id: str | None = None
    remote_lease_id: str | None = None
    remote_session_id: int | str | None = Field(
        default=None, description="LMDeploy's name for the lease id"
    )


def _puller(request: Request) -> Any:
    puller = get_state(request).engine.puller
    if puller is None:
        raise APIError(
            409,
            "this engine has no KV transport (role both/prefill without --kv-transfer)",
            code="no_transport",
        )
    return puller


@router.get("/engine_info", responses=ERROR_RESPONSES)
async def engine_info(request: Request) -> dict[str, Any]:
    """What a peer checks before moving blocks: the KV layout and where to pull from."""
    state = get_state(request)
    state.check_admitting()
    info = await state.engine.call(
        lambda e: {
            "engine_id": e.engine_id,
            "kv_layout": e.kv_layout.to_dict(),
            "address": e.transport_address,
        }
    )
    return {
        "engine_id": info["engine_id"],
        "role": state.settings.role,
        "kv_layout": info["kv_layout"],
        "transport": {"kind": "tcp", "address": info["address"]},
    }


@router.post("/p2p_initialize", responses=ERROR_RESPONSES)
async def p2p_initialize(body: P2PInitializeRequest, request: Request) -> dict[str, Any]:
    """TCP needs no registration ahead of a connect; answers with this engine's identity."""
    state = get_state(request)
    state.check_admitting()
    engine_id = await state.engine.call(lambda e: e.engine_id)
    return {"success": True, "engine_id": engine_id}


@router.post("/p2p_connect", responses=_PEER_RESPONSES)
async def p2p_connect(body: P2PConnectRequest, request: Request) -> dict[str, Any]:
    """Open the transport to a prefill engine now and check the KV layouts: 400 on a layout
    mismatch, 502 when the peer fails, 504 when it does not answer within 5 s."""
    import asyncio

    puller = _puller(request)
    address = body.remote_engine_endpoint_info.zmq_address
    connecting = asyncio.get_running_loop().run_in_executor(None, puller.connect, address)
    try:
        problem = await asyncio.wait_for(connecting, P2P_CONNECT_TIMEOUT_S)
    except TimeoutError:
        puller.drop(address)
        raise APIError(
            504,
            f"the prefill engine at {address} did not answer within {P2P_CONNECT_TIMEOUT_S:g} s",
            code="transport_timeout",
            param="remote_engine_endpoint_info",
        ) from None
    if problem:
        layout = "layout" in problem
        raise APIError(
            400 if layout else 502,
            problem if address in problem else f"prefill engine at {address}: {problem}",
            code="kv_layout_mismatch" if layout else "transport_error",
            param="remote_engine_endpoint_info",
        )
    return {"success": True, "remote_engine_id": body.remote_engine_id}


@router.post("/p2p_drop_connect", responses=ERROR_RESPONSES)
async def p2p_drop_connect(body: DropConnectRequest, request: Request) -> dict[str, Any]:
    puller = _puller(request)
    if body.remote_engine_endpoint_info is not None:
        puller.drop(body.remote_engine_endpoint_info.zmq_address)
    return {"success": True}


@router.post("/free_cache", responses=ERROR_RESPONSES)
async def free_cache(body: FreeCacheRequest, request: Request) -> dict[str, Any]:
    """Release a lease this (prefill) engine holds; the blocks are freed within a second."""
    state = get_state(request)
    lease = body.remote_lease_id or (
        str(body.remote_session_id) if body.remote_session_id is not None else None
    )
    if not lease:
        raise APIError(
            400,
            "remote_lease_id is required",
            param="remote_lease_id",
            code="missing_required_field",
        )
    released = await state.engine.call(lambda e: e.release_lease(lease))
    return {"success": released}


@router.post("/gc", responses=ERROR_RESPONSES)
async def gc(request: Request) -> dict[str, Any]:
    """Sweep leases that were released or have expired (their decode engine never came)."""
    state = get_state(request)
    ended = await state.engine.call(lambda e: e.sweep_leases())
    return {"success": True, "freed_leases": ended}
