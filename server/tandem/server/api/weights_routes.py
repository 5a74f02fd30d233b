"""``POST /update_weights``: load new weights into the running engine without a restart.

The policy for requests in flight (``docs/routes.md``): with ``drain: true`` (the default)
requests already admitted finish on the old weights while new ones wait, then run on the
new weights; with ``drain: false`` (SGLang's ``abort_all_requests: true``) the requests in
flight are aborted at once, each answering what it produced so far. Either way the swap
happens between two engine steps with nothing in flight, and every KV block computed with
the old weights (prefix cache, sessions, P/D leases) is dropped. Weights that do not fit the
running model are refused before anything is drained or aborted.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from tandem.server.engine.models.config import ModelLoadError, WeightsMismatchError
from tandem.server.engine.weights import check_compatible, check_format
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    ErrorResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)

from .engine_loop import EngineNotReadyError, UpdateInProgressError
from .generation import api_error
from .state import ServerState, get_state

router = APIRouter(route_class=ParsedJSONRoute)
log = logging.getLogger("tandem.api")


def weights_info(state: ServerState) -> dict[str, Any] | None:
    """The running weights' identity for ``/health`` and ``/v1/models``."""
    info = state.engine.info.get("weights")
    return None if info is None else {**info, "updating": state.engine.updating}


def _exists(path: str) -> bool:
    """``Path.exists``, but a name the OS refuses (too long, say) is as absent as a missing one."""
    try:
        return Path(path).exists()
    except OSError:
        return False


def _refusal(exc: BaseException, path: str) -> APIError:
    if isinstance(exc, WeightsMismatchError | UpdateInProgressError):
        code = "weights_mismatch" if isinstance(exc, WeightsMismatchError) else "update_in_progress"
        return APIError(409, str(exc), param="model_path", code=code)
    if isinstance(exc, ModelLoadError | OSError | ValueError):
        return APIError(
            400,
            f"cannot load weights from {path}: {exc}",
            param="model_path",
            code="invalid_weights",
        )
    return api_error(exc)


@router.post(
    "/update_weights",
    response_model=UpdateWeightsResponse,
    responses=ERROR_RESPONSES | {404: {"model": ErrorResponse}, 409: {"model": ErrorResponse}},
)
async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict[str, Any]:
    """Replace the weights with those at ``model_path`` (a model directory with safetensors,
    or a GGUF file, on the server) of the same shapes: 404 if it does not exist, 400 if it
    is no model, 409 if it does not fit the running one. The tokenizer stays."""
    state = get_state(request)
    if body.serialized_named_tensors is not None:
        raise APIError(
            400,
            "serialized_named_tensors is not supported; give model_path (a directory or "
            ".gguf file on the server)",
            param="serialized_named_tensors",
            code="unsupported_value",
        )
    if body.model is not None:
        state.check_model(body.model)
    path = body.model_path
    if path is None:
        raise APIError(400, "model_path is required", param="model_path", code="invalid_value")
    if not await asyncio.to_thread(_exists, path):
        raise APIError(404, f"{path} does not exist", param="model_path", code="weights_not_found")
    try:
        running = await state.engine.call(lambda e: e.model_config)
        await asyncio.to_thread(check_format, path, body.load_format)
        await asyncio.to_thread(check_compatible, running, path)
        identity = await state.engine.update_weights(
            lambda e: e.update_weights(path, body.weight_version),
            drain=body.drain and not body.abort_all_requests,
        )
    except (EngineNotReadyError, APIError) as exc:
        raise api_error(exc) from exc
    except Exception as exc:  # noqa: BLE001 - mapped to 400/409 (or the engine's status)
        raise _refusal(exc, path) from exc
    log.info("weights updated to %s (version %d)", path, identity.version)
    return {"success": True, "message": f"loaded {path}", "weights": identity.as_dict()}
