"""What a request may ask for: a prompt inside the vocabulary, room in the context for it and
its max_tokens (an embedding's input: the context itself), no more choices than sequences can
run at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sampling_params import InvalidParamError, SamplingParams

if TYPE_CHECKING:
    from .config import EngineConfig
    from .models.config import ModelConfig


class PromptTooLongError(InvalidParamError):
    """The prompt (plus max_tokens) does not fit the model's context: the API's 413/400."""


def max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> int:
    """The longest sequence (prompt and output): the config's cap, the model's, and what the
    KV cache holds (block 0 is the null page)."""
    return min(
        config.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
        (num_blocks - 1) * config.block_size,
    )


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """Refuse what cannot run (a 400/413 naming the field); returns the request's max_tokens."""
    _check_ids(prompt_ids, vocab_size, "prompt")
    if params.n > max_num_seqs:
        raise InvalidParamError("n", f"n={params.n} exceeds max_num_seqs={max_num_seqs}")
    limit = max_model_len
    if len(prompt_ids) >= limit:
        raise PromptTooLongError(
            "prompt",
            f"This model's maximum context length is {limit} tokens; the prompt "
            f"has {len(prompt_ids)} tokens, leaving no room to generate.",
        )
    if params.max_tokens is None:
        return limit - len(prompt_ids)
    if len(prompt_ids) + params.max_tokens > limit:
        raise PromptTooLongError(
            "max_tokens",
            f"This model's maximum context length is {limit} tokens. "
            f"However, you requested {len(prompt_ids) + params.max_tokens} tokens "
            f"({len(prompt_ids)} in the prompt, {params.max_tokens} in the completion).",
        )
    return params.max_tokens


def check_pooled(prompt_ids: list[int], *, vocab_size: int, max_model_len: int) -> None:
    """A pooled (embedding) input generates nothing, so it may fill the whole context."""
    _check_ids(prompt_ids, vocab_size, "input")
    if len(prompt_ids) > max_model_len:
        raise PromptTooLongError(
            "input",
            f"This model's maximum context length is {max_model_len} tokens; the input "
            f"has {len(prompt_ids)} tokens.",
        )


def _check_ids(prompt_ids: list[int], vocab_size: int, param: str) -> None:
    if not prompt_ids:
        raise InvalidParamError(param, f"the {param} is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParamError(
            param, f"token id {bad[0]} is outside the vocabulary (size {vocab_size})"
        )
