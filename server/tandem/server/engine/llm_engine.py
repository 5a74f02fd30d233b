"""The engine: owns the model, the KV cache, the scheduler; advances every request one step at a time.

One thread drives it (``step``); the API layer feeds it through ``add_request`` and
``abort_request`` between steps. Nothing here does I/O beyond loading the model.

A host (the server's engine loop, its routes, the P/D transport) uses only ``LLMEngine``'s
own methods and properties, never its parts (scheduler, sessions, handoff): the section "the
host's face" below is everything else it may read or call, as vLLM's ``SchedulerInterface`` is
for its engine core, so the parts can change without touching the server.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from concurrent.futures import Future
from functools import partial

import torch

from .compiling import CompilingGroups
from .config import EngineConfig
from .input_processor import InputProcessor
from .kv_cache_manager import KVCacheManager
from .kv_handoff import KVHandoff
from .kv_transfer import KVLayout, PullTask
from .limits import max_model_len
from .loader import read_model_config
from .lora.adapter import LoraAdapter, LoraLoadError
from .lora.registry import LoraRegistry, adapter_names
from .memory import DeviceMemory
from .output_processor import add_text, finish_text, group_output
from .outputs import RequestOutput
from .pooling import PoolingParams, fold_hidden_rows
from .request import Request, RequestStatus, TokenLogprob
from .sampler import RowError, SamplerOutput, sample
from .sampling_params import InvalidParamError, SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sessions import SessionStore
from .spec_decode.cost import step_cost
from .spec_decode.draft_model import DraftModel
from .spec_decode.speculator import Speculator
from .stats import EngineStats, Totals
from .stopping import check_stop
from .structured import GrammarCache
from .weights import WeightsIdentity
from .worker import Worker


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = read_model_config(config.model)
        self.worker = Worker(config, self.model_config)
        self.device, self.kv_cache = self.worker.runner.device, self.worker.runner.kv_cache
        num_blocks = self.worker.runner.num_blocks
        self.max_model_len = max_model_len(config, self.model_config, num_blocks)
        self.inputs = InputProcessor(
            config, self.model_config, self.max_model_len, self.worker.new_generator
        )
        self.tokenizer, self.eos_token_ids = self.inputs.tokenizer, self.inputs.eos_token_ids
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sessions = SessionStore(
            self.kv,
            int(config.session_kv_fraction * num_blocks),
            max_per_key=config.max_sessions_per_key,
        )
        self.kv.reclaim = self.sessions.reclaim
        layout = KVLayout.of(self.model_config, config.block_size, self.worker.runner.dtype)
        self.handoff = KVHandoff(config, self.kv, self.scheduler, layout)
        self.grammars = GrammarCache(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        self._compiling = CompilingGroups(self.grammars)
        self._ready_outputs: list[RequestOutput] = []  # produced between steps
        self.memory = DeviceMemory(
            self.worker, self.kv, self.sessions, self.handoff, self.model_config, str(config.model)
        )
        self._groups: dict[str, list[Request]] = {}
        self.totals = Totals()
        self.loras = self._lora_registry()
        self.speculator: Speculator | None = None
        if config.speculative_method is not None:
            self.speculator = self._speculator()

    def _speculator(self) -> Speculator:
        """Speculative decoding's proposer and verifier, hooked into the scheduler."""
        draft, cost = None, step_cost(self.worker.runner.model, self.worker.step_curve)
        if self.config.speculative_method == "draft":
            draft = DraftModel(self.config, self.model_config, self.device)
            cost = dataclasses.replace(cost, pass_cost=draft.pass_cost)
        spec = Speculator(
            self.config.num_speculative_tokens,
            self.kv,
            self.max_model_len,
            self.totals,
            cost,
            draft,
        )
        self.scheduler.propose, self.scheduler.on_finish = spec.propose, spec.release
        return spec

    def _lora_registry(self) -> LoraRegistry | None:
        """Multi-LoRA (``lora/``): the adapters named at the start, checked before serving."""
        if not self.config.lora_enabled:
            return None
        cfg = self.config
        loras = LoraRegistry(
            self.model_config, cfg.max_loras, cfg.max_lora_rank, self.worker.load_lora
        )
        for name, path in cfg.lora_paths.items():
            loras.add(loras.read(name, path))
        self.scheduler.admissible = loras.admissible
        return loras

    # ----- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        session_id: str | None = None,
        kv_transfer: dict | None = None,
        pooling: PoolingParams | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidParamError on bad input.

        ``step`` reports a streamed request as deltas when its text grows, any other (whole)
        only when it finishes. ``kv_transfer`` carries the P/D handoff (see ``KVHandoff``):
        ``{"do_remote_decode": true}`` makes this a prefill (one token, blocks kept under a
        lease); a ``do_remote_prefill`` handle, a decode that pulls its prompt's K/V. With
        ``session_id`` the request continues that session: it reuses the session's KV blocks
        for the prompt prefix they hold, and leaves its own blocks there when done.
        With ``pooling`` the request is prefill-only (an embedding): it ends when the prompt
        is computed, its output carries the vector and its blocks go back to the pool.
        ``tenant`` (the caller's key) and ``cache_salt`` name its prefix-cache partition: it
        hits only blocks cached under the same ones (``InputProcessor.cache_partition``).
        ``lora`` names the adapter it runs through (``load_lora``; None: the base model).
        """
        self.memory.check_awake()
        adapter = self._adapter(lora)
        self.handoff.check_lora(kv_transfer, lora)
        if request_id in self._groups:
            raise InvalidParamError("request_id", f"request id {request_id!r} is already in use")
        with self.inputs.cache_partition(tenant, cache_salt, adapter):
            if pooling is not None:
                return self._add_pooled(request_id, prompt, params, pooling)
            return self._add_group(request_id, prompt, params, stream, session_id, kv_transfer)

    def _add_group(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool,
        session_id: str | None,
        kv_transfer: dict | None,
    ) -> list[int]:
        """A generating request's ``params.n`` sequences, queued (or held for a grammar, or
        for a KV pull)."""
        if session_id is not None:
            self.sessions.check_can_attach(session_id, params.n)
        prompt_ids = self.inputs.prompt_ids(prompt)
        params, handoff = self.handoff.parse(kv_transfer, params, session_id, len(prompt_ids))
        if handoff is not None and handoff.remote_prefill and params.prompt_logprobs is not None:
            raise InvalidParamError(
                "prompt_logprobs",
                "a decode engine pulls its prompt's KV and has no prompt logits: ask the "
                "engine that computes the prompt (without kv_transfer_params)",
            )
        group = self.inputs.group(request_id, prompt_ids, params, stream)
        group[0].handoff = handoff
        grammar = self._compiling.submit(params.structured)
        if session_id is not None:
            group[0].session_id = session_id
            self.sessions.attach(session_id, group[0])
        self._groups[request_id] = group
        if grammar is not None and not grammar.done():
            self._compiling.hold(group, grammar)
        else:
            self._enqueue(group, grammar)
        self.totals.prompt_tokens += len(prompt_ids)
        return prompt_ids

    def _add_pooled(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        pooling: PoolingParams,
    ) -> list[int]:
        req = self.inputs.pooled(request_id, self.inputs.prompt_ids(prompt), params, pooling)
        self._groups[request_id] = [req]
        self.scheduler.add(req)
        self.totals.prompt_tokens += req.num_prompt_tokens
        return req.prompt_token_ids

    def _enqueue(self, group: list[Request], grammar: Future | None) -> None:
        """Hand a group to the scheduler (or to the KV pull), each sequence with its own matcher."""
        if grammar is not None:
            self._compiling.bind(group, grammar)
        req = group[0]
        remote = req.handoff.remote_prefill if req.handoff is not None else None
        if remote is None:
            self.scheduler.add(req)
            return
        if not req.params.greedy:  # keep a seeded generator where an aggregated run would be
            self.worker.skip_draw(req.sampling.generator)
        # The prefill engine sampled the first token (under the same grammar): take it as ours.
        if not self._append(req, remote.first_token_ids[0], None):
            self.handoff.wait_for_blocks(req)
            return
        self.handoff.release_unpulled(req)  # that token ended it: nothing to pull
        self._report_between_steps(req.group_id)

    def _admit_compiled(self) -> None:
        """Groups whose grammar finished compiling join the queue; a failed one ends with its error."""
        for c in self._compiling.take_done():
            if c.grammar.exception() is None:
                self._enqueue(c.group, c.grammar)
                continue
            c.fail()
            if c.group[0].session_id is not None:
                self.sessions.detach(c.group[0].session_id, c.group[0], keep_blocks=False)
            self._report_between_steps(c.group[0].group_id)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks now; False if it is unknown or done."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        self._compiling.drop(group)
        for req in group:
            if not req.status.finished:
                self._stop(req, RequestStatus.FINISHED_ABORTED)
        return True

    def _stop(self, req: Request, status: RequestStatus) -> None:
        """End an unfinished request wherever it is (a pull, a session, the queue, the running
        set) and free its blocks now (a pull still writing frees them when it stops)."""
        if self.handoff.abort(req):
            return
        if req.session_id is not None:
            self.sessions.detach(req.session_id, req, keep_blocks=False)
        self.scheduler.finish(req, status)

    def _fail(self, req: Request, error: RowError) -> None:
        """``req`` could not go on (no token could be drawn for it): its group, which answers
        one API request, ends with ``error`` and frees its blocks; the rest of the batch is
        untouched, so one request's parameters or numerics never fail another's."""
        group = self._groups[req.group_id]
        group[0].output.error, group[0].output.error_code = error.message, error.code
        now = time.monotonic()
        for r in group:
            if not r.status.finished:
                r.times.finished = now
                self._stop(r, RequestStatus.FINISHED_ERROR)

    def partial_output(self, request_id: str) -> RequestOutput | None:
        """A non-streamed group's output as it stands (tokens and text so far), which an
        abort hands back as its answer; None if the id is unknown."""
        group = self._groups.get(request_id)
        return None if group is None else group_output(request_id, group, self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work; requests waiting on a KV pull are not work until it lands."""
        pending = len(self.scheduler) + len(self.handoff.waiting) + len(self._compiling)
        return bool(pending or self._ready_outputs)

    # ----- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.handoff.admit()
        self._admit_compiled()
        ready, self._ready_outputs = self._ready_outputs, []
        batch = self.scheduler.schedule()
        self.totals.preemptions += len(batch.preempted)
        if not batch.requests:
            return ready
        try:
            logits, hidden, sampling = self._execute(batch)
        except BaseException:
            self.kv.pool.reset_prefix_cache()  # blocks published for this step were never written
            raise
        self.scheduler.update(batch)
        report = dict.fromkeys(self._pool(batch, hidden))
        if self.speculator is not None and any(r.sampling.draft.token_ids for r in sampling):
            self.speculator.verify(logits, sampling, partial(self._take_samples, report=report))
        elif sampling:
            self._take_samples(sampling, sample(logits, sampling), report)
        return ready + [o for gid in report if (o := self._group_output(gid)) is not None]

    def _execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[Request]]:
        """Run the step on the device, through each request's LoRA adapter when it has one."""
        if self.loras is None:
            return self.worker.execute(batch)
        return self.worker.execute(batch, self.loras.activate(batch.requests))

    def _take_samples(
        self, sampling: list[Request], out: SamplerOutput, report: dict[str, None]
    ) -> None:
        """Append each row's token, or fail the request whose row had none; note the groups
        to report."""
        for req, token, lp, error in zip(sampling, out.token_ids, out.logprobs, out.errors):
            if req.status.finished:  # its group failed on an earlier row of this step
                continue
            if error is None:
                self.totals.generated_tokens += 1
                self._append(req, token, lp)
            else:
                self._fail(req, error)
            if req.output.stream or req.status.finished:
                report[req.group_id] = None

    def _pool(self, batch: ScheduledBatch, hidden: torch.Tensor) -> list[str]:
        """Pooled requests whose prompt is now computed finish with their vector."""
        done = fold_hidden_rows(batch.requests, batch.num_new_tokens, hidden)
        for req in done:
            req.times.finished = time.monotonic()
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return [req.group_id for req in done]

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None) -> bool:
        """Add a sampled token; finish ``req`` if it ends it, and say whether it did."""
        if req.pending_siblings:
            self.scheduler.fork_siblings(req)
        req.output_token_ids.append(token)
        if req.sampling.grammar is not None:
            req.sampling.grammar.advance(req.output_token_ids)
        if req.times.first_token is None:
            req.times.first_token = time.monotonic()
        if logprob is not None:
            req.output.logprobs.append(logprob)
        stop = check_stop(req, token, add_text(req, token), self.max_model_len)
        if stop is None:
            return False
        req.output.stop_reason, req.output.stop_text_end = stop.reason, stop.text_end
        finish_text(req)
        if req.session_id is not None:
            self.sessions.detach(req.session_id, req, keep_blocks=True)
        if req.handoff is not None and req.handoff.remote_decode:
            self.handoff.grant_lease(req)
        req.times.finished = time.monotonic()
        self.scheduler.finish(req, stop.status)
        return True

    def _group_output(self, group_id: str) -> RequestOutput | None:
        group = self._groups.get(group_id)
        if group is None:
            return None
        if all(r.status.finished for r in group):
            del self._groups[group_id]
        return group_output(group_id, group, self.tokenizer)

    def _report_between_steps(self, group_id: str) -> None:
        """A group that changed outside ``step`` is reported by the next one."""
        if (out := self._group_output(group_id)) is not None:
            self._ready_outputs.append(out)

    # ----- the host's face: prefill/decode disaggregation ----------------------------------
    def take_pull_tasks(self) -> list[PullTask]:
        """The KV pulls the host must run off the engine thread, each reported back with
        ``complete_pull``."""
        return self.handoff.take_pull_tasks()

    def complete_pull(self, request_id: str, error: str | None = None) -> None:
        """The host reports a pull from ``take_pull_tasks`` done (or failed)."""
        req = self.handoff.complete_pull(request_id, error)
        if req is not None:
            self._report_between_steps(req.group_id)

    def sweep_leases(self) -> int:
        """Free the leases released or expired by now; returns how many ended. The host calls
        it once per loop (``step`` does not), and again when asked to (``/distserve/gc``)."""
        return self.handoff.leases.sweep()

    def next_lease_expiry(self) -> float | None:
        """When the soonest lease expires (``time.monotonic``): an idle host sweeps then."""
        return self.handoff.leases.next_expiry()

    def leased_blocks(self, lease_id: str) -> list[int] | None:
        """Any thread (the transport's): the blocks a lease holds, None if it is gone."""
        return self.handoff.leases.blocks(lease_id)

    def release_lease(self, lease_id: str) -> bool:
        """Any thread: hand a lease's blocks back (freed at the next ``sweep_leases``)."""
        return self.handoff.release_lease(lease_id)

    @property
    def engine_id(self) -> str:
        """This engine's id in the handles it hands out and the pulls it runs."""
        return self.handoff.engine_id

    @property
    def kv_layout(self) -> KVLayout:
        """The KV cache's layout, which a peer must share to move blocks."""
        return self.handoff.layout

    @property
    def transport_address(self) -> str | None:
        """Where this engine's KV transport listens (None without one): the host sets it
        once the transport is up, and every handle a prefill hands out carries it."""
        return self.handoff.address

    @transport_address.setter
    def transport_address(self, address: str | None) -> None:
        self.handoff.address = address

    # ----- the host's face: queue and sessions ---------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (a host bounds it: the API's 429)."""
        return len(self.scheduler.waiting)

    def expire_sessions(self, ttl: float) -> int:
        """Forget sessions idle longer than ``ttl`` seconds; returns how many."""
        return self.sessions.expire(ttl)

    def delete_session(self, session_id: str) -> bool:
        """Forget a session and free its blocks now; False if there is none."""
        return self.sessions.delete(session_id)

    # ----- the host's face: LoRA adapters (docs/lora.md) ------------------------------------
    def _adapter(self, name: str | None) -> LoraAdapter | None:
        if name is None:
            return None
        adapter = self.loras.get(name) if self.loras is not None else None
        if adapter is None:
            raise InvalidParamError("model", f"no LoRA adapter named {name!r} is loaded")
        return adapter

    @property
    def served_loras(self) -> Mapping[str, str]:
        """The adapters served, name -> path (any thread: replaced whole on each change)."""
        return self.loras.served if self.loras is not None else {}

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter (any thread: it changes nothing); ``LoraLoadError``
        says what does not fit. ``add_lora`` then serves it."""
        if self.loras is None:
            raise LoraLoadError("LoRA is not enabled on this engine (--enable-lora)")
        return self.loras.read(name, path)

    def add_lora(self, adapter: LoraAdapter, replace: bool = False) -> None:
        """Serve ``adapter`` under its name (the engine thread); ``replace``: in place of the
        one served under it."""
        if self.loras is None:
            raise LoraLoadError("LoRA is not enabled on this engine (--enable-lora)")
        self.loras.add(adapter, replace)

    def remove_lora(self, name: str) -> bool:
        """Stop serving ``name``; its requests in flight finish through it."""
        return self.loras.remove(name) if self.loras is not None else False

    # ----- device memory (docs: engine/memory.py) -----------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.memory.level > 0

    @property
    def weights(self) -> WeightsIdentity:
        return self.memory.weights

    def sleep(self, level: int = 1) -> None:
        self.memory.sleep(level, len(self._groups))

    def wake_up(self) -> None:
        self.memory.wake_up()

    def update_weights(self, path: str, label: str | None = None) -> WeightsIdentity:
        return self.memory.update_weights(path, label, len(self._groups))

    def close(self) -> None:
        """Stop the device side (tensor-parallel ranks included); the engine is unusable after."""
        self.worker.close()
        self.grammars.close()

    def stats(self) -> EngineStats:
        stats = EngineStats.of(
            self.kv, self.scheduler, len(self.sessions), self.handoff, self.is_sleeping, self.totals
        )
        if self.loras is None:
            return stats
        return dataclasses.replace(
            stats,
            max_loras=self.loras.max_loras,
            running_loras=tuple(adapter_names(self.scheduler.running)),
            waiting_loras=tuple(adapter_names(self.scheduler.waiting)),
        )
