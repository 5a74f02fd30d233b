"""A request's state inside the engine: its tokens, its block table, how far it has been
computed, and the parts only one side of the engine reads (sampling, output, P/D, timings,
pooling)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .detokenizer import IncrementalDetokenizer
from .kv_transfer import RemotePrefill
from .prefix_cache import ROOT_HASH
from .sampling_params import SamplingParams
from .spec_decode.draft import Draft

if TYPE_CHECKING:
    from .lora.adapter import LoraAdapter
    from .pooling import PoolingParams
    from .structured import SequenceGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed (``Request.output.error`` says why)

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (see sampler.py for which distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs


@dataclass(eq=False)
class SamplingState:
    """What drawing and stopping a sequence's next token read beyond its ``SamplingParams``:
    its length limit (``max_tokens`` resolved against the context), the model's EOS ids, its
    own generator (seeded per choice), its grammar's matcher (structured outputs) and, when
    the engine speculates, this step's proposal to verify (``spec_decode/``)."""

    max_tokens: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    grammar: SequenceGrammar | None = None
    draft: Draft = field(default_factory=Draft)


@dataclass(eq=False)
class OutputState:
    """What the output path keeps for a sequence: its choice ``index``, its text so far (a
    stream's, or one with stop strings, has a detokenizer), its logprobs, why it ended, and
    for a ``stream`` how much of it has been reported already (the cursor its deltas start at)."""

    index: int = 0
    stream: bool = False
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # A leader asking for prompt logprobs: one slot per prompt token (the first is None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None
    stop_text_end: int | None = None  # output text is cut here when a stop string matched
    error: str | None = None  # why it ended without finishing (a failed pull, a failed draw)
    error_code: str | None = None  # the error's kind, for the API's status (api/generation.py)
    num_reported_tokens: int = 0
    num_reported_logprobs: int = 0  # a decode-side request's first token came without one
    num_reported_chars: int = 0
    finish_reported: bool = False


@dataclass(eq=False)
class HandoffState:
    """P/D: a prefill-role request (``remote_decode``) keeps its blocks under a lease when it
    finishes and hands out ``kv_transfer_params``; a decode-role one (``remote_prefill``) gets
    its prompt's K/V by a pull before it is scheduled."""

    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None
    pull_in_flight: bool = False
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(eq=False)
class Timings:
    """``time.monotonic()`` at arrival (``add_request``), first token and finish."""

    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class PoolingState:
    """A pooled request (embeddings) is prefill-only: it ends when its prompt is computed,
    with ``vector`` (the running pooling state, then the vector) instead of tokens."""

    params: PoolingParams
    vector: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Partition:
    """Whose KV a request computes: the prefix-cache root its block hashes start from (its
    tenant, ``cache_salt`` and LoRA adapter: ``InputProcessor.cache_partition``) and the
    adapter it runs through, which the step reads (None: the base model)."""

    root: int = ROOT_HASH
    lora: LoraAdapter | None = None


@dataclass(eq=False)
class Request:
    """One sequence being generated. A request with ``n > 1`` becomes ``n`` of these (a group).

    The fields the scheduler and the KV cache read on every step are its own; the rest is in
    parts, each read by one side: ``sampling`` (the sampler, the stop checks), ``output`` (the
    output path), ``handoff`` (P/D), ``times`` and ``pooling``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    arrival_order: int
    group_id: str
    session_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    partition: Partition = field(default_factory=lambda: Partition())
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Siblings of an n > 1 group are forked from this request once its prompt is computed.
    pending_siblings: list[Request] = field(default_factory=list)
    output: OutputState = field(default_factory=OutputState)
    times: Timings = field(default_factory=Timings)
    handoff: HandoffState | None = None  # only a disaggregated request has one
    pooling: PoolingState | None = None  # only a pooled request has one

    @property
    def cache_root(self) -> int:
        """The prefix-cache root its block hashes start from."""
        return self.partition.root

    @property
    def lora(self) -> LoraAdapter | None:
        """The LoRA adapter it runs through (None: the base model)."""
        return self.partition.lora

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
