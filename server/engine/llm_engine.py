"""The engine: owns the model, the KV cache, the scheduler; advances every request one step at a time.

One thread drives it (``step``); the API layer feeds it through ``add_request`` and
``abort_request`` between steps. Nothing here does I/O beyond loading the model.
"""
from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import select_backend
from .config import ConfigError, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import KVCache
from .kv_cache_manager import KVCacheManager, KVCacheStats
from .loader import load_model, resolve_dtype
from .model_runner import ModelRunner
from .models.config import ModelConfig
from .outputs import CompletionOutput, RequestOutput
from .request import Request, RequestStatus
from .sampler import sample
from .sampling_params import InvalidParamError, SamplingParams
from .scheduler import Scheduler
from .sessions import SessionStore
from .stopping import find_stop_string, held_back, stop_by_token


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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_dir(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.model = load_model(config.model, self.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.eos_token_ids = frozenset(eos_token_ids(config.model, self.model_config, self.tokenizer))
        num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCache(self.model_config, num_blocks, config.block_size, self.dtype, self.device)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, (num_blocks - 1) * config.block_size)
        backend = select_backend(config.attention_backend, self.kv_cache, self.model_config.head_dim ** -0.5)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, backend, config.block_size, self.device)
        self.sessions = SessionStore(self.kv)
        self._sleep_level = 0
        self._groups: dict[str, list[Request]] = {}
        self._arrival = itertools.count()
        self._rng = random.Random(config.seed)
        self._num_preemptions = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    # ----- sizing -------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            return -(-cfg.kv_cache_tokens // cfg.block_size) + 1
        per_block = KVCache.bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_utilization)
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(int(available * cfg.gpu_memory_utilization), cfg.max_kv_cache_bytes)
        blocks = budget // per_block
        if blocks < 2:
            raise ConfigError(f"no memory left for the KV cache ({budget} bytes, {per_block} per block)")
        return blocks

    # ----- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *, stream: bool = False, session_id: str | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidParamError on bad input.

        ``step`` reports a streamed request after every token, any other only when it finishes.

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
            raise InvalidParamError("session_id", f"session {session_id!r} already has a request in flight")
        prompt_ids = self.tokenize(prompt)
        max_tokens = self._check_lengths(prompt_ids, params)
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
                generator=self._generator(params.seed, i),
                detokenizer=(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                             if stream or params.stop else None),
            )
            group.append(req)
        group[0].pending_siblings = group[1:]
        if session_id is not None:
            group[0].session_id = session_id
            self.sessions.attach(session_id, group[0])
        self._groups[request_id] = group
        self.scheduler.add(group[0])
        self._num_prompt_tokens += len(prompt_ids)
        return prompt_ids

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not prompt_ids:
            raise InvalidParamError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParamError("prompt", f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        if params.n > self.config.max_num_seqs:
            raise InvalidParamError("n", f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise PromptTooLongError("prompt", f"This model's maximum context length is {limit} tokens; the prompt "
                                     f"has {len(prompt_ids)} tokens, leaving no room to generate.")
        if params.max_tokens is None:
            return limit - len(prompt_ids)
        if len(prompt_ids) + params.max_tokens > limit:
            raise PromptTooLongError("max_tokens", f"This model's maximum context length is {limit} tokens. "
                                     f"However, you requested {len(prompt_ids) + params.max_tokens} tokens "
                                     f"({len(prompt_ids)} in the prompt, {params.max_tokens} in the completion).")
        return params.max_tokens

    def _generator(self, seed: int | None, index: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed + index if seed is not None else self._rng.getrandbits(63))
        return g

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks now; False if it is unknown or done."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for req in group:
            if not req.status.finished:
                if req.session_id is not None:
                    self.sessions.detach(req.session_id, req, keep_blocks=False)
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ----- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self._num_preemptions += len(batch.preempted)
        if not batch.requests:
            return []
        logits, sampling = self.runner.execute(batch)
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
        return [o for gid in report if (o := self._group_output(gid)) is not None]

    def _append(self, req: Request, token: int, logprob: object) -> None:
        if req.pending_siblings:
            self._fork_siblings(req)
        req.output_token_ids.append(token)
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
                    req.stop_text_end = idx + len(stop) if req.params.include_stop_str_in_output else idx
                    status, reason = RequestStatus.FINISHED_STOPPED, stop
        if status is not None:
            req.stop_reason = reason
            if detok is not None and req.stop_text_end is None:
                detok.finish()
            if req.session_id is not None:
                self.sessions.detach(req.session_id, req, keep_blocks=True)
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
            return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
        if req.stop_text_end is not None:
            return detok.text[:req.stop_text_end]
        if req.status.finished:
            return detok.text
        return detok.text[:max(0, len(detok.text) - held_back(req.params.stop))]

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
            raise EngineBusyError(f"{len(self._groups)} requests are in flight; abort them before sleeping")
        self.sessions.clear()
        self.kv.pool.reset_prefix_cache()
        self.kv_cache.release()
        if level == 2:
            self.model.to_empty(device=torch.device("meta"))
        elif self.device.type == "cuda":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._sleep_level = level

    def wake_up(self) -> None:
        if not self._sleep_level:
            return
        if self._sleep_level == 2:
            self.model = load_model(self.config.model, self.dtype, self.device)
            self.runner.model = self.model
        elif self.device.type == "cuda":
            self.model.to(self.device)
        self.kv_cache.restore(self.model_config)
        self._sleep_level = 0

    # ----- introspection ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv=self.kv.stats(),
            num_preemptions=self._num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
