"""vLLM's ``/tokenize`` and ``/detokenize``: the server's own tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ERROR_RESPONSES, DetokenizeRequest, TokenizeRequest

from .generation import off_loop, render_chat_text, tokenize_text
from .mapping import chat_messages
from .state import ServerState, get_state

router = APIRouter(route_class=ParsedJSONRoute)


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    """A prompt gets special tokens by default, a rendered chat none (the template wrote
    them), as vLLM does; ``add_special_tokens`` overrides either."""
    if body.messages is not None:
        messages = chat_messages(body.messages)
        text = render_chat_text(state, messages, body.add_generation_prompt)
        special = bool(body.add_special_tokens)
        return tokenize_text(state, text, "messages", add_special_tokens=special)
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return tokenize_text(state, body.prompt or "", "prompt", add_special_tokens=special)


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """``{count, max_model_len, tokens}`` (and ``token_strs`` when asked) for a prompt or messages."""
    state = get_state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400, "give exactly one of prompt and messages", param="prompt", code="invalid_value"
        )
    ids = await off_loop(state, _tokenize, state, body)
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.engine.info.get("max_model_len"),
        "tokens": ids,
    }
    if body.return_token_strs:
        out["token_strs"] = await off_loop(state, state.tokenizer.convert_ids_to_tokens, ids)
    return out


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    """``{prompt}``: the text of token ids (400 for an id outside the vocabulary)."""
    state = get_state(request)
    state.check_model(body.model)
    if bad := [t for t in body.tokens if not 0 <= t < state.vocab_size]:
        raise APIError(
            400,
            f"token id {bad[0]} is outside the vocabulary",
            param="tokens",
            code="invalid_value",
        )
    return {"prompt": await off_loop(state, state.tokenizer.decode, body.tokens)}
