"""vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (admin routes):
serve a PEFT adapter under a name, or stop serving it, without a restart.

Both go through ``lora_admin`` (as the ``--lora-config`` watcher does): a malformed
adapter, a rank over ``max_lora_rank`` or shapes that do not fit the base are a 400 naming
what, and nothing changes; from then on ``model`` = its name selects it on
every generating route and ``/v1/models`` lists it with ``parent`` = the base. Unloading lets
the requests already running through it finish. The answers are vLLM's plain-text ones.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from tandem.server.engine.lora.adapter import LoraLoadError
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)

from .generation import api_error
from .lora_admin import LoraNameTaken, load_lora, unload_lora
from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)
# vLLM answers a load or unload with plain text; errors are the API's JSON
_TEXT = {
    200: {
        "description": "Success",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES | _TEXT)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    name = body.lora_name
    try:
        await load_lora(state, name, body.lora_path)
    except LoraNameTaken as exc:
        raise APIError(400, str(exc), param="lora_name", code="invalid_value") from exc
    except LoraLoadError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from exc
    except Exception as exc:  # noqa: BLE001 - the engine's state (503) or a bug (500)
        raise api_error(exc) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES | _TEXT)
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, request: Request
) -> PlainTextResponse:
    state = get_state(request)
    name = body.lora_name
    try:
        removed = await unload_lora(state, name)
    except Exception as exc:  # noqa: BLE001
        raise api_error(exc) from exc
    if not removed:
        raise APIError(
            404,
            f"The lora adapter '{name}' cannot be found.",
            param="lora_name",
            code="model_not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
