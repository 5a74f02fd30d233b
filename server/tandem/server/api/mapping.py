"""Pure translations between the wire and the engine: requests to ``SamplingParams`` and
prompts, ``RequestOutput`` to response bodies and stream chunks.

Nothing here does I/O or touches the engine, so every rule (defaults, field aliases,
what is refused) is unit-tested without a server.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.server.engine import CompletionOutput, InvalidParamError, RequestOutput, SamplingParams
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
)

from .tool_parsers import arguments_as_objects

# A logprob of -inf is not JSON; clients get this floor instead (OpenAI uses -9999.0 too).
LOGPROB_FLOOR = -9999.0
_SEED_MOD = 2**63 - 2**20  # the engine seeds choice i with seed + i; keep that inside int64
_FORBIDDEN_TEMPLATE_KWARGS = {
    "tokenize",
    "conversation",
    "return_tensors",
    "return_dict",
    "tokenizer_kwargs",
    "tools",
    "documents",
}


def sampling_params(
    req: SamplingFields,
    *,
    vocab_size: int,
    default_max_tokens: int | None,
    logprobs: int | None = None,
) -> SamplingParams:
    """Map the shared sampling fields onto ``SamplingParams``; a bad value is a 400 naming its field."""
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:
        max_tokens = default_max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise APIError(
            400, f"{param} must be at least 1, got {max_tokens}", param=param, code="invalid_value"
        )
    min_tokens = req.min_tokens if req.min_tokens is not None else (req.min_new_tokens or 0)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = -1 if req.top_k is None or req.top_k == 0 else req.top_k
    fields: dict[str, Any] = dict(
        n=1 if req.n is None else req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=None if req.seed is None else req.seed % _SEED_MOD,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        ignore_eos=bool(req.ignore_eos),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
    )
    if req.prompt_logprobs is not None and req.session_id not in (None, "", -1):
        raise APIError(
            400,
            "prompt_logprobs cannot be combined with a session (its cached turns have no logits)",
            param="prompt_logprobs",
            code="invalid_value",
        )
    return _build(fields)


def echo_prompt_logprobs(req: CompletionRequest, params: SamplingParams) -> SamplingParams:
    """OpenAI's ``echo`` with ``logprobs`` reports the prompt's tokens too: ask the engine for
    prompt logprobs with as many alternatives as ``logprobs`` (or ``prompt_logprobs``) wants."""
    if not req.echo or req.logprobs is None:
        return params
    return params.clone(prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))


def generate_sampling_params(req: GenerateRequest, *, vocab_size: int) -> SamplingParams:
    """LMDeploy's ``/generate`` fields (top_k 0 = off, ``return_logprob`` = the chosen token's)."""
    if req.max_tokens < 1:
        raise APIError(
            400,
            f"max_tokens must be at least 1, got {req.max_tokens}",
            param="max_tokens",
            code="invalid_value",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return _build(
        dict(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=-1 if req.top_k in (0, -1) else req.top_k,
            min_p=req.min_p,
            seed=None if req.seed is None else req.seed % _SEED_MOD,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            ignore_eos=bool(req.ignore_eos),
            max_tokens=req.max_tokens,
            min_tokens=req.min_tokens or 0,
            logprobs=0 if req.return_logprob else None,
            skip_special_tokens=True
            if req.skip_special_tokens is None
            else req.skip_special_tokens,
        )
    )


def _build(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except InvalidParamError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400,
                f"logit_bias keys must be token ids, got {key!r}",
                param="logit_bias",
                code="invalid_value",
            ) from None
        if not 0 <= token < vocab_size:
            raise APIError(
                400,
                f"logit_bias token id {token} is outside the vocabulary (size {vocab_size})",
                param="logit_bias",
                code="invalid_value",
            )
        if not math.isfinite(value):
            raise APIError(
                400, "logit_bias values must be finite", param="logit_bias", code="invalid_value"
            )
        out[token] = value
    return out


def chat_logprobs_count(req: ChatCompletionRequest) -> int | None:
    """Chat: ``logprobs: true`` asks for the chosen token's; ``top_logprobs`` for alternatives too."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400,
            "top_logprobs requires logprobs to be true",
            param="top_logprobs",
            code="invalid_value",
        )
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def check_chat_request(req: ChatCompletionRequest) -> None:
    """Refuse what the engine cannot honour instead of silently ignoring it."""
    if isinstance(req.messages, list) and not req.messages:
        raise APIError(400, "messages must not be empty", param="messages", code="invalid_value")


def check_completion_request(req: CompletionRequest) -> None:
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise APIError(
            400, "best_of other than n is not supported", param="best_of", code="unsupported_value"
        )


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise APIError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of lists",
        param="prompt",
        code="invalid_value",
    )


def chat_messages(messages: str | list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (content flattened to text); a plain
    string is LMDeploy's one user message."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type not in ("text", "input_text") or part.text is None:
                    raise APIError(
                        400,
                        f"content part type {part.type!r} is not supported; only text",
                        param=f"messages.{i}.content",
                        code="unsupported_value",
                    )
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if (v := getattr(m, key)) is not None:
                msg[key] = arguments_as_objects(v) if key == "tool_calls" else v
        out.append(msg)
    return out


def render_chat(
    tokenizer: Any, req: ChatCompletionRequest, messages: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text: the model's chat template over the messages (LMDeploy's
    ``do_preprocess: false`` with a string takes the string as the raw prompt). ``messages``
    replaces the request's own (a session's whole conversation)."""
    if isinstance(req.messages, str) and req.do_preprocess is False:
        return req.messages
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(set(kwargs) & _FORBIDDEN_TEMPLATE_KWARGS)
    if bad:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(bad)}",
            param="chat_template_kwargs",
            code="invalid_value",
        )
    if req.enable_thinking is not None:
        kwargs.setdefault("enable_thinking", req.enable_thinking)
    kwargs.setdefault(
        "add_generation_prompt",
        True if req.add_generation_prompt is None else req.add_generation_prompt,
    )
    tools = (
        [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools] if req.tools else None
    )
    return apply_chat_template(
        tokenizer,
        messages if messages is not None else chat_messages(req.messages),
        tools=tools,
        **kwargs,
    )


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The one way every route renders a chat: the model's template over ``messages`` as text;
    no template, or a template that fails on these messages (jinja's ``TemplateError``, a
    template's own ``raise_exception``), is the client's 400."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            400,
            "this model has no chat template; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except APIError:
        raise
    except Exception as exc:
        raise APIError(
            400,
            f"the chat template failed on these messages: {exc}",
            param="messages",
            code="invalid_value",
        ) from exc


# ----- outputs ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Any, lps: list[Any], top: int) -> dict[str, Any]:
    """OpenAI chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for lp in lps:
        tok = token_text(tokenizer, lp.token_id)
        alts = [
            {
                "token": (t := token_text(tokenizer, tid)),
                "logprob": _lp(v),
                "bytes": list(t.encode()),
            }
            for tid, v in lp.top[:top]
        ]
        content.append(
            {
                "token": tok,
                "logprob": _lp(lp.logprob),
                "bytes": list(tok.encode()),
                "top_logprobs": alts,
            }
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: Any, lps: list[Any], top: int, text_offset: int
) -> dict[str, Any]:
    """Legacy completions shape: parallel lists plus character offsets into the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for lp in lps:
        tok = token_text(tokenizer, lp.token_id)
        tokens.append(tok)
        token_lps.append(_lp(lp.logprob))
        tops.append(
            {token_text(tokenizer, tid): _lp(v) for tid, v in lp.top[:top]} if top else None
        )
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echoed_logprobs(
    tokenizer: Any, prompt_ids: list[int], lps: list[Any] | None, top: int
) -> dict[str, Any]:
    """The legacy shape's prompt part (``echo``): its first token has no logprob (null), as
    OpenAI and vLLM answer; the rest come from the engine's prompt logprobs."""
    rest = completion_logprobs(tokenizer, [lp for lp in (lps or [])[1:] if lp is not None], top, 0)
    first = token_text(tokenizer, prompt_ids[0]) if prompt_ids else ""
    offsets = [o + len(first) for o in rest["text_offset"]]
    return {
        "tokens": [first, *rest["tokens"]][: len(prompt_ids)],
        "token_logprobs": [None, *rest["token_logprobs"]][: len(prompt_ids)],
        "top_logprobs": [None, *rest["top_logprobs"]][: len(prompt_ids)],
        "text_offset": [0, *offsets][: len(prompt_ids)],
    }


def joined_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects as one (the echoed prompt's, then the completion's)."""
    return {k: head[k] + tail[k] for k in head}


def vllm_prompt_logprobs(
    tokenizer: Any, lps: list[Any] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first null) a map from token id to
    ``{logprob, rank, decoded_token}``, holding the prompt's token and the top alternatives."""
    if lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(tid): {"logprob": _lp(v), "rank": r, "decoded_token": token_text(tokenizer, tid)}
            for r, (tid, v) in enumerate(lp.top, start=1)
        }
        entry[str(lp.token_id)] = {
            "logprob": _lp(lp.logprob),
            "rank": lp.rank,
            "decoded_token": token_text(tokenizer, lp.token_id),
        }
        out.append(entry)
    return out


def finish_reason(out: CompletionOutput) -> str | None:
    return out.finish_reason


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    outputs: list[RequestOutput],
    tokenizer: Any,
    top_logprobs: int | None,
    return_token_ids: bool = False,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    out = outputs[0]
    choices = []
    for c in out.outputs:
        choice: dict[str, Any] = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(tokenizer, c.logprobs or [], top_logprobs)
            if top_logprobs is not None
            else None,
            "finish_reason": c.finish_reason,
        }
        if isinstance(c.stop_reason, str):
            choice["stop_reason"] = c.stop_reason  # the stop string it matched (vLLM's field)
        if return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(
            len(out.prompt_token_ids),
            sum(len(c.token_ids) for c in out.outputs),
            out.num_cached_tokens,
        ),
    }
    if return_token_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    if prompt_logprobs is not None:  # vLLM's: the response's, beside its choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.prompt_logprobs)
    return body


def completion_choices(
    out: RequestOutput,
    *,
    base_index: int,
    tokenizer: Any,
    logprobs: int | None,
    echo_text: str | None,
    return_token_ids: bool = False,
    prompt_logprobs: int | None = None,
) -> list[dict[str, Any]]:
    choices = []
    for c in out.outputs:
        prefix = echo_text or ""
        choice: dict[str, Any] = {
            "index": base_index + c.index,
            "text": prefix + c.text,
            "logprobs": completion_logprobs(tokenizer, c.logprobs or [], logprobs, len(prefix))
            if logprobs is not None
            else None,
            "finish_reason": c.finish_reason,
        }
        if echo_text is not None and logprobs is not None:
            head = echoed_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, logprobs)
            choice["logprobs"] = joined_logprobs(head, choice["logprobs"])
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.prompt_logprobs)
        if return_token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        choices.append(choice)
    return choices


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    outputs: list[RequestOutput],
    tokenizer: Any,
    logprobs: int | None,
    echo_texts: list[str | None],
    return_token_ids: bool = False,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = cached = 0
    for i, out in enumerate(outputs):
        n = len(out.outputs)
        choices += completion_choices(
            out,
            base_index=i * n,
            tokenizer=tokenizer,
            logprobs=logprobs,
            echo_text=echo_texts[i],
            return_token_ids=return_token_ids,
            prompt_logprobs=prompt_logprobs,
        )
        prompt_tokens += len(out.prompt_token_ids)
        completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        cached += out.num_cached_tokens
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }


CHAT_CHUNK = "chat.completion.chunk"
COMPLETION_CHUNK = "text_completion"


def stream_chunk(
    object_: str,
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_info: dict[str, Any] | None = None,
    include_usage_field: bool = False,
) -> dict[str, Any]:
    """One streamed event of a chat (``CHAT_CHUNK``) or completion (``COMPLETION_CHUNK``)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage_field or usage_info is not None:
        body["usage"] = usage_info
    return body


def generate_finish(out: CompletionOutput) -> dict[str, Any] | None:
    """LMDeploy's ``meta_info.finish_reason``: ``{"type": "stop" | "length" | "abort"}``."""
    if out.finish_reason is None:
        return None
    info: dict[str, Any] = {"type": out.finish_reason}
    if out.stop_reason is not None:
        info["matched"] = out.stop_reason
    return info
