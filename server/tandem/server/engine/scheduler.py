"""Continuous batching: which requests compute how many tokens in the next step.

Each step has a token budget. Running requests go first, decodes before unfinished
(chunked) prefills; then waiting requests are admitted in arrival order while the budget,
``max_num_seqs`` and the free blocks allow. A prompt longer than what is left of the budget is
split into chunks across steps. When a running request cannot grow, the newest running
requests are preempted (their blocks freed, recomputed later, mostly from the prefix cache).
With speculative decoding, a decoding request may also compute the tokens its ``propose``
hook guesses follow (``Request.sampling.draft``), when the budget and free blocks allow: never at the
cost of a preemption.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Whether a waiting request may join the running ones (multi-LoRA: at most max_loras
        # adapters at once); one that may not is skipped and keeps its place in the queue.
        self.admissible: Callable[[Request, list[Request]], bool] | None = None
        # Speculative decoding's hook: the tokens to verify after each decoding request's last
        # one, given them, the step's rows so far and the budget left (at most that many in
        # all; spec_decode/speculator.py); None decodes one a step.
        self.propose: Callable[[list[Request], int, int], list[list[int]]] | None = None
        # Called with each request that ends (a draft model frees its own blocks for it).
        self.on_finish: Callable[[Request], None] | None = None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        decodes_first = sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1)
        decoding: list[int] = []  # batch positions of one-token decodes (may speculate)
        for req in decodes_first:
            req.sampling.draft.token_ids = []
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_uncomputed_tokens, budget)
            if self._grow_or_preempt(req, n, batch):
                if n == 1 and req.num_uncomputed_tokens == 1:
                    decoding.append(len(batch.requests))
                self._take(batch, req, n)
                budget -= n
        return self._speculate(batch, decoding, budget)

    def _speculate(self, batch: ScheduledBatch, decoding: list[int], budget: int) -> int:
        """Give the decoding requests their proposals, the step's rows all known (the hook
        weighs them against what they add), where free blocks allow; returns the budget left."""
        if self.propose is None or not decoding or budget == 0:
            return budget
        reqs = [batch.requests[i] for i in decoding]
        for i, req, draft in zip(decoding, reqs, self.propose(reqs, batch.total_tokens, budget)):
            more = self.kv.blocks_for(req.num_computed_tokens + 1 + len(draft)) - len(req.block_ids)
            # Free blocks only: a guess never makes sessions give theirs back (kv.reclaim).
            if (
                not draft
                or more > self.kv.pool.num_free
                or not self.kv.allocate(req, 1 + len(draft))
            ):
                continue
            req.sampling.draft.token_ids = draft
            batch.num_new_tokens[i] += len(draft)
            budget -= len(draft)
        return budget

    def _grow_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        while not self.kv.allocate(req, n):
            victim = self._newest_unscheduled(batch, exclude=req) or req
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _newest_unscheduled(self, batch: ScheduledBatch, exclude: Request) -> Request | None:
        scheduled = {id(r) for r in batch.requests}
        candidates = [r for r in self.running if r is not exclude and id(r) not in scheduled]
        return max(candidates, key=lambda r: r.arrival_order, default=None)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        skipped: list[Request] = []
        try:
            self._admit_in_order(batch, budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_in_order(self, batch: ScheduledBatch, budget: int, skipped: list[Request]) -> None:
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self.admissible is not None and not self.admissible(req, self.running):
                skipped.append(self.waiting.popleft())
                continue
            if len(self.running) + 1 + len(req.pending_siblings) > self.max_num_seqs:
                break
            # A request that already holds blocks (a session's turn) starts after them; one
            # pooling every row's hidden state, or reading its prompt's logprobs, computes
            # them all (a cached block has K/V, not logits or hidden states).
            whole = (
                req.block_ids
                or (req.pooling is not None and req.pooling.params.reads_every_row)
                or req.output.prompt_logprobs is not None
            )
            prefix = None if whole else self.kv.find_cached_prefix(req)
            start = (
                len(prefix.block_ids) * self.kv.block_size if prefix else req.num_computed_tokens
            )
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req, n, prefix):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._take(batch, req, n)
            budget -= n

    def _take(self, batch: ScheduledBatch, req: Request, n: int) -> None:
        """Schedule ``n`` tokens of ``req`` and publish the blocks they will fill, so a request
        admitted after it in this very step can hit them (see ``cache_full_blocks``)."""
        batch.add(req, n)
        # Only verified tokens are published: never a proposal's (Request.sampling.draft).
        self.kv.cache_full_blocks(req, min(req.num_computed_tokens + n, req.num_tokens))

    def update(self, batch: ScheduledBatch) -> None:
        """After the model ran: the scheduled tokens are computed (a proposal's only once
        it is verified: ``Speculator.verify``)."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n - len(req.sampling.draft.token_ids)

    def fork_siblings(self, leader: Request) -> None:
        """Siblings of an n > 1 request join the running set sharing the leader's full prompt
        blocks (called when the leader samples its first token)."""
        shared = (leader.num_prompt_tokens - 1) // self.kv.block_size
        for sib in leader.pending_siblings:
            self.kv.fork(leader, sib, shared)
            sib.status = RequestStatus.RUNNING
            self.running.append(sib)
        leader.pending_siblings = []

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request wherever it is and free its blocks at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        for sibling in req.pending_siblings:
            sibling.status = status
        req.pending_siblings = []
        if self.on_finish is not None:
            self.on_finish(req)
