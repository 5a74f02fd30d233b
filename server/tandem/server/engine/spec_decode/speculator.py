"""Proposes tokens for the scheduler and verifies them with the engine's sampler.

A decoding request with a proposal of ``k`` tokens computes ``k + 1`` positions in one step
(its last token and the proposal) and gets ``k + 1`` rows of logits. Verification goes in
rounds: round ``j`` samples row ``j`` of every request still agreeing, with the engine's own
``sample`` (grammar masks, penalties, logit bias, min_tokens, logprobs, the request's generator)
and appends the token through the engine's own path (stop checks, detokenizer, grammar). A
request goes on to round ``j + 1`` only while its sampled token equals the proposed one, so
row ``j + 1`` was computed on exactly the tokens the request now holds; the first token that
differs (or the one after the whole proposal) is the target's own, and a stop ends it at once.
A request whose draw reads nothing but its row's logits (``sampler.stateless``: greedy, no
penalties, bias, grammar or ``min_tokens`` to reach) has all its rows sampled in one pass
before the rounds, which then take those tokens: the same ones, one sampler call a step.

Every emitted token is the target's draw from its own distribution given the tokens before it
(one uniform from the request's generator per token, as without speculation), so greedy output
is token for token what decoding one token a step gives, a seeded request samples the same
tokens with speculation on or off, and temperature > 0 keeps the target distribution: for a
proposal that is one token (a point mass ``q``), keeping it when the target's draw equals it
and else emitting that draw is rejection sampling, accepting with probability ``p(d)`` and
drawing from the residual ``p - q`` (``p`` without ``d``) otherwise.

The K/V of positions whose proposed token was rejected were written but are never read: the
request's ``num_computed_tokens`` counts only verified positions, the blocks past its tokens go
back to the pool, and the prefix cache only ever publishes blocks of verified tokens
(``Scheduler._take``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kv_cache_manager import KVCacheManager
from ..request import Request, TokenLogprob
from ..sampler import RowError, SamplerOutput, sample, stateless
from ..stats import Totals
from .cost import StepCost
from .draft import Draft
from .draft_model import DraftModel
from .ngram import STRONG_NGRAM, propose_ngram

TakeSamples = Callable[[list[Request], SamplerOutput], None]
# Up to k tokens to follow a sequence's tokens and the length of the match they come from
# (``propose_ngram``'s signature): one shorter than STRONG_NGRAM is a weak proposal.
Proposer = Callable[[list[int], int], tuple[list[int], int]]


class Speculator:
    """Speculation for one engine (n-gram lookup, or a draft model): ``propose`` (the
    scheduler's hook), ``verify`` and ``release``."""

    def __init__(
        self,
        most: int,
        kv: KVCacheManager,
        max_model_len: int,
        totals: Totals,
        cost: StepCost,
        draft_model: DraftModel | None = None,
        proposer: Proposer = propose_ngram,
    ) -> None:
        self.most = most
        self.cost = cost
        self.draft_model = draft_model  # proposes in place of the n-gram lookup when given
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.totals = totals
        totals.spec_accepted_per_position = [0] * most

    def propose(self, requests: list[Request], rows: int, budget: int) -> list[list[int]]:
        """Tokens to verify after each decoding request's last one this step (at most
        ``budget`` in all, in a step of ``rows`` rows so far): as many as the step's cost model
        finds worth their rows, never past a request's ``max_tokens`` or the context, and only
        what its grammar allows. A lookup runs first (it costs microseconds), so rows go only to
        requests that found something, priced by what kind of match it was."""
        caps = [self._most_for(req) for req in requests]
        drafts = [req.sampling.draft for req in requests]
        if self.draft_model is not None:
            proposals = self.draft_model.propose(requests, self._plan(rows, caps, drafts, budget))
        else:
            found = [
                self.proposer(r.all_token_ids, cap) if cap else ([], 0)
                for r, cap in zip(requests, caps)
            ]
            for draft, (_, n) in zip(drafts, found):
                draft.weak = 0 < n < STRONG_NGRAM
            lengths = self._plan(rows, [len(tokens) for tokens, _ in found], drafts, budget)
            proposals = [tokens[:k] for (tokens, _), k in zip(found, lengths)]
        return [_grammar_allows(r, p) for r, p in zip(requests, proposals)]

    def _plan(self, rows: int, caps: list[int], drafts: list[Draft], budget: int) -> list[int]:
        acceptance = [d.acceptance for d in drafts]
        return self.cost.plan(rows, caps, acceptance, budget, [d.free for d in drafts])

    def release(self, req: Request) -> None:
        """A request ended: the draft model's blocks for it go back."""
        if self.draft_model is not None:
            self.draft_model.release(req)

    def _most_for(self, req: Request) -> int:
        """The most tokens ``req`` may propose now (0 while it backs off after misses)."""
        left = min(
            req.sampling.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        if left <= 0 or req.pooling is not None:
            return 0
        return min(req.sampling.draft.next_length(self.most), left)

    def verify(self, logits: torch.Tensor, requests: list[Request], take: TakeSamples) -> None:
        """Sample each request's rows in rounds (see the module's docstring); ``take`` appends
        a round's tokens (or fails its rows) as the engine does for any step."""
        starts, row = [], 0
        for req in requests:
            starts.append(row)
            row += 1 + len(req.sampling.draft.token_ids)
        ahead = _sample_ahead(logits, requests, starts)
        live, j = list(range(len(requests))), 0
        accepted = [0] * len(requests)
        while live:
            reqs = [requests[i] for i in live]
            later = [i for i in live if (i, j) not in ahead]
            if later:
                drawn = sample(logits[[starts[i] + j for i in later]], [requests[i] for i in later])
                ahead |= {(i, j): _pick(drawn, n) for n, i in enumerate(later)}
            picks = [ahead[i, j] for i in live]
            out = SamplerOutput(*(list(field) for field in zip(*picks)))
            take(reqs, out)
            agreeing = []
            for i, token in zip(live, out.token_ids):
                req = requests[i]
                if (
                    j < len(req.sampling.draft.token_ids)
                    and token == req.sampling.draft.token_ids[j]
                ):
                    accepted[i] += 1
                    if not req.status.finished:
                        req.num_computed_tokens += 1  # the proposed token's K/V is its own now
                        agreeing.append(i)
            live, j = agreeing, j + 1
        for req, n in zip(requests, accepted):
            self._settle(req, n)

    def _settle(self, req: Request, accepted: int) -> None:
        """Count a verified proposal, adapt the request's next one, give back the blocks past
        its tokens (they held only rejected positions) and drop the proposal."""
        proposed = len(req.sampling.draft.token_ids)
        if not proposed:
            return
        t = self.totals
        t.spec_drafts += 1
        t.spec_draft_tokens += proposed
        t.spec_accepted_tokens += accepted
        for pos in range(accepted):
            t.spec_accepted_per_position[pos] += 1
        req.sampling.draft.record(proposed, accepted, self.most)
        req.sampling.draft.token_ids = []
        if not req.status.finished:
            self.kv.trim(req)


Pick = tuple[int | None, TokenLogprob | None, RowError | None]


def _pick(out: SamplerOutput, row: int) -> Pick:
    return out.token_ids[row], out.logprobs[row], out.errors[row]


def _sample_ahead(
    logits: torch.Tensor, requests: list[Request], starts: list[int]
) -> dict[tuple[int, int], Pick]:
    """Every row of the proposing requests whose draws are ``stateless``, sampled in one pass
    (a round each costs a sampler call: ~0.18 ms a round, up to five rounds a step), by
    (request, row): the same tokens the rounds would draw, as nothing a row's draw reads
    changes between rounds."""
    rows = [
        (i, j)
        for i, req in enumerate(requests)
        if req.sampling.draft.token_ids and stateless(req)
        for j in range(1 + len(req.sampling.draft.token_ids))
    ]
    if not rows:
        return {}
    out = sample(logits[[starts[i] + j for i, j in rows]], [requests[i] for i, _ in rows])
    return {row: _pick(out, n) for n, row in enumerate(rows)}


def _grammar_allows(req: Request, tokens: list[int]) -> list[int]:
    """The longest start of ``tokens`` the request's grammar accepts from where it stands
    (its matcher is rolled back after the check): a proposal the grammar forbids is never
    computed."""
    grammar = req.sampling.grammar
    if grammar is None or not grammar.active or not tokens:
        return tokens
    n = 0
    for token in tokens:
        if not grammar.matcher.accept_token(token):
            break
        n += 1
    if n:
        grammar.matcher.rollback(n)
    return tokens[:n]
