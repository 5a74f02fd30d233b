"""Turns the step's logits into one token per sampling sequence.

Order, as in vLLM: penalties, logit bias, min_tokens masking, then greedy argmax or
temperature, top-k, top-p, min-p and a draw. Each request draws with its own
``torch.Generator``, so a seeded request samples the same tokens whatever its batch-mates.
Logprobs come from the raw model distribution (before any processing), as vLLM reports them,
except that a sequence with a grammar is masked first: its logprobs are those of the masked
distribution (tokens the grammar forbids have -inf), renormalised over what it allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request, TokenLogprob
from .structured import apply_grammar_masks


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """logits: [len(requests), vocab], float32; rows with a grammar are masked in place."""
    apply_grammar_masks(logits, [r.grammar for r in requests])
    raw_logprobs = _raw_logprobs(logits, requests)
    processed = _process(logits, requests)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    if len(greedy) == len(requests) and all(lp is None for lp in raw_logprobs):
        # All greedy, no logprobs (the common batch): one argmax, no row gather or copy.
        return SamplerOutput(processed.argmax(dim=-1).tolist(), raw_logprobs)
    tokens = torch.empty(len(requests), dtype=torch.int64)
    if greedy:
        tokens[greedy] = processed[greedy].argmax(dim=-1).cpu()
    for i, req in enumerate(requests):
        if not req.params.greedy:
            tokens[i] = _draw(processed[i], req)
    token_list = tokens.tolist()
    logprobs = [
        None if lp is None else _chosen(lp, token_list[i], requests[i].params.logprobs)
        for i, lp in enumerate(raw_logprobs)
    ]
    return SamplerOutput(token_list, logprobs)


def _raw_logprobs(logits: torch.Tensor, requests: list[Request]) -> list[torch.Tensor | None]:
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    out: list[torch.Tensor | None] = [None] * len(requests)
    if rows:
        lp = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
        for j, i in enumerate(rows):
            out[i] = lp[j]
    return out


def _chosen(logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = logprobs.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def _process(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    needs = [
        i
        for i, r in enumerate(requests)
        if r.params.has_penalties
        or r.params.logit_bias
        or len(r.output_token_ids) < r.params.min_tokens
    ]
    if not needs:
        return logits
    logits = logits.clone()
    for i in needs:
        logits[i] = _process_row(logits[i], requests[i])
    return logits


def _process_row(row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    vocab = row.shape[0]
    if p.has_penalties:
        out_ids = torch.tensor(
            [t for t in req.output_token_ids if t < vocab], dtype=torch.int64, device=row.device
        )
        counts = torch.bincount(out_ids, minlength=vocab).to(row.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(
                [t for t in req.prompt_token_ids if t < vocab], dtype=torch.int64, device=row.device
            )
            seen[prompt] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalised, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
    if len(req.output_token_ids) < p.min_tokens:
        banned = [t for t in (set(req.eos_token_ids) | set(p.stop_token_ids)) if 0 <= t < vocab]
        row[banned] = float("-inf")
    return row


def _draw(row: torch.Tensor, req: Request) -> int:
    p = req.params
    row = row.float() / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        drop_sorted = (cum - sorted_probs) > p.top_p
        drop_sorted[0] = False
        probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(
        torch.searchsorted(_cdf(probs), draw_uniform(req.generator, probs.device), right=True)
    )


def draw_uniform(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """The one number a token's draw takes from its request's generator, in [0, 1)."""
    return torch.rand(1, dtype=torch.float64, generator=generator, device=device)


def _cdf(probs: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling's table: ``u`` in [0, 1) picks the first index whose entry exceeds
    it (``searchsorted(right=True)``), so a zero-probability token (equal neighbours) is never
    drawn and the last entry is exactly 1. One uniform per token instead of one exponential per
    vocabulary entry (which took 0.8 ms per row of 49k on a CPU core, 20 times this)."""
    cum = probs.double().cumsum(0)
    return cum / cum[-1]
