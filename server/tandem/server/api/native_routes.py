"""LMDeploy's native routes (``/generate``, ``/v1/encode``, ``/abort_request``) and Ollama's
``/api/generate``: raw prompts, no chat template, their own response shapes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.server.engine import SamplingParams
from tandem.server.wire import tenancy
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    SSE_RESPONSES,
    AbortRequest,
    EncodeRequest,
    EncodeResponse,
    GenerateRequest,
    GenerateResponse,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    streamed,
)
from tandem.server.wire.sse import DONE, SSE_HEADERS, ndjson_line, sse_event

from . import mapping
from .generation import (
    Job,
    new_id,
    off_loop,
    render_chat,
    submit,
    tokenize_text,
)
from .grammar_request import ollama_format_spec
from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)
_NDJSON_RESPONSES = ERROR_RESPONSES | streamed("application/x-ndjson", "one JSON object a line")


# ----- LMDeploy /generate -------------------------------------------------------------------
def _generate_body(rid: str, out: Any, num_tokens: int, want_logprobs: bool) -> dict[str, Any]:
    """One body: the whole output, or a stream's delta (``num_tokens`` counts the whole)."""
    c = out.outputs[0]
    return {
        "text": c.text,
        "output_ids": list(c.token_ids),
        "meta_info": {
            "id": rid,
            "finish_reason": mapping.generate_finish(c),
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": num_tokens,
            "cached_tokens": out.num_cached_tokens,
            "output_token_logprobs": [
                (max(lp.logprob, mapping.LOGPROB_FLOOR), lp.token_id) for lp in c.logprobs or []
            ]
            if want_logprobs
            else None,
        },
    }


@router.post("/generate", response_model=GenerateResponse, responses=SSE_RESPONSES)
async def generate(body: GenerateRequest, request: Request) -> Any:
    """A raw prompt (``prompt``) or token ids (``input_ids``); streamed as SSE deltas when ``stream``."""
    state = get_state(request)
    model = state.check_model(body.model)
    if body.image_data is not None:
        raise APIError(
            400, "image inputs are not supported", param="image_data", code="unsupported_value"
        )
    if (body.prompt is None) == (body.input_ids is None):
        raise APIError(
            400, "give exactly one of prompt and input_ids", param="prompt", code="invalid_value"
        )
    params = mapping.generate_sampling_params(body, vocab_size=state.vocab_size)
    prompt = (
        await off_loop(state, tokenize_text, state, body.prompt)
        if body.prompt is not None
        else list(body.input_ids or [])
    )
    rid = new_id("gen", request)
    job = await submit(
        state,
        rid,
        [prompt],
        params,
        stream=bool(body.stream),
        session_id=tenancy.session_key(body.session_id, tenancy.request_owner(request)),
        tenant=tenancy.request_tenant(request),
        lora=state.lora_of(model),
        client=request,
    )
    want = bool(body.return_logprob)
    if body.stream:
        return StreamingResponse(
            _generate_stream(job, rid, want), media_type="text/event-stream", headers=SSE_HEADERS
        )
    (out,) = await job.collect(request)
    return _generate_body(rid, out, len(out.outputs[0].token_ids), want)


async def _generate_stream(job: Job, rid: str, want_logprobs: bool) -> AsyncIterator[bytes]:
    try:
        async for latest in job.updates():
            body = _generate_body(rid, latest[rid], job.num_output_tokens[rid], want_logprobs)
            yield sse_event(body)
        yield DONE
    except APIError as err:
        yield sse_event(err.body())
    finally:
        if not job.finished:
            job.abort_unfinished()


@router.post("/v1/encode", response_model=EncodeResponse, responses=ERROR_RESPONSES)
async def encode(body: EncodeRequest, request: Request) -> dict[str, Any]:
    """Token ids of one or more texts (``do_preprocess`` applies the chat template first)."""
    state = get_state(request)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)

    def one(text: str) -> list[int]:
        if body.do_preprocess:
            return render_chat(state, [{"role": "user", "content": text}])
        return tokenize_text(state, text, "input", add_special_tokens=bool(body.add_bos))

    ids = [await off_loop(state, one, t) for t in texts]
    if isinstance(body.input, str):
        return {"input_ids": ids[0], "length": len(ids[0])}
    return {"input_ids": ids, "length": [len(i) for i in ids]}


@router.post("/abort_request", responses=ERROR_RESPONSES)
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    """Abort the requests of one session, or every request in flight with ``abort_all``."""
    state = get_state(request)
    session = tenancy.session_key(body.session_id, tenancy.request_owner(request))
    if not body.abort_all and session is None:
        raise APIError(
            400, "give a session_id or abort_all: true", param="session_id", code="invalid_value"
        )
    if state.engine.state != "ready":
        return {"aborted": 0}
    owner = tenancy.request_owner(request)
    n = await state.engine.abort_matching(
        None if body.abort_all else lambda key: tenancy.same_session(key, session, owner)
    )
    return {"aborted": n}


# ----- Ollama /api/generate -----------------------------------------------------------------
_OLLAMA_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def ollama_sampling_params(
    options: OllamaOptions | None, default_max_tokens: int | None = None
) -> SamplingParams:
    """Ollama's ``options`` onto ``SamplingParams`` (``num_predict`` -1 = up to the context)."""
    fields: dict[str, Any] = {"max_tokens": default_max_tokens}
    given = (
        options.model_dump(exclude_none=True, exclude=set(options.model_extra or ()))
        if options
        else {}
    )
    for key, value in given.items():
        if key == "num_predict" and value < 0:
            value = None
        if key == "top_k" and value == 0:
            value = -1
        if key == "stop" and isinstance(value, str):
            value = [value]
        fields[_OLLAMA_OPTIONS[key]] = value
    return mapping._build(fields)


def _created_at() -> str:
    """RFC 3339, as Ollama writes it."""
    return datetime.now(UTC).isoformat()


def _ollama_loaded(model: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Ollama's answer to an empty prompt or message list: the model is loaded, nothing runs."""
    return {
        "model": model,
        "created_at": _created_at(),
        **payload,
        "done": True,
        "done_reason": "load",
    }


def _response_text(text: str) -> dict[str, Any]:
    return {"response": text}


def _message_text(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


@router.post(
    "/api/generate",
    responses=_NDJSON_RESPONSES,
)
async def ollama_generate(body: OllamaGenerateRequest, request: Request) -> Any:
    """Ollama-style generation: an NDJSON stream of ``{model, created_at, response, done}``."""
    state = get_state(request)
    model = state.check_model(body.model)
    if body.images:
        raise APIError(
            400, "image inputs are not supported", param="images", code="unsupported_value"
        )
    params = _ollama_params(state, body.options, body.format)
    if not body.prompt:
        state.check_admitting()
        return _ollama_loaded(model, _response_text(""))
    if body.raw or getattr(state.tokenizer, "chat_template", None) is None:
        ids = await off_loop(state, tokenize_text, state, body.prompt)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}
        ]
        ids = await off_loop(state, render_chat, state, messages)
    prompt = list(body.context or []) + list(ids)
    return await _ollama_run(
        state, request, model, prompt, params, body.stream, "ollama", _response_text
    )


@router.post(
    "/api/chat",
    responses=_NDJSON_RESPONSES,
)
async def ollama_chat(body: OllamaChatRequest, request: Request) -> Any:
    """Ollama's chat: ``messages`` over the chat template; NDJSON ``{message, done}`` lines."""
    state = get_state(request)
    model = state.check_model(body.model)
    if any(m.images for m in body.messages):
        raise APIError(
            400, "image inputs are not supported", param="messages", code="unsupported_value"
        )
    params = _ollama_params(state, body.options, body.format)
    if not body.messages:
        state.check_admitting()
        return _ollama_loaded(model, _message_text(""))
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    prompt = await off_loop(state, render_chat, state, messages)
    return await _ollama_run(
        state, request, model, list(prompt), params, body.stream, "ollamachat", _message_text
    )


def _ollama_params(
    state: Any, options: OllamaOptions | None, fmt: str | dict[str, Any] | None
) -> SamplingParams:
    params = ollama_sampling_params(options, state.settings.default_max_tokens)
    if (spec := ollama_format_spec(fmt)) is not None:
        params = params.clone(structured=spec)
    return params


async def _ollama_run(
    state: Any,
    request: Request,
    model: str,
    prompt: list[int],
    params: SamplingParams,
    stream: bool,
    prefix: str,
    wrap: Callable[[str], dict[str, Any]],
) -> Any:
    rid = new_id(prefix, request)
    started = time.monotonic_ns()
    job = await submit(
        state,
        rid,
        [prompt],
        params,
        stream=stream,
        tenant=tenancy.request_tenant(request),
        lora=state.lora_of(model),
        client=request,
    )
    if stream:
        return StreamingResponse(
            _ollama_stream(job, rid, model, started, wrap), media_type="application/x-ndjson"
        )
    (out,) = await job.collect(request)
    return {
        "model": model,
        "created_at": _created_at(),
        **wrap(out.outputs[0].text),
        "done": True,
        **_ollama_final(out, list(out.outputs[0].token_ids), started),
    }


def _ollama_final(out: Any, token_ids: list[int], started_ns: int) -> dict[str, Any]:
    """The closing fields; ``token_ids`` are the whole output (a stream's last delta is not)."""
    return {
        "done_reason": out.outputs[0].finish_reason,
        "context": list(out.prompt_token_ids) + token_ids,
        "total_duration": time.monotonic_ns() - started_ns,
        "prompt_eval_count": len(out.prompt_token_ids),
        "eval_count": len(token_ids),
    }


async def _ollama_stream(
    job: Job, rid: str, model: str, started_ns: int, wrap: Callable[[str], dict[str, Any]]
) -> AsyncIterator[bytes]:
    token_ids: list[int] = []
    try:
        async for latest in job.updates():
            c = latest[rid].outputs[0]
            token_ids += c.token_ids
            if c.text:
                yield ndjson_line(
                    {"model": model, "created_at": _created_at(), **wrap(c.text), "done": False}
                )
        yield ndjson_line(
            {
                "model": model,
                "created_at": _created_at(),
                **wrap(""),
                "done": True,
                **_ollama_final(job.last[rid], token_ids, started_ns),
            }
        )
    except APIError as err:
        yield ndjson_line(
            {"model": model, "created_at": _created_at(), "error": err.message, "done": True}
        )
    finally:
        if not job.finished:
            job.abort_unfinished()
