"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``): the
log-probability the model gives each prompt token after the tokens before it, which is what
loglikelihood evaluation (lm-evaluation-harness's multiple-choice tasks) reads.

They come from the forward pass that computes the prompt: the rows at positions
``[0, num_prompt_tokens - 1)`` of each chunk are sent through the LM head beside the sampling
rows, log-softmaxed in float32 (the raw distribution, as vLLM reports them) and folded into
the request by position, so a chunked or a preempted-and-recomputed prompt fills the same
slots. A cached prefix has K/V but no logits, so such a request never takes one from the
prefix cache (``Scheduler``), as a pooled request reading every row does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request, TokenLogprob
from .scheduler import ScheduledBatch


@dataclass(frozen=True)
class PromptSpan:
    """One request's prompt rows in a step: positions ``[start, start + count)`` at flat
    rows ``[row, row + count)``, each predicting the prompt token after it."""

    request: Request
    start: int
    count: int
    row: int


def prompt_spans(batch: ScheduledBatch) -> list[PromptSpan]:
    """The step's rows whose logits give prompt logprobs (requests that asked for them)."""
    spans: list[PromptSpan] = []
    row = 0
    for req, n in zip(batch.requests, batch.num_new_tokens):
        start = req.num_computed_tokens
        count = min(start + n, req.num_prompt_tokens - 1) - start
        if req.output.prompt_logprobs is not None and count > 0:
            spans.append(PromptSpan(req, start, count, row))
        row += n
    return spans


def span_rows(spans: list[PromptSpan]) -> list[int]:
    return [s.row + j for s in spans for j in range(s.count)]


def fold_prompt_logprobs(spans: list[PromptSpan], logits: torch.Tensor) -> None:
    """Record each span's logprobs (``logits``: the spans' rows, in order) in its request:
    slot ``p + 1`` holds the logprob of prompt token ``p + 1`` given tokens ``0..p``, with
    its rank in the distribution and the ``prompt_logprobs`` most likely tokens."""
    if not spans:
        return
    lp = torch.log_softmax(logits.float(), dim=-1)
    offset = 0
    for span in spans:
        req = span.request
        rows = lp[offset : offset + span.count]
        offset += span.count
        targets = torch.tensor(
            req.prompt_token_ids[span.start + 1 : span.start + 1 + span.count],
            dtype=torch.int64,
            device=rows.device,
        )
        chosen = rows.gather(1, targets[:, None])
        ranks = (rows > chosen).sum(dim=1) + 1
        top_n = req.params.prompt_logprobs or 0
        top = rows.topk(top_n, dim=1) if top_n else None
        values, ids = (top.values.tolist(), top.indices.tolist()) if top else ([], [])
        slots = req.output.prompt_logprobs
        assert slots is not None
        for j, (tok, v, rank) in enumerate(
            zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist())
        ):
            pairs = list(zip(ids[j], values[j])) if top else []
            slots[span.start + 1 + j] = TokenLogprob(tok, v, pairs, rank)
