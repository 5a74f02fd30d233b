"""What the engine hands back per step, shaped like vLLM's ``RequestOutput``.

A request added with ``stream=True`` gets deltas (vLLM's ``RequestOutputKind.DELTA``): each
output holds only the choices with something new (text, or their finish), and for each
only the text, tokens and logprobs since that choice was last reported; ``merge`` joins two
of them. Any other request gets one cumulative output when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .request import TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput) -> CompletionOutput:
        """This delta followed by ``later``, as one."""
        lps = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return CompletionOutput(
            self.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            later.finish_reason,
            later.stop_reason,
            lps,
        )


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = (
        None  # a prefill engine's handle for the decode side
    )
    error: str | None = None  # why a request ended without finishing (a failed KV pull, say)
    error_code: str | None = None  # the error's kind (sampler.py, kv_handoff.py, compiling.py)
    embedding: list[float] | None = None  # a finished pooled request's vector (pooling.py)
    # Asked-for prompt logprobs (prompt_logprobs.py), one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """Two deltas of one request as one (a consumer that fell behind takes them together)."""
        choices = {c.index: c for c in self.outputs}
        for c in later.outputs:
            choices[c.index] = choices[c.index].merge(c) if c.index in choices else c
        return replace(later, outputs=[choices[i] for i in sorted(choices)])

    # The first choice's fields, for the common n = 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs
