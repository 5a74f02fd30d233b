"""OpenAI's routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, plus sessions."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.server.engine.sampling_params import SamplingParams
from tandem.server.engine.structured import GrammarSpec
from tandem.server.wire import tenancy
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    SSE_RESPONSES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from tandem.server.wire.sse import (
    DONE,
    SSE_HEADERS,
    DisconnectAwareStreamingResponse,
    error_event,
    sse_event,
)

from . import grammar_request, mapping
from .chat_choice import ChoiceStream, chat_message
from .driven_prefill import named_prefiller, prefill_remotely
from .generation import Job, new_id, off_loop, submit, tokenize_text
from .handoff import check_kv_transfer, signed
from .reasoning import THINK_END
from .state import ServerState, get_state
from .tool_parsers import Parser, parser_for_template, tool_plan
from .weights_routes import weights_info

log = logging.getLogger("tandem.api")

router = APIRouter(route_class=ParsedJSONRoute)


def _note_ignored(route: str, body: Any) -> None:
    if extra := body.ignored_fields():
        log.debug("%s: ignoring unknown field(s) %s", route, ", ".join(extra))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "tandem",
        "root": state.engine.info.get("weights", {}).get("path", state.settings.model_dir),
        "max_model_len": state.engine.info.get("max_model_len"),
        "weights": weights_info(state),
    }


def _adapter_card(state: ServerState, name: str, path: str) -> dict[str, Any]:
    """A LoRA adapter, as vLLM lists one: its path as ``root``, the base as ``parent``."""
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "tandem",
        "root": path,
        "parent": state.model_name,
        "max_model_len": state.engine.info.get("max_model_len"),
    }


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    adapters = [_adapter_card(state, n, p) for n, p in state.engine.served_loras.items()]
    return {"object": "list", "data": [_model_card(state), *adapters]}


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model (the ``openai`` client's ``models.retrieve``); 404 for a name not served."""
    state = get_state(request)
    if (path := state.engine.served_loras.get(model_id)) is not None:
        return _adapter_card(state, model_id, path)
    if model_id != state.model_name:
        raise APIError(
            404, f"The model '{model_id}' does not exist", code="model_not_found", param="model"
        )
    return _model_card(state)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=SSE_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """Chat over the model's template; ``stream: true`` answers with ``chat.completion.chunk`` events."""
    state, model = _open(request, body, "/v1/chat/completions")
    mapping.check_chat_request(body)
    top = mapping.chat_logprobs_count(body)
    params = mapping.sampling_params(
        body,
        vocab_size=state.vocab_size,
        default_max_tokens=state.settings.default_max_tokens,
        logprobs=top,
    )
    tools, reasoning, spec = _chat_plan(state, body)
    if spec is not None:
        params = params.clone(structured=spec)
    session = tenancy.session_key(body.session_id, tenancy.request_owner(request))
    raw_prompt = (
        isinstance(body.messages, str) and body.do_preprocess is False
    )  # no template, no history
    conversation = None
    if session is not None and not raw_prompt:
        conversation = state.histories.resolve(session, mapping.chat_messages(body.messages))
    text = await off_loop(state, mapping.render_chat, state.tokenizer, body, conversation)
    prompt_ids = await off_loop(
        state, tokenize_text, state, text, "messages", add_special_tokens=False
    )
    request_id = new_id("chatcmpl", request)
    job, created = await _submit(
        state, request, body, model, request_id, [prompt_ids], params, session
    )
    if conversation is not None:
        job.on_finish = lambda text: state.histories.record(session, conversation, text)
    if body.stream:
        return _event_stream(
            _chat_stream(
                state,
                job,
                params.n,
                request_id,
                created,
                model,
                top,
                _include_usage(body),
                bool(body.return_token_ids),
                (lambda: ChoiceStream(tools, reasoning)) if tools or reasoning else None,
            )
        )
    outputs = await job.collect(request)
    response = mapping.chat_response(
        request_id=request_id,
        created=created,
        model=model,
        outputs=outputs,
        tokenizer=state.tokenizer,
        top_logprobs=top,
        return_token_ids=bool(body.return_token_ids),
        prompt_logprobs=body.prompt_logprobs,
    )
    if tools or reasoning:
        for choice, c in zip(response["choices"], outputs[0].outputs):
            choice["message"], choice["finish_reason"] = chat_message(
                c.text, c.finish_reason, tools, reasoning
            )
    return _with_handoff(state, response, outputs)


def _open(
    request: Request, body: ChatCompletionRequest | CompletionRequest, route: str
) -> tuple[ServerState, str]:
    """The server state and the served model's name, once the request names it."""
    state = get_state(request)
    _note_ignored(route, body)
    return state, state.check_model(body.model)


async def _submit(
    state: ServerState,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    model: str,
    request_id: str,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    session: str | None,
) -> tuple[Job, int]:
    """Hand the prompts to the engine (a P/D handle checked first, or fetched from the prefill
    engine the gateway's picker named); the job and its ``created`` time."""
    kv = body.kv_transfer_params
    prefiller = named_prefiller(state, request)
    if prefiller is not None:  # the gateway's picker named the prefill engine: drive it
        kv = await prefill_remotely(state, request, prefiller)
    check_kv_transfer(state, request, kv, prompt_ids, driven=prefiller is not None)
    job = await submit(
        state,
        request_id,
        prompt_ids,
        params,
        stream=bool(body.stream),
        session_id=session,
        kv_transfer=kv,
        tenant=tenancy.request_tenant(request),
        cache_salt=body.cache_salt,
        lora=state.lora_of(model),
        client=request,
    )
    return job, int(time.time())


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A stream that notices its client leaving at once, not at its next write: a request
    held in flight (a paused engine, a long prefill) is aborted and its blocks freed then."""
    return DisconnectAwareStreamingResponse(
        events, media_type="text/event-stream", headers=SSE_HEADERS
    )


def _chat_plan(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[Parser | None, bool, GrammarSpec | None]:
    """The tool-call parser, whether thinking is split off, and the grammar of a chat request
    (its structured-output fields, or ``tool_choice`` required / named)."""
    fmt = state.settings.tool_call_parser or parser_for_template(
        getattr(state.tokenizer, "chat_template", None)
    )
    tool_spec, tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, fmt)
    spec = grammar_request.request_spec(body)
    if spec is not None and tool_spec is not None:
        raise APIError(
            400,
            "a structured-output field and tool_choice required/named cannot be combined",
            param="tool_choice",
        )
    spec = spec or tool_spec
    kwargs = body.chat_template_kwargs or {}
    reasoning = (
        state.settings.reasoning_parser is not None
        and kwargs.get("enable_thinking", body.enable_thinking) is not False
    )
    if spec is not None and reasoning:  # the grammar holds for the answer, after the thinking
        end = state.tokenizer.encode(THINK_END, add_special_tokens=False)
        spec = dataclasses.replace(spec, after_token_ids=tuple(end))
    return tools, reasoning, spec


async def _chat_stream(
    state: ServerState,
    job: Job,
    n: int,
    request_id: str,
    created: int,
    model: str,
    top: int | None,
    include_usage: bool,
    return_token_ids: bool,
    new_choice: Callable[[], ChoiceStream] | None = None,
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], usage_info: dict[str, Any] | None = None) -> bytes:
        return sse_event(
            mapping.stream_chunk(
                mapping.CHAT_CHUNK,
                request_id=request_id,
                created=created,
                model=model,
                choices=choices,
                usage_info=usage_info,
                include_usage_field=include_usage,
            )
        )

    rid = job.request_ids[0]
    started = False
    parsers: dict[int, ChoiceStream] = {}
    texts: dict[int, str] = {}  # the parsers read each choice's whole text so far
    try:
        async for latest in job.updates():
            out = latest[rid]
            if not started:
                started = True
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(n)
                    ]
                )
            choices = []
            for c in out.outputs:
                delta: dict[str, Any] = {"content": c.text} if c.text else {}
                reason = c.finish_reason
                if new_choice is not None:
                    parser = parsers.setdefault(c.index, new_choice())
                    texts[c.index] = texts.get(c.index, "") + c.text
                    delta = parser.delta(texts[c.index], final=reason is not None)
                    reason = parser.finish_reason(reason)
                choice: dict[str, Any] = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": mapping.chat_logprobs(state.tokenizer, c.logprobs or [], top)
                    if top is not None
                    else None,
                    "finish_reason": reason,
                }
                if isinstance(c.stop_reason, str):
                    choice["stop_reason"] = c.stop_reason
                if return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            if choices:
                yield chunk(choices)
        if include_usage:
            out = job.last[rid]
            yield chunk(
                [],
                mapping.usage(
                    len(out.prompt_token_ids), job.num_output_tokens[rid], out.num_cached_tokens
                ),
            )
        yield DONE
    except APIError as err:  # the engine failed mid-stream: say so in-band, then end the stream
        yield error_event(err.body())
    finally:
        if not job.finished:
            job.abort_unfinished()


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    """Raw-prompt completions (one or more prompts; ``n`` choices each)."""
    state, model = _open(request, body, "/v1/completions")
    mapping.check_completion_request(body)
    params = mapping.sampling_params(
        body, vocab_size=state.vocab_size, default_max_tokens=16, logprobs=body.logprobs
    )
    params = mapping.echo_prompt_logprobs(body, params)
    if (spec := grammar_request.request_spec(body)) is not None:
        params = params.clone(structured=spec)
    prompts = mapping.completion_prompts(body.prompt)
    prompt_ids = [
        await off_loop(state, tokenize_text, state, p) if isinstance(p, str) else list(p)
        for p in prompts
    ]
    echo_texts: list[str | None] = [
        (p if isinstance(p, str) else state.tokenizer.decode(p)) if body.echo else None
        for p in prompts
    ]
    request_id = new_id("cmpl", request)
    session = tenancy.session_key(body.session_id, tenancy.request_owner(request))
    if session is not None and len(prompts) > 1:
        raise APIError(
            400, "a session takes a single prompt", param="session_id", code="invalid_value"
        )
    job, created = await _submit(
        state, request, body, model, request_id, prompt_ids, params, session
    )
    if body.stream:
        return _event_stream(
            _completion_stream(
                state,
                job,
                params.n,
                request_id,
                created,
                model,
                body.logprobs,
                echo_texts,
                _include_usage(body),
                bool(body.return_token_ids),
                body.prompt_logprobs,
            )
        )
    outputs = await job.collect(request)
    return _with_handoff(
        state,
        mapping.completion_response(
            request_id=request_id,
            created=created,
            model=model,
            outputs=outputs,
            tokenizer=state.tokenizer,
            logprobs=body.logprobs,
            echo_texts=echo_texts,
            return_token_ids=bool(body.return_token_ids),
            prompt_logprobs=body.prompt_logprobs,
        ),
        outputs,
    )


def _with_handoff(
    state: ServerState, response: dict[str, Any], outputs: list[Any]
) -> dict[str, Any]:
    """A prefill engine's answer carries the handle the decode engine pulls the KV cache with."""
    if outputs and outputs[0].kv_transfer_params is not None:
        response["kv_transfer_params"] = signed(
            state, outputs[0].kv_transfer_params, outputs[0].prompt_token_ids
        )
    return response


async def _completion_stream(
    state: ServerState,
    job: Job,
    n: int,
    request_id: str,
    created: int,
    model: str,
    logprobs: int | None,
    echo_texts: list[str | None],
    include_usage: bool,
    return_token_ids: bool,
    prompt_logprobs: int | None = None,
) -> AsyncIterator[bytes]:
    index_of = {rid: i for i, rid in enumerate(job.request_ids)}
    offsets: dict[tuple[str, int], int] = {}  # where each choice's next text starts
    try:
        async for latest in job.updates():
            choices = []
            for rid, out in latest.items():
                p = index_of[rid]
                for c in out.outputs:
                    key = (rid, c.index)
                    echo = (echo_texts[p] or "") if key not in offsets else ""
                    pos = offsets.get(key, len(echo))
                    choice: dict[str, Any] = {
                        "index": p * n + c.index,
                        "text": echo + c.text,
                        "logprobs": mapping.completion_logprobs(
                            state.tokenizer, c.logprobs or [], logprobs, pos
                        )
                        if logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                    if key not in offsets:  # a choice's first chunk carries its prompt's
                        _add_prompt_logprobs(choice, state, out, logprobs, echo_texts[p])
                        _add_vllm_prompt_logprobs(choice, state, out, prompt_logprobs)
                    offsets[key] = pos + len(c.text)
                    if return_token_ids:
                        choice["token_ids"] = c.token_ids
                    choices.append(choice)
            if choices:
                yield sse_event(
                    mapping.stream_chunk(
                        mapping.COMPLETION_CHUNK,
                        request_id=request_id,
                        created=created,
                        model=model,
                        choices=choices,
                        include_usage_field=include_usage,
                    )
                )
        if include_usage:
            outs = [job.last[rid] for rid in job.request_ids]
            u = mapping.usage(
                sum(len(o.prompt_token_ids) for o in outs),
                sum(job.num_output_tokens.values()),
                sum(o.num_cached_tokens for o in outs),
            )
            yield sse_event(
                mapping.stream_chunk(
                    mapping.COMPLETION_CHUNK,
                    request_id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage_info=u,
                )
            )
        yield DONE
    except APIError as err:
        yield error_event(err.body())
    finally:
        if not job.finished:
            job.abort_unfinished()


def _add_vllm_prompt_logprobs(
    choice: dict[str, Any], state: ServerState, out: Any, prompt_logprobs: int | None
) -> None:
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = mapping.vllm_prompt_logprobs(
            state.tokenizer, out.prompt_logprobs
        )


def _add_prompt_logprobs(
    choice: dict[str, Any], state: ServerState, out: Any, logprobs: int | None, echo: str | None
) -> None:
    """``echo`` with ``logprobs``: the echoed prompt's tokens lead the first chunk's logprobs."""
    if echo is None or logprobs is None:
        return
    head = mapping.echoed_logprobs(
        state.tokenizer, out.prompt_token_ids, out.prompt_logprobs, logprobs
    )
    choice["logprobs"] = mapping.joined_logprobs(head, choice["logprobs"])


@router.delete("/v1/sessions/{session_id}", responses=ERROR_RESPONSES)
async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
    """Free a session's KV blocks now (idle sessions also expire on their own)."""
    state = get_state(request)
    state.check_admitting()
    key = tenancy.session_key(session_id, tenancy.request_owner(request)) or session_id
    deleted = await state.engine.call(lambda e: e.delete_session(key))
    deleted = state.histories.drop(key) or deleted
    if not deleted:
        raise APIError(
            404,
            f"session {session_id!r} does not exist",
            code="session_not_found",
            param="session_id",
        )
    return {"id": session_id, "object": "session", "deleted": True}
