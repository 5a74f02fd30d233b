"""Operations: health, Prometheus metrics, sleep/wake-up, GPU info, terminate."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    METRICS_RESPONSES,
    ErrorResponse,
    HealthResponse,
)
from tandem.server.wire.trust import CHALLENGE_HEADER, MAX_NONCE_LEN, PROOF_HEADER, node_proof

from .generation import api_error
from .metrics import CONTENT_TYPE
from .state import ServerState, get_state
from .weights_routes import weights_info

router = APIRouter()


def format_uptime(seconds: float) -> str:
    """``2h 15m``-style, as ZSE's /health shows it."""
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    parts = [f"{d}d"] if d else []
    if d or h:
        parts.append(f"{h}h")
    parts.append(f"{m}m")
    if not d and not h:
        parts.append(f"{s}s")
    return " ".join(parts)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GB"


def gpu_list() -> list[dict[str, Any]]:
    """Every visible CUDA device (DeepInfer's ``/v1/gpu/info`` fields); empty without one."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return []
    if not torch.cuda.is_available():
        return []
    cuda_version = torch.version.cuda
    driver = _driver_version()
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        name = props.name
        gpus.append(
            {
                "id": i,
                "name": name,
                "total_memory_gb": round(total / 2**30, 2),
                "free_memory_gb": round(free / 2**30, 2),
                "used_memory_gb": round((total - free) / 2**30, 2),
                "compute_capability": f"{props.major}.{props.minor}",
                "driver_version": driver,
                "cuda_version": cuda_version,
                "is_nvidia_5090": "5090" in name,
                "is_nvidia_4090": "4090" in name,
            }
        )
    return gpus


def _driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:  # noqa: BLE001 - optional dependency, optional field
        return None


def health_body(state: ServerState, principal: str | None = "open") -> tuple[int, dict[str, Any]]:
    """``/health``'s status and body. The weights' filesystem path is for operators: shown
    to the admin and internal credentials, and by a server without keys (where every route
    is open anyway), never to an anonymous caller of a keyed server (``/health`` takes no key)."""
    snap = state.engine.stats
    if state.draining:
        status = "draining"
    elif state.engine.state != "ready":
        status = state.engine.state
    elif snap.is_sleeping:
        status = "sleeping"
    else:
        status = "ok"
    uptime = time.time() - state.started_at
    body: dict[str, Any] = {
        "status": status,
        "model": state.model_name,
        "role": state.settings.role,
        "uptime": format_uptime(uptime),
        "uptime_seconds": round(uptime, 3),
        "active_requests": snap.num_running,
        "pending_requests": snap.num_waiting + state.engine.num_queued_adds,
        "active_sessions": snap.num_sessions,
        "is_sleeping": snap.is_sleeping,
        "block_pool": {
            "total_blocks": snap.total_blocks,
            "free_blocks": snap.free_blocks,
            "utilization": round(snap.kv_utilization, 6),
        },
        "gpus": 0,
        "weights": _weights_for(weights_info(state), principal),
        "details": state.engine.info.get("details"),  # what the weights are (Ollama's tags)
        "lora_adapters": list(state.engine.served_loras),
    }
    if state.lora_config is not None:  # --lora-config: what the file brought, what failed
        body["lora_config"] = state.lora_config.health()
    gpus = gpu_list()
    if gpus:
        used = sum(int((g["total_memory_gb"] - g["free_memory_gb"]) * 2**30) for g in gpus)
        total = sum(int(g["total_memory_gb"] * 2**30) for g in gpus)
        body.update(gpus=len(gpus), gpu_memory_used=_gib(used), gpu_memory_total=_gib(total))
    if snap.spec_accepted_per_position:  # an engine that speculates
        drafted = snap.spec_num_draft_tokens
        body["spec_decode"] = {
            "num_drafts": snap.spec_num_drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": snap.spec_num_accepted_tokens,
            "acceptance_rate": round(snap.spec_num_accepted_tokens / drafted, 6)
            if drafted
            else 0.0,
            "accepted_per_position": list(snap.spec_accepted_per_position),
        }
    return (200 if status == "ok" else 503), body


def _weights_for(info: dict[str, Any] | None, principal: str | None) -> dict[str, Any] | None:
    if info is None or principal in ("open", "admin", "internal"):
        return info
    return {k: v for k, v in info.items() if k != "path"}


@router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(request: Request) -> JSONResponse:
    """200 with ``status: ok`` when the engine can serve; 503 with the same body while it loads,
    sleeps or drains, so a readiness probe and the proxy route around it. A proxy's challenge
    is answered with proof of the internal credential (``trust.node_proof``): the proxy sends
    the credential only to engines that hold it."""
    state = get_state(request)
    status, body = health_body(state, getattr(request.state, "principal", "open"))
    headers = {}
    nonce = request.headers.get(CHALLENGE_HEADER)
    secret = state.settings.internal_api_key
    if secret and nonce and len(nonce) <= MAX_NONCE_LEN:
        headers[PROOF_HEADER] = node_proof(secret, nonce)
    return JSONResponse(body, status_code=status, headers=headers)


@router.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": get_state(request).engine.stats.is_sleeping}


SleepTag = Literal["weights", "kv_cache"]  # vLLM's and LMDeploy's; both mean the whole engine


@router.post("/sleep", responses=ERROR_RESPONSES | {409: {"model": ErrorResponse}})
async def sleep(
    request: Request,
    level: int = Query(
        1,
        ge=1,
        le=2,
        description="1: free the KV cache "
        "(weights parked in host memory on a GPU); 2: also drop the weights (reloaded on wake-up)",
    ),
    tags: list[SleepTag] | None = Query(None, description="accepted for LMDeploy compatibility"),
) -> Any:
    """Release the engine's memory; requests get 503 until ``/wakeup``. 409 while requests run."""
    state = get_state(request)
    if state.engine.state != "ready":
        raise APIError(
            503, f"the engine is {state.engine.state}", code=f"engine_{state.engine.state}"
        )
    try:
        await state.engine.call(lambda e: e.sleep(level))
    except Exception as exc:  # noqa: BLE001 - mapped to 400/409
        raise api_error(exc) from exc
    return {"is_sleeping": True, "level": level}


@router.post("/wakeup", responses=ERROR_RESPONSES)
async def wakeup(request: Request, tags: list[SleepTag] | None = Query(None)) -> Any:
    """Restore the KV cache and weights released by ``/sleep``."""
    state = get_state(request)
    if state.engine.state != "ready":
        raise APIError(
            503, f"the engine is {state.engine.state}", code=f"engine_{state.engine.state}"
        )
    try:
        await state.engine.call(lambda e: e.wake_up())
    except Exception as exc:  # noqa: BLE001
        raise api_error(exc) from exc
    return {"is_sleeping": False}


@router.post("/pause")
async def pause(request: Request) -> dict[str, bool]:
    """Stop stepping the engine (vLLM's ``/pause``): requests stay in flight, holding their KV
    blocks, until ``/resume``; new requests queue. Aborts and disconnects still apply."""
    get_state(request).engine.pause()
    return {"is_paused": True}


@router.post("/resume")
async def resume(
    request: Request,
    steps: int | None = Query(
        None, ge=1, description="pause again after this many engine steps (tests, debugging)"
    ),
) -> dict[str, bool]:
    get_state(request).engine.resume(steps)
    return {"is_paused": False}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": get_state(request).engine.paused}


@router.get("/terminate")
async def terminate(request: Request) -> dict[str, str]:
    """Stop the server: stop admitting, let running requests finish within the grace period, exit."""
    state = get_state(request)
    if state.shutdown is None:
        raise APIError(
            501,
            "this server was not started by `tandem serve`; it cannot terminate itself",
            code="not_implemented",
        )
    state.draining = True
    asyncio.get_running_loop().call_later(0.1, state.shutdown)
    return {"status": "terminating"}


@router.get("/v1/gpu/info")
async def gpu_info() -> dict[str, Any]:
    return {"gpus": gpu_list()}
