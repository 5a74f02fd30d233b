"""The engine: owns the model, the KV cache, the scheduler; advances every request one step at a time.

One thread drives it (``step``); the API layer feeds it through ``add_request`` and
``abort_request`` between steps. Nothing here does I/O beyond loading the model.
"""

from __future__ import annotations

import itertools
import json
import random
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ..disagg.kv_transfer import KVLayout, PullTask, RemotePrefill, handoff_params
from ..disagg.leases import LeaseStore
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import KVCache
from .kv_cache_manager import KVCacheManager, KVCacheStats
from .models.config import ModelConfig
from .outputs import CompletionOutput, RequestOutput
from .request import Request, RequestStatus
from .sampler import sample
from .sampling_params import InvalidParamError, SamplingParams
from .scheduler import Scheduler
from .sessions import SessionStore
from .stopping import find_stop_string, held_back, stop_by_token
from .structured import GrammarCache
from .worker import Worker


class PromptTooLongError(InvalidParamError):
    """The prompt (plus max_tokens) does not fit the model's context: the API's 413/400."""


class EngineSleepingError(RuntimeError):
    """The engine's memory is released (sleep mode): the API's 503."""


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine was asked for while requests are in flight."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv: KVCacheStats
    num_preemptions: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_leases: int = 0
    num_pulling: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.worker = Worker(config, self.model_config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.eos_token_ids = frozenset(
            eos_token_ids(config.model, self.model_config, self.tokenizer)
        )
        num_blocks = self.worker.num_blocks
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            (num_blocks - 1) * config.block_size,
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sessions = SessionStore(self.kv, int(config.session_kv_fraction * num_blocks))
        self.kv.reclaim = self.sessions.reclaim
        self.grammars = GrammarCache(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        # groups whose grammar is still compiling, with their P/D handle (admitted when done)
        self._compiling: list[tuple[list[Request], RemotePrefill | None, Future]] = []
        self.engine_id = uuid.uuid4().hex[:12]
        self.kv_transfer_address: str | None = None  # set by the host once its transport listens
        self.leases = LeaseStore(self.kv.pool, config.kv_lease_seconds)
        self._remote_waiting: list[Request] = []  # decode side: waiting for blocks to pull into
        self._pulling: dict[str, Request] = {}
        self._pull_tasks: list[PullTask] = []
        self._ready_outputs: list[RequestOutput] = []  # produced between steps
        self._sleep_level = 0
        self._groups: dict[str, list[Request]] = {}
        self._arrival = itertools.count()
        self._rng = random.Random(config.seed)
        self._num_preemptions = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def kv_cache(self) -> KVCache:
        return self.worker.kv_cache

    # ----- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        session_id: str | None = None,
        kv_transfer: dict | None = None,
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidParamError on bad input.

        ``step`` reports a streamed request after every token, any other only when it finishes.
        ``kv_transfer`` carries the P/D handoff: ``{"do_remote_decode": true}`` makes this a
        prefill (one token, blocks kept under a lease); a ``do_remote_prefill`` handle makes it
        a decode whose prompt K/V is pulled from the prefill engine (see ``take_pull_tasks``).

        With ``session_id`` the request continues that session: it reuses the session's KV
        blocks for the prompt prefix they hold, and leaves its own blocks there when done.
        """
        if self._sleep_level:
            raise EngineSleepingError("the engine is asleep; POST /wakeup first")
        if request_id in self._groups:
            raise InvalidParamError("request_id", f"request id {request_id!r} is already in use")
        if session_id is not None and params.n != 1:
            raise InvalidParamError("n", "a request in a session takes n=1")
        if session_id is not None and self.sessions.is_busy(session_id):
            raise InvalidParamError(
                "session_id", f"session {session_id!r} already has a request in flight"
            )
        remote_decode = bool(kv_transfer and kv_transfer.get("do_remote_decode"))
        remote = (
            RemotePrefill.from_params(kv_transfer)
            if kv_transfer and kv_transfer.get("do_remote_prefill")
            else None
        )
        if (remote_decode or remote) and (params.n != 1 or session_id is not None):
            raise InvalidParamError(
                "kv_transfer_params", "a disaggregated request takes n=1 and no session"
            )
        if (remote_decode or remote) and self.config.tensor_parallel_size > 1:
            raise InvalidParamError(
                "kv_transfer_params",
                "KV transfer with tensor_parallel_size > 1 is not "
                "supported yet (each rank holds only its own KV heads)",
            )
        if remote_decode:
            params = params.clone(max_tokens=1, min_tokens=0)
        grammar = None if params.structured is None else self.grammars.submit(params.structured)
        if grammar is not None and grammar.done():
            grammar.result()  # a grammar that failed to compile is this request's 400
        prompt_ids = self.tokenize(prompt)
        max_tokens = self._check_lengths(prompt_ids, params)
        if remote is not None and remote.num_tokens != len(prompt_ids):
            raise InvalidParamError(
                "kv_transfer_params",
                f"the prefill engine computed {remote.num_tokens} prompt "
                f"tokens but this prompt has {len(prompt_ids)}: the engines tokenize differently",
            )
        group = []
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}-{i}",
                prompt_token_ids=prompt_ids,
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_order=next(self._arrival),
                group_id=request_id,
                index=i,
                stream=stream,
                arrival_time=time.monotonic(),
                generator=self._generator(params.seed, i),
                detokenizer=(
                    IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                    if stream or params.stop
                    else None
                ),
            )
            group.append(req)
        group[0].pending_siblings = group[1:]
        if session_id is not None:
            group[0].session_id = session_id
            self.sessions.attach(session_id, group[0])
        self._groups[request_id] = group
        group[0].remote_decode = remote_decode
        if grammar is not None and not grammar.done():
            self._compiling.append((group, remote, grammar))
        else:
            self._enqueue(group, remote, grammar)
        self._num_prompt_tokens += len(prompt_ids)
        return prompt_ids

    def _enqueue(
        self, group: list[Request], remote: RemotePrefill | None, grammar: Future | None
    ) -> None:
        """Hand a group to the scheduler (or to the KV pull), each sequence with its own matcher."""
        if grammar is not None:
            compiled = grammar.result()
            for req in group:
                req.grammar = self.grammars.sequence(compiled, req.params.structured)
        if remote is not None:
            self._start_remote_prefill(group[0], remote)
        else:
            self.scheduler.add(group[0])

    def _admit_compiled(self) -> None:
        """Groups whose grammar finished compiling join the queue; a failed one ends with its error."""
        still = []
        for group, remote, grammar in self._compiling:
            if not grammar.done():
                still.append((group, remote, grammar))
            elif grammar.exception() is not None:
                group[0].error = str(grammar.exception())
                for req in group:
                    req.status = RequestStatus.FINISHED_ABORTED
                    req.finished_time = time.monotonic()
                if group[0].session_id is not None:
                    self.sessions.detach(group[0].session_id, group[0], keep_blocks=False)
                if (out := self._group_output(group[0].group_id)) is not None:
                    self._ready_outputs.append(out)
            else:
                self._enqueue(group, remote, grammar)
        self._compiling = still

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not prompt_ids:
            raise InvalidParamError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParamError(
                "prompt", f"token id {bad[0]} is outside the vocabulary (size {vocab})"
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidParamError(
                "n", f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}"
            )
        limit = self.max_model_len
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

    def _generator(self, seed: int | None, index: int) -> torch.Generator:
        return self.worker.new_generator(
            seed + index if seed is not None else self._rng.getrandbits(63)
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks now; False if it is unknown or done."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        self._compiling = [c for c in self._compiling if c[0] is not group]
        for req in group:
            if req.status.finished:
                continue
            if req.pull_in_flight:  # the pull still writes into its blocks: freed when it completes
                req.status = RequestStatus.FINISHED_ABORTED
                continue
            if req in self._remote_waiting:
                self._remote_waiting.remove(req)
            if req.session_id is not None:
                self.sessions.detach(req.session_id, req, keep_blocks=False)
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work; requests waiting on a KV pull are not work until it lands."""
        return (
            len(self.scheduler) > 0
            or bool(self._remote_waiting)
            or bool(self._ready_outputs)
            or bool(self._compiling)
        )

    # ----- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.leases.sweep()
        self._admit_remote_prefills()
        self._admit_compiled()
        ready, self._ready_outputs = self._ready_outputs, []
        batch = self.scheduler.schedule()
        self._num_preemptions += len(batch.preempted)
        if not batch.requests:
            return ready
        logits, sampling = self.worker.execute(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
        report: dict[str, None] = {}
        if sampling:
            out = sample(logits, sampling)
            for req, token, lp in zip(sampling, out.token_ids, out.logprobs):
                self._append(req, token, lp)
                if req.stream or req.status.finished:
                    report[req.group_id] = None
        return ready + [o for gid in report if (o := self._group_output(gid)) is not None]

    def _append(self, req: Request, token: int, logprob: object) -> None:
        if req.pending_siblings:
            self._fork_siblings(req)
        req.output_token_ids.append(token)
        if req.grammar is not None:
            req.grammar.advance(req.output_token_ids)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if logprob is not None:
            req.logprobs.append(logprob)
        self._num_generated_tokens += 1
        status, reason = stop_by_token(req, token, self.max_model_len)
        detok = req.detokenizer
        if detok is not None:
            new_text = detok.add([token])
            stops = req.params.stop
            if stops and new_text and len(req.output_token_ids) >= req.params.min_tokens:
                found = find_stop_string(detok.text, len(new_text), stops)
                if found is not None:
                    idx, stop = found
                    req.stop_text_end = (
                        idx + len(stop) if req.params.include_stop_str_in_output else idx
                    )
                    status, reason = RequestStatus.FINISHED_STOPPED, stop
        if status is not None:
            req.stop_reason = reason
            if detok is not None and req.stop_text_end is None:
                detok.finish()
            if req.session_id is not None:
                self.sessions.detach(req.session_id, req, keep_blocks=True)
            if req.remote_decode:
                self._grant_lease(req)
            req.finished_time = time.monotonic()
            self.scheduler.finish(req, status)

    def _fork_siblings(self, leader: Request) -> None:
        """Siblings of an n > 1 request share the leader's full prompt blocks from here on."""
        shared = (leader.num_prompt_tokens - 1) // self.config.block_size
        for sib in leader.pending_siblings:
            self.kv.fork(leader, sib, shared)
            self.scheduler.add_running(sib)
        leader.pending_siblings = []

    def _group_output(self, group_id: str) -> RequestOutput | None:
        group = self._groups.get(group_id)
        if group is None:
            return None
        finished = all(r.status.finished for r in group)
        if finished:
            del self._groups[group_id]
        return RequestOutput(
            request_id=group_id,
            prompt_token_ids=group[0].prompt_token_ids,
            outputs=[self._completion(r) for r in group],
            finished=finished,
            num_cached_tokens=group[0].num_cached_tokens,
            metrics=_timings(group),
            kv_transfer_params=group[0].kv_transfer_params,
            error=group[0].error,
        )

    def _completion(self, req: Request) -> CompletionOutput:
        return CompletionOutput(
            index=req.index,
            text=self._text(req),
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        )

    def _text(self, req: Request) -> str:
        detok = req.detokenizer
        if detok is None:
            if not req.status.finished:
                return ""
            return self.tokenizer.decode(
                req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens
            )
        if req.stop_text_end is not None:
            return detok.text[: req.stop_text_end]
        if req.status.finished:
            return detok.text
        return detok.text[: max(0, len(detok.text) - held_back(req.params.stop))]

    # ----- prefill/decode disaggregation ---------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        cfg = self.model_config
        return KVLayout(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.config.block_size,
            str(self.worker.dtype).removeprefix("torch."),
        )

    def _grant_lease(self, req: Request) -> None:
        """Prefill side: the finished prompt's blocks stay held for the decode engine's pull."""
        lease_id = self.leases.grant(req.block_ids)
        req.kv_transfer_params = handoff_params(
            self.engine_id,
            req.block_ids,
            req.num_computed_tokens,
            lease_id,
            self.kv_transfer_address,
            req.output_token_ids[:1],
            self.config.kv_lease_seconds,
        )
        req.block_ids, req.block_hashes = [], []

    def _start_remote_prefill(self, req: Request, remote: RemotePrefill) -> None:
        """Decode side: the prefill engine already sampled the first token; take it as ours."""
        req.remote_prefill = remote
        token = remote.first_token_ids[0]
        req.output_token_ids.append(token)
        if req.grammar is not None:  # the prefill engine sampled it under the same grammar
            req.grammar.advance(req.output_token_ids)
        req.first_token_time = time.monotonic()
        if req.detokenizer is not None:
            req.detokenizer.add([token])
        if not req.params.greedy:  # keep a seeded generator where an aggregated run would be
            torch.empty(self.model_config.vocab_size, device=self.device).exponential_(
                generator=req.generator
            )
        self._remote_waiting.append(req)

    def _admit_remote_prefills(self) -> None:
        """Give waiting decode-side requests blocks (local prefix hits first) and queue their pulls."""
        still = []
        for req in self._remote_waiting:
            prefix = self.kv.find_cached_prefix(req)
            hit = len(prefix.block_ids)
            if not self.kv.allocate(req, req.num_prompt_tokens - hit * self.kv.block_size, prefix):
                still.append(req)
                continue
            remote = req.remote_prefill
            end = self.kv.blocks_for(req.num_prompt_tokens)
            self._pull_tasks.append(
                PullTask(
                    req.request_id,
                    remote.address,
                    remote.lease_id,
                    remote.engine_id,
                    remote.block_ids[hit:end],
                    req.block_ids[hit:end],
                )
            )
            req.pull_in_flight = True
            self._pulling[req.request_id] = req
        self._remote_waiting = still

    def take_pull_tasks(self) -> list[PullTask]:
        """The pulls the host must run (off the engine thread), then report with ``complete_pull``."""
        tasks, self._pull_tasks = self._pull_tasks, []
        return tasks

    def complete_pull(self, request_id: str, error: str | None = None) -> None:
        req = self._pulling.pop(request_id, None)
        if req is None:
            return
        req.pull_in_flight = False
        if req.status.finished:  # aborted while its blocks were being written
            self.kv.free(req)
            return
        if error is None:
            req.num_computed_tokens = req.num_prompt_tokens
            self.kv.cache_full_blocks(req)
            self.scheduler.add(req, front=True)
            return
        self.kv.free(req)
        if self.config.kv_pull_fallback == "recompute":
            req.num_computed_tokens = 0
            self.scheduler.add(req, front=True)
            return
        req.error = (
            f"KV transfer from prefill engine {req.remote_prefill.engine_id} failed: {error}"
        )
        req.status = RequestStatus.FINISHED_ABORTED
        req.finished_time = time.monotonic()
        if (out := self._group_output(req.group_id)) is not None:
            self._ready_outputs.append(out)

    def release_lease(self, lease_id: str) -> bool:
        """Any thread: hand a lease's blocks back (they are freed at the next step or sweep)."""
        return self.leases.ask_release(lease_id)

    def sweep_leases(self) -> int:
        return self.leases.sweep()

    # ----- sessions and sleep --------------------------------------------------------------
    def delete_session(self, session_id: str) -> bool:
        return self.sessions.delete(session_id)

    def expire_sessions(self, idle_seconds: float) -> int:
        return self.sessions.expire(idle_seconds)

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2; reloaded from disk on wake-up).

        On a GPU, level 1 parks the weights in host memory. Sessions and the prefix cache
        are dropped with the KV memory.
        """
        if level not in (1, 2):
            raise InvalidParamError("level", f"sleep level must be 1 or 2, got {level}")
        if self._sleep_level:
            return
        if self._groups:
            raise EngineBusyError(
                f"{len(self._groups)} requests are in flight; abort them before sleeping"
            )
        self.sessions.clear()
        self.leases.clear()
        self.kv.pool.reset_prefix_cache()
        self.worker.sleep(level)
        self._sleep_level = level

    def wake_up(self) -> None:
        if self._sleep_level:
            self.worker.wake_up(self._sleep_level)
            self._sleep_level = 0

    def close(self) -> None:
        """Stop the device side (tensor-parallel ranks included); the engine is unusable after."""
        self.worker.close()
        self.grammars.close()

    # ----- introspection ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv=self.kv.stats(),
            num_preemptions=self._num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_leases=len(self.leases),
            num_pulling=len(self._pulling),
        )


def _timings(group: list[Request]) -> dict[str, float]:
    """Monotonic timestamps of the group: arrival, first token, finish (when known)."""
    lead = group[0]
    out = {"arrival_time": lead.arrival_time}
    firsts = [r.first_token_time for r in group if r.first_token_time is not None]
    if firsts:
        out["first_token_time"] = min(firsts)
    if all(r.finished_time is not None for r in group):
        out["finished_time"] = max(r.finished_time for r in group)
    return out


def eos_token_ids(model_dir: str, cfg: ModelConfig, tokenizer: object) -> set[int]:
    """The ids that end generation: generation_config.json's, else config.json's, else the tokenizer's."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {eos}
    if cfg.eos_token_ids:
        return set(cfg.eos_token_ids)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return {eos_id} if eos_id is not None else set()
