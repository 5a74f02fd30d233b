"""OpenAI's ``/v1/embeddings``, LMDeploy's ``/pooling`` and Ollama's ``/api/embed`` and
``/api/embeddings``: vectors from the served model.

Each input becomes one pooled engine request (prefill-only, batched with generation by the
same scheduler; ``engine/pooling.py``), so embeddings come from the same weights and the
same KV pool as chat, and leave no block behind.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from fastapi import APIRouter, Request

from tandem.server.engine import PoolingParams, RequestOutput, SamplingParams
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    EmbeddingRequest,
    EmbeddingResponse,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    PoolingRequest,
    PoolingResponse,
)
from tandem.server.wire.tenancy import request_tenant

from .generation import new_id, off_loop, submit, tokenize_text
from .state import ServerState, get_state

router = APIRouter(route_class=ParsedJSONRoute)

# Inputs in the engine at once per request: OpenAI allows 2,048 inputs, more than the
# engine's waiting queue admits (--max-waiting-requests, 429 beyond), so they go in waves.
WAVE = 64


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """One ``embedding`` per input, in input order, with the inputs' token count as usage."""
    return await _pool(body, request, "embedding", "embedding", "embd")


@router.post("/pooling", response_model=PoolingResponse, responses=ERROR_RESPONSES)
async def pooling(body: PoolingRequest, request: Request) -> dict[str, Any]:
    """The same vectors as ``/v1/embeddings``, as ``{index, object: "pooling", data}`` items."""
    return await _pool(body, request, "pooling", "data", "pool")


@router.post("/api/embed", responses=ERROR_RESPONSES)
async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> dict[str, Any]:
    """Ollama's: ``{model, embeddings, prompt_eval_count}``, the vectors L2-normalised."""
    state = get_state(request)
    model = state.check_model(body.model)
    started = time.monotonic_ns()
    params = PoolingParams(normalize=True)
    outs = await _vectors(state, request, body.input, params, new_id("embd", request), model)
    return {
        "model": model,
        "embeddings": [out.embedding for out in outs],
        "total_duration": time.monotonic_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": _num_tokens(outs),
    }


@router.post("/api/embeddings", responses=ERROR_RESPONSES)
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request) -> dict[str, Any]:
    """Ollama's older route: ``{embedding}`` for one prompt, not normalised (as Ollama's)."""
    state = get_state(request)
    model = state.check_model(body.model)
    params = PoolingParams(normalize=False)
    request_id = new_id("embd", request)
    (out,) = await _vectors(state, request, body.prompt, params, request_id, model)
    return {"embedding": out.embedding}


async def _pool(
    body: EmbeddingRequest, request: Request, obj: str, field: str, prefix: str
) -> dict[str, Any]:
    state = get_state(request)
    model = state.check_model(body.model)
    params = PoolingParams(normalize=body.normalize is not False, dimensions=body.dimensions)
    request_id = new_id(prefix, request)
    outs = await _vectors(state, request, body.input, params, request_id, model)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": obj, field: _encode(out, body.encoding_format)}
            for i, out in enumerate(outs)
        ],
        "usage": {"prompt_tokens": (n := _num_tokens(outs)), "total_tokens": n},
    }


async def _vectors(
    state: ServerState,
    request: Request,
    given: Any,
    params: PoolingParams,
    request_id: str,
    model: str,
) -> list[RequestOutput]:
    """One pooled engine request per input, in waves (through ``model``'s LoRA adapter, if it
    names one); each output carries its vector."""
    prompts = await _prompts(state, given)
    outs: list[RequestOutput] = []
    for start in range(0, len(prompts), WAVE):
        wave_id = request_id if len(prompts) <= WAVE else f"{request_id}-{start}"
        wave = prompts[start : start + WAVE]
        job = await submit(
            state,
            wave_id,
            wave,
            SamplingParams(),
            stream=False,
            pooling=params,
            tenant=request_tenant(request),
            lora=state.lora_of(model),
        )
        outs += await job.collect(request)
        if any(out.embedding is None for out in outs):  # aborted (/abort_request, weights)
            raise APIError(
                503,
                "the request was aborted before its input was computed; retry",
                code="request_aborted",
                type="server_error",
            )
    return outs


async def _prompts(state: ServerState, given: Any) -> list[list[int]]:
    """Token ids per input: a text is tokenized as a prompt (on the tokenizer thread); an
    empty input, text or list is a 400 rather than a vector of nothing."""
    items = [given] if isinstance(given, str) or _is_ids(given) else list(given)
    if not items or any(len(item) == 0 for item in items):
        raise APIError(400, "input must not be empty", param="input", code="invalid_value")
    texts = [i for i, item in enumerate(items) if isinstance(item, str)]
    if texts:
        encoded = await off_loop(
            state, lambda: [tokenize_text(state, items[i], "input") for i in texts]
        )
        for i, ids in zip(texts, encoded):
            items[i] = ids
    return items


def _is_ids(given: Any) -> bool:
    return bool(given) and all(isinstance(t, int) for t in given)


def _encode(out: RequestOutput, encoding_format: str) -> list[float] | str:
    vec = out.embedding
    if encoding_format == "base64":  # what the openai client decodes with numpy's float32
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


def _num_tokens(outs: list[RequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outs)
