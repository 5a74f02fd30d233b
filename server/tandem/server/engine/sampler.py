"""Turns the step's logits into one token per sampling sequence.

Order, as in vLLM: penalties, logit bias, min_tokens masking, then greedy argmax or
temperature, top-k, top-p, min-p and a draw. Each request draws with its own
``torch.Generator``, so a seeded request samples the same tokens whatever its batch-mates.
Logprobs come from the raw model distribution (before any processing), as vLLM reports them,
except that a sequence with a grammar is masked first: its logprobs are those of the masked
distribution (tokens the grammar forbids have -inf), renormalised over what it allows.

A row with nothing to draw from (a NaN or an infinity in its processed logits, or every token
masked) gets no token but a ``RowError``: one request's failure must not become an
out-of-range token that fails the whole next step (the engine ends that request alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .request import Request, TokenLogprob
from .structured import apply_grammar_masks

# A repetition penalty or a temperature acts within [1e-5, 1e5]: past that a factor changes
# nothing that matters (every seen or every token is already flattened to ~0 or pushed far
# down) while float32 overflows (1e-300 made every logit inf; 1e300 is inf itself, and
# -inf / inf or 0 * inf is NaN). Logits (|x| <= ~1e3 with a logit bias) stay finite after
# both factors at their floor. A temperature below the floor is greedy (SamplingParams.greedy).
MIN_FACTOR, MAX_FACTOR = 1e-5, 1e5
NO_TOKEN_ALLOWED = "no_token_allowed"
LOGITS_NOT_FINITE = "logits_not_finite"


@dataclass(frozen=True)
class RowError:
    """Why no token could be drawn for a row; ``code`` is the API's error code."""

    code: str
    message: str


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int | None]  # None where ``errors`` has the row's error
    logprobs: list[TokenLogprob | None]
    errors: list[RowError | None]


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """logits: [len(requests), vocab] in the model's dtype; where a row needs more than its
    argmax they are taken in float32, and rows with a grammar are masked in place."""
    processed = logits  # every row greedy: nothing is drawn from it
    raw_logprobs: list[torch.Tensor | None] = [None] * len(requests)
    if all(_argmax_only(r) for r in requests):
        best, best_ids = _argmax(logits)
    else:
        logits = logits.float()
        apply_grammar_masks(logits, [r.sampling.grammar for r in requests])
        raw_logprobs = _raw_logprobs(logits, requests)
        processed = _process(logits, requests)
        best, best_ids = processed.max(dim=-1)
    # One sync for the batch; -1 marks a row whose maximum is not finite (max propagates NaN).
    tokens = torch.where(torch.isfinite(best), best_ids, -1).tolist()
    errors = [None if t >= 0 else _row_error(float(best[i])) for i, t in enumerate(tokens)]
    for i, req in enumerate(requests):
        if errors[i] is None and not req.params.greedy:
            tokens[i] = _draw(processed[i], req)
    logprobs = [
        None if lp is None or errors[i] else _chosen(lp, tokens[i], requests[i].params.logprobs)
        for i, lp in enumerate(raw_logprobs)
    ]
    return SamplerOutput([None if e else t for t, e in zip(tokens, errors)], logprobs, errors)


def _argmax_only(req: Request) -> bool:
    """Whether the row's token is its logits' argmax and nothing else is read from them."""
    return stateless(req) and req.params.logprobs is None


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest logit (float32; NaN where the row holds one) and its first index,
    read in the model's dtype: no float32 copy of the step's logits."""
    if kernels.argmax_rows_for(logits.device, logits.dtype) and logits.stride(-1) == 1:
        return kernels.argmax_rows(logits)
    best, ids = logits.max(dim=-1)
    return best.float(), ids


def _row_error(best: float) -> RowError:
    if best == float("-inf"):
        return RowError(
            NO_TOKEN_ALLOWED,
            "no token is allowed here: the output's grammar (with min_tokens) excludes every "
            "token of the vocabulary",
        )
    return RowError(
        LOGITS_NOT_FINITE,
        "this request's logits are not finite (NaN or infinity) once its sampling parameters "
        "are applied, so no token can be drawn",
    )


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
    """The logits each row picks from: a copy when any row changes (the raw logits give the
    logprobs), so an all-greedy batch without penalties costs nothing here."""
    changes = [i for i, r in enumerate(requests) if _changes(r)]
    if not changes:
        return logits
    logits = logits.clone()
    for i in changes:
        logits[i] = _process_row(logits[i], requests[i])
    return logits


def stateless(req: Request) -> bool:
    """Whether ``req``'s token for a row depends on that row's logits alone, not on the tokens
    drawn before it (greedy; no penalties, bias, grammar or ``min_tokens`` still to reach):
    speculation may then sample all its rows in one pass."""
    return not _changes(req) and req.sampling.grammar is None


def _changes(req: Request) -> bool:
    p = req.params
    return (
        not p.greedy
        or p.has_penalties
        or bool(p.logit_bias)
        or len(req.output_token_ids) < p.min_tokens
    )


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
            penalty = _clamp(p.repetition_penalty)
            penalised = torch.where(row > 0, row / penalty, row * penalty)
            row = torch.where(seen, penalised, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
    if len(req.output_token_ids) < p.min_tokens:
        banned = [
            t for t in (set(req.sampling.eos_token_ids) | set(p.stop_token_ids)) if 0 <= t < vocab
        ]
        row[banned] = float("-inf")
    if not p.greedy:  # scaled here, so the batch's one finiteness check covers the draw's row
        row = row / _clamp(p.temperature)
    return row


def _clamp(factor: float) -> float:
    return min(max(factor, MIN_FACTOR), MAX_FACTOR)


def _draw(row: torch.Tensor, req: Request) -> int:
    """A token from ``row`` (already divided by the temperature, with a finite maximum)."""
    p = req.params
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
        torch.searchsorted(
            _cdf(probs), draw_uniform(req.sampling.generator, probs.device), right=True
        )
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
