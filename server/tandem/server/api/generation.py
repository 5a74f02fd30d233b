"""Running one API request on the engine loop: submit, follow its outputs, abort on the way out.

Every route that runs the model (chat, completions, /generate, /api/generate, embeddings)
goes through here, so the rules are in one place: engine errors become API errors, a client
that disconnects aborts its requests, and nothing leaves a request running unobserved.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from tandem.server.engine import (
    EngineBusyError,
    EngineSleepingError,
    InvalidParamError,
    PoolingParams,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
)
from tandem.server.engine.structured import GrammarError, GrammarSpec
from tandem.server.wire.errors import APIError, ClientDisconnected

from . import mapping
from .engine_loop import EngineNotReadyError, EngineStepError, QueueFullError
from .state import ServerState

DISCONNECT_POLL_S = 0.5
T = TypeVar("T")


def new_id(prefix: str, request: Request | None = None) -> str:
    """The engine request id: the client's ``X-Request-Id`` as is, else ``prefix-<the id the
    edge generated>`` (so the log line and the response header name the same request)."""
    edge = request.scope.get("state", {}) if request is not None else {}
    if edge.get("request_id_given"):
        return edge["request_id"]
    return f"{prefix}-{edge.get('request_id') or uuid.uuid4().hex}"


async def off_loop(state: ServerState, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run tokenization or template rendering on the API's tokenizer thread, so a huge
    prompt never stalls the event loop (``/health``, other streams)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.tokenizer_pool, lambda: fn(*args, **kwargs))


def check_prompt_chars(state: ServerState, text: str, param: str) -> None:
    """413 before tokenizing when ``text`` must be over ``max_model_len`` tokens: no token is
    longer than the vocabulary's longest entry, so it has at least len/longest tokens."""
    limit = state.engine.info.get("max_model_len")
    if limit and len(text) > limit * state.longest_token_chars:
        raise APIError(
            413,
            f"the prompt ({len(text)} characters) is longer than max_model_len ({limit}) tokens",
            param=param,
            code="context_length_exceeded",
        )


def tokenize_text(state: ServerState, text: str, param: str = "prompt", **kwargs: Any) -> list[int]:
    """Token ids of ``text`` (on the tokenizer thread: call through ``off_loop``)."""
    check_prompt_chars(state, text, param)
    return list(state.tokenizer.encode(text, **kwargs))


def render_chat(state: ServerState, messages: list[dict[str, Any]]) -> list[int]:
    """Ollama-style messages through the chat template to token ids (through ``off_loop``)."""
    text = render_chat_text(state, messages)
    return tokenize_text(state, text, "messages", add_special_tokens=False)


def render_chat_text(
    state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    """The chat template's text for ``messages``, each message's length checked first."""
    for m in messages:
        check_prompt_chars(state, m.get("content") or "", "messages")
    return mapping.apply_chat_template(
        state.tokenizer, messages, add_generation_prompt=add_generation_prompt
    )


def api_error(exc: BaseException) -> APIError:
    """Map what the engine (loop) raises onto the API's status codes."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        status = 413 if exc.param == "prompt" else 400
        return APIError(status, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidParamError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full")
    if isinstance(exc, EngineSleepingError):
        return APIError(503, str(exc), code="engine_sleeping")
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), code="engine_not_ready")
    if isinstance(exc, EngineBusyError):
        return APIError(409, str(exc), code="engine_busy")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def ended_with_error(out: RequestOutput) -> APIError:
    """The API error of a request the engine ended with ``out.error`` (only that request: the
    engine went on with every other). No token allowed by the request's grammar and
    constraints is the client's to fix (400), a failed KV pull the prefill engine's (502),
    anything else (logits that are not finite) the engine's own (500)."""
    message, code = out.error or "", out.error_code
    if code in ("invalid_schema", "no_token_allowed"):
        return APIError(400, message, code=code)
    if code == "kv_transfer_error":
        return APIError(502, message, code=code, type="server_error")
    return APIError(500, message, code=code or "internal_error")


@dataclass
class Job:
    """One API request, fanned out to one engine request per prompt."""

    state: ServerState
    request_ids: list[str]
    sink: asyncio.Queue
    stream: bool = False
    last: dict[str, RequestOutput] = field(default_factory=dict)
    num_output_tokens: dict[str, int] = field(default_factory=dict)  # a stream's, so far
    # Called with the first choice's whole text once every choice finished by stop or length.
    on_finish: Callable[[str], None] | None = None
    _reasons: dict[tuple[str, int], str] = field(default_factory=dict)
    _first_text: list[str] = field(default_factory=list)  # a stream's pieces of it

    @property
    def finished(self) -> bool:
        return all(rid in self.last and self.last[rid].finished for rid in self.request_ids)

    def abort_unfinished(self) -> None:
        for rid in self.request_ids:
            out = self.last.get(rid)
            if out is None or not out.finished:
                self.state.engine.abort(rid)

    async def updates(self) -> AsyncIterator[dict[str, RequestOutput]]:
        """Each wake-up yields what is new per request: for a stream, the deltas that arrived
        since the last wake-up merged into one; otherwise the newest cumulative output."""
        pending = {
            rid for rid in self.request_ids if not (rid in self.last and self.last[rid].finished)
        }
        while pending:
            items = [await self.sink.get()]
            while not self.sink.empty():
                items.append(self.sink.get_nowait())
            latest: dict[str, RequestOutput] = {}
            for rid, item in items:
                if isinstance(item, BaseException):
                    raise api_error(item)
                if item.error is not None:  # ended without finishing: a failed pull or draw
                    raise ended_with_error(item)
                self._reasons.update(
                    ((rid, c.index), c.finish_reason) for c in item.outputs if c.finished
                )
                if self.stream:
                    self._follow(rid, item)
                    item = latest[rid].merge(item) if rid in latest else item
                latest[rid] = item
                self.last[rid] = item
                if item.finished:
                    pending.discard(rid)
            if not pending and self.on_finish is not None:
                if all(r in ("stop", "length") for r in self._reasons.values()):
                    self.on_finish(self._whole_first_text())
            yield latest

    def _follow(self, rid: str, delta: RequestOutput) -> None:
        self.num_output_tokens[rid] = self.num_output_tokens.get(rid, 0) + sum(
            len(c.token_ids) for c in delta.outputs
        )
        if rid == self.request_ids[0]:
            self._first_text += [c.text for c in delta.outputs if c.index == 0]

    def _whole_first_text(self) -> str:
        if self.stream:
            return "".join(self._first_text)
        return self.last[self.request_ids[0]].outputs[0].text

    async def collect(self, request: Request | None) -> list[RequestOutput]:
        """Wait for every request to finish; abort them all if the client disconnects first."""

        async def drain() -> None:
            async for _ in self.updates():
                pass

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    return [self.last[rid] for rid in self.request_ids]
                if request is not None and await request.is_disconnected():
                    raise ClientDisconnected()
        finally:
            if not task.done():
                task.cancel()
            if not self.finished:
                self.abort_unfinished()


async def _await_compile(fut: Future, budget_s: float, client: Request | None) -> None:
    """Wait for a compile, at most ``budget_s``, and only while the client is still there."""
    waiter = asyncio.wrap_future(fut)
    deadline = time.monotonic() + budget_s
    try:
        while True:
            left = deadline - time.monotonic()
            done, _ = await asyncio.wait({waiter}, timeout=max(0.0, min(left, DISCONNECT_POLL_S)))
            if done:
                waiter.result()
                return
            if time.monotonic() >= deadline:
                raise APIError(
                    400,
                    f"the grammar did not compile within {budget_s:g} s; make it smaller "
                    "(docs/structured.md)",
                    param="response_format",
                    code="grammar_timeout",
                )
            if client is not None and await client.is_disconnected():
                raise ClientDisconnected()
    finally:  # never cancelled here: that would cancel the cache's future for every waiter
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, quiet


async def compile_grammar(
    state: ServerState, spec: GrammarSpec, client: Request | None = None
) -> None:
    """Compile on the engine's grammar thread before adding, so a schema the library refuses
    (or one over the limits) is this request's 400 and a slow one waits here, not in the
    engine's step: at most the cache's budget, and not after its client has left."""
    grammars = await state.engine.call(lambda e: e.grammars)
    try:
        fut = grammars.acquire(spec)
    except GrammarError as exc:
        raise APIError(400, str(exc), param="response_format", code=exc.code) from exc
    try:
        await _await_compile(fut, grammars.budget_s, client)
    except GrammarError as exc:
        raise APIError(400, str(exc), param="response_format", code=exc.code) from exc
    finally:
        grammars.release(spec)


async def submit(
    state: ServerState,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    stream: bool,
    session_id: str | None = None,
    kv_transfer: dict | None = None,
    pooling: PoolingParams | None = None,
    tenant: str | None = None,
    cache_salt: str | None = None,
    lora: str | None = None,
    client: Request | None = None,
) -> Job:
    """Add one engine request per prompt; if any is refused, abort the ones already added.
    With ``pooling`` each is an embedding (prefill-only; see ``LLMEngine.add_request``).
    ``tenant`` (``tenancy.request_tenant``) and ``cache_salt`` name the prefix-cache partition
    its blocks are shared in, so one key never hits (or learns of) another's prompts; ``lora``
    the adapter they run through (``ServerState.lora_of``).
    ``client``, when given, is watched while its grammar compiles (it may leave)."""
    state.check_admitting()
    if kv_transfer and len(prompts) != 1:
        raise APIError(
            400,
            "kv_transfer_params takes a single prompt",
            param="kv_transfer_params",
            code="invalid_value",
        )
    if params.structured is not None:
        await compile_grammar(state, params.structured, client)
    arrival = time.monotonic()
    sink: asyncio.Queue = asyncio.Queue()
    ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    job = Job(state, [], sink, stream=stream)
    try:
        for rid, prompt in zip(ids, prompts):
            await state.engine.add_request(
                rid,
                prompt,
                params,
                sink=sink,
                stream=stream,
                session_id=session_id,
                arrival=arrival,
                kv_transfer=kv_transfer,
                pooling=pooling,
                tenant=tenant,
                cache_salt=cache_salt,
                lora=lora,
            )
            job.request_ids.append(rid)
    except BaseException as exc:
        job.abort_unfinished()
        if isinstance(exc, Exception):
            raise api_error(exc) from exc
        raise
    return job
