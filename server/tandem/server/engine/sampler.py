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

import numpy as np
import torch

from . import kernels
from .request import Request, TokenLogprob
from .sampling_params import SamplingParams
from .structured import apply_grammar_masks

# A repetition penalty or a temperature acts within [1e-5, 1e5]: past that a factor changes
# nothing that matters (every seen or every token is already flattened to ~0 or pushed far
# down) while float32 overflows (1e-300 made every logit inf; 1e300 is inf itself, and
# -inf / inf or 0 * inf is NaN). Logits (|x| <= ~1e3 with a logit bias) stay finite after
# both factors at their floor. A temperature below the floor is greedy (SamplingParams.greedy).
MIN_FACTOR, MAX_FACTOR = 1e-5, 1e5
# Top-p sorts only the tokens at least this share of a row's likeliest, when they hold more
# than top-p (the usual case: a model's distribution is peaked); else the whole row.
CANDIDATE_SHARE = 1e-4
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
    argmax or a draw at its temperature they are taken in float32, and rows with a grammar
    are masked in place."""
    if _temperature_only(logits, requests):
        temps = [_clamp(r.params.temperature) for r in requests]
        best, tokens = kernels.draw_rows(logits, _uniforms(logits, requests), temps)
        return _output(best, tokens, [None] * len(requests), requests)
    processed = logits  # every row greedy: nothing is drawn from it
    raw_logprobs: list[torch.Tensor | None] = [None] * len(requests)
    if all(_argmax_only(r) for r in requests):
        best, best_ids = _argmax(logits)
    else:
        owned = logits.dtype != torch.float32  # a copy of the caller's, ours to change
        logits = logits.float()
        apply_grammar_masks(logits, [r.sampling.grammar for r in requests])
        raw_logprobs = _raw_logprobs(logits, requests)
        processed = _process(logits, requests, owned)
        best, best_ids = processed.max(dim=-1)
    # One sync for the batch; -1 marks a row whose maximum is not finite (max propagates NaN).
    tokens = torch.where(torch.isfinite(best), best_ids, -1)
    drawn = [i for i, t in enumerate(tokens.tolist()) if t >= 0 and not requests[i].params.greedy]
    if drawn:
        tokens[drawn] = torch.tensor(_draw(processed, drawn, [requests[i] for i in drawn]))
    return _output(best, tokens, raw_logprobs, requests)


def _output(
    best: torch.Tensor,
    tokens: torch.Tensor,
    raw_logprobs: list[torch.Tensor | None],
    requests: list[Request],
) -> SamplerOutput:
    """Each row's token, or its error where ``tokens`` holds -1 (``best``: why)."""
    ids = tokens.tolist()
    errors = [None if t >= 0 else _row_error(float(best[i])) for i, t in enumerate(ids)]
    logprobs = [
        None if lp is None or errors[i] else _chosen(lp, ids[i], requests[i].params.logprobs)
        for i, lp in enumerate(raw_logprobs)
    ]
    return SamplerOutput([None if e else t for t, e in zip(ids, errors)], logprobs, errors)


def _temperature_only(logits: torch.Tensor, requests: list[Request]) -> bool:
    """Whether every row is a draw that only its temperature shapes, nothing else read from
    its logits (the API's default): ``kernels.draw_rows`` then takes them in the model's
    dtype, with no float32 copy, and draws each as ``_draw`` would."""
    vocab = logits.shape[1]
    return kernels.draw_rows_for(logits.device, logits.dtype) and all(
        not r.params.greedy
        and not _adjusts(r)
        and r.sampling.grammar is None
        and r.params.logprobs is None
        and not _filters(r.params, vocab)
        for r in requests
    )


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


def _process(logits: torch.Tensor, requests: list[Request], owned: bool) -> torch.Tensor:
    """The logits each row picks from: changed in place where ``logits`` is ``owned`` (a
    float32 copy made here; the raw logprobs are taken before), else a copy when any row
    changes, so an all-greedy batch without penalties costs nothing here. The drawn rows
    are divided by their temperatures together (one op for the batch, not one per row)."""
    changes = [i for i, r in enumerate(requests) if _changes(r)]
    if not changes:
        return logits
    if not owned:
        logits = logits.clone()
    for i in changes:
        if _adjusts(requests[i]):
            logits[i] = _adjust_row(logits[i], requests[i])
    drawn = [i for i in changes if not requests[i].params.greedy]
    if drawn:
        # scaled here, so the batch's one finiteness check covers the draw's rows
        temps = _per_row([_clamp(requests[i].params.temperature) for i in drawn], logits)
        if len(drawn) == logits.shape[0]:
            logits.div_(temps)
        else:
            logits[drawn] = logits[drawn] / temps
    return logits


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A column of one value a row, in ``like``'s dtype and device, to broadcast over rows."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def stateless(req: Request) -> bool:
    """Whether ``req``'s token for a row depends on that row's logits alone, not on the tokens
    drawn before it (greedy; no penalties, bias, grammar or ``min_tokens`` still to reach):
    speculation may then sample all its rows in one pass."""
    return not _changes(req) and req.sampling.grammar is None


def _changes(req: Request) -> bool:
    return not req.params.greedy or _adjusts(req)


def _adjusts(req: Request) -> bool:
    """Whether the row's logits are changed before any temperature: penalties, a logit bias,
    or end-of-sequence tokens banned until ``min_tokens``."""
    p = req.params
    return p.has_penalties or bool(p.logit_bias) or len(req.output_token_ids) < p.min_tokens


def _adjust_row(row: torch.Tensor, req: Request) -> torch.Tensor:
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
    return row


def _clamp(factor: float) -> float:
    return min(max(factor, MIN_FACTOR), MAX_FACTOR)


def _draw(processed: torch.Tensor, rows: list[int], requests: list[Request]) -> list[int]:
    """A token for each of ``rows`` of ``processed`` (divided by their temperatures, each with
    a finite maximum), ``requests`` theirs: one uniform from each request's generator, then a
    row that only its temperature shapes is drawn by ``kernels.draw_rows`` where it runs (one
    pass over the row: 32 rows at temperature 1 took 10 ms on two cores as torch ops), and
    the others by ``_filtered_draws``. Which way a row goes depends on its own parameters, so
    it draws what it draws alone."""
    logits = processed if len(rows) == processed.shape[0] else processed[rows]
    uniforms = _uniforms(logits, requests)
    vocab = logits.shape[1]
    plain = []
    if kernels.draw_rows_for(logits.device, logits.dtype):
        plain = [j for j, r in enumerate(requests) if not _filters(r.params, vocab)]
    tokens = [0] * len(requests)
    if plain:
        part = logits if len(plain) == len(requests) else logits[plain]
        for j, token in zip(plain, kernels.draw_rows(part, uniforms[plain])[1].tolist()):
            tokens[j] = token
    rest = sorted(set(range(len(requests))) - set(plain))
    if rest:
        part = logits if len(rest) == len(requests) else logits[rest]
        drawn = _filtered_draws(part, [requests[j] for j in rest], uniforms[rest])
        for j, token in zip(rest, drawn):
            tokens[j] = token
    return tokens


def _uniforms(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    return torch.cat([draw_uniform(r.sampling.generator, logits.device) for r in requests])


def _filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p cut the row before its draw."""
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0


def _filtered_draws(
    logits: torch.Tensor, requests: list[Request], uniforms: torch.Tensor
) -> list[int]:
    """Top-k, top-p and min-p, then inverse-CDF draws, the rows through each stage together:
    drawn row by row, 32 rows took 6.5 ms on two cores at temperature 1 and 119 ms with
    top-p (a torch sort of each row), longer than the decode step. On CPU a row draws what
    it draws alone; on a GPU a batch's float64 CDF may be summed in another order than one
    row's (a token apart only where a uniform falls within ~1e-16 of a boundary)."""
    logits = _top_k(logits, [r.params.top_k for r in requests])
    probs = torch.softmax(logits, dim=-1)
    top_p = [r.params.top_p for r in requests]
    if min(top_p) < 1.0:
        probs = probs.masked_fill(~_top_p_kept(probs, top_p), 0.0)
    min_p = [r.params.min_p for r in requests]
    if max(min_p) > 0.0:
        probs = probs.masked_fill(probs < _per_row(min_p, probs) * probs.amax(1, True), 0.0)
    return torch.searchsorted(_cdf(probs), uniforms.unsqueeze(1), right=True).squeeze(1).tolist()


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Each row's logits below its ``top_k``-th largest masked (-inf); a row with no top-k
    (``-1``, or the whole vocabulary) keeps them all."""
    vocab = logits.shape[1]
    ks = [k for k in top_k if 0 < k < vocab]
    if not ks:
        return logits
    largest = torch.topk(logits, max(ks), dim=-1).values  # sorted, largest first
    at = [k - 1 if 0 < k < vocab else 0 for k in top_k]
    kth = largest.gather(1, torch.tensor(at, device=logits.device).unsqueeze(1))
    kth[[i for i, k in enumerate(top_k) if not 0 < k < vocab]] = float("-inf")
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_kept(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Which tokens each row's top-p keeps (a row with top-p 1 keeps them all): every token
    as likely as the row's cut or likelier, but where the cut falls among equal
    probabilities, only as many of them as it allows, the lowest ids first (no tie left to a
    sort's order)."""
    floors, ties = [0.0] * len(top_p), [probs.shape[1]] * len(top_p)
    host = probs.cpu().numpy()  # on CPU the same memory
    for i, p in enumerate(top_p):
        if p < 1.0:
            floors[i], ties[i] = _cut(host[i], p)
    floor = _per_row(floors, probs)
    if min(ties) == probs.shape[1]:
        return probs >= floor
    tied = probs == floor
    return (probs > floor) | (tied & (tied.cumsum(1) <= _per_row(ties, probs)))


def _cut(probs: np.ndarray, top_p: float) -> tuple[float, int]:
    """Where top-p cuts one row: the likeliest tokens are kept while the ones before them sum
    to at most ``top_p`` (the first always); returns the smallest probability kept and how many
    tokens of that probability are (the row's length when all of them are). Only the tokens at
    least ``CANDIDATE_SHARE`` times as likely as the likeliest are sorted when they hold more
    than ``top_p`` (every token below them has more than ``top_p`` before it): a whole row of
    49k took numpy ~0.2-0.4 ms."""
    candidates = probs[probs >= probs.max() * CANDIDATE_SHARE]
    if candidates.sum(dtype=np.float64) <= top_p:
        candidates = probs
    ordered = -np.sort(-candidates)
    before = np.cumsum(ordered, dtype=np.float64) - ordered
    beyond = np.flatnonzero(before[1:] > top_p)
    kept = ordered[: beyond[0] + 1 if beyond.size else ordered.size]
    floor = kept[-1]
    ties = np.count_nonzero(kept == floor)
    return float(floor), int(ties if ties < np.count_nonzero(ordered == floor) else probs.size)


def draw_uniform(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """The one number a token's draw takes from its request's generator, in [0, 1)."""
    return torch.rand(1, dtype=torch.float64, generator=generator, device=device)


def _cdf(probs: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling's table: ``u`` in [0, 1) picks the first index whose entry exceeds
    it (``searchsorted(right=True)``), so a zero-probability token (equal neighbours) is never
    drawn and the last entry is exactly 1. One uniform per token instead of one exponential per
    vocabulary entry (which took 0.8 ms per row of 49k on a CPU core, 20 times this)."""
    cum = probs.double().cumsum(-1)
    return cum / cum[..., -1:]
