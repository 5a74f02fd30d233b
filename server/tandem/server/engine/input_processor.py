"""Turning what a client sent into the engine's requests: the prompt's token ids (the
processor owns the model's tokenizer and EOS ids), checked against the model's limits, and
one ``Request`` per choice, each with its own seeded generator and (where text is needed
while it runs) an incremental detokenizer.

The mirror of ``output_processor``: the engine's bookkeeping sees only ``Request`` objects.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import time
from collections.abc import Callable, Iterator

import torch

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, Tokenizer
from .limits import check_pooled, check_request
from .lora.adapter import LoraAdapter
from .models.config import ModelConfig, eos_token_ids
from .pooling import PoolingParams, check_dimensions
from .prefix_cache import ROOT_HASH, salted_root
from .request import OutputState, Partition, PoolingState, Request, SamplingState, Timings
from .sampling_params import InvalidParamError, SamplingParams
from .tokenizer import load_tokenizer


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        new_generator: Callable[[int], torch.Generator],
    ) -> None:
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(eos_token_ids(config.model, model_config, self.tokenizer))
        self.model_config = model_config
        self.default_pooling = config.pooling
        self.vocab_size = model_config.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = max_model_len
        self.new_generator = new_generator
        self._rng = random.Random(config.seed)
        self._arrival = itertools.count()
        self.prefix_cache_scope = config.prefix_cache_scope
        self._cache_root = ROOT_HASH
        self._lora: LoraAdapter | None = None

    @contextlib.contextmanager
    def cache_partition(
        self, tenant: str | None, cache_salt: str | None, lora: LoraAdapter | None = None
    ) -> Iterator[None]:
        """Requests made inside hit only prefix-cache blocks of the same partition: the
        client key (``tenant``, unless ``prefix_cache_scope`` is ``global``), the request's
        ``cache_salt`` and its LoRA adapter (``lora``, which they also run through: KV
        computed through one adapter is another's wrong KV), so ``cached_tokens`` never
        reveals another tenant's prompt. Requests with none share one partition. The
        server's loop wraps each add in it."""
        if self.prefix_cache_scope == "global":
            tenant = None
        parts: list[str | None] = [tenant, cache_salt] + ([lora.identity] if lora else [])
        self._cache_root = salted_root(None if parts == [None, None] else json.dumps(parts))
        self._lora = lora
        try:
            yield
        finally:
            self._cache_root, self._lora = ROOT_HASH, None

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)

    def group(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: bool
    ) -> list[Request]:
        """The ``params.n`` sequences of one request; raises InvalidParamError if it cannot run.

        The first sequence leads: the others wait in its ``pending_siblings`` until its
        prompt is computed, then share its prompt blocks.
        """
        max_tokens = check_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        group = [
            self._request(request_id, i, prompt_ids, params, max_tokens, stream)
            for i in range(params.n)
        ]
        group[0].pending_siblings = group[1:]
        if params.prompt_logprobs is not None:  # the leader computes the prompt for all
            group[0].output.prompt_logprobs = [None] * len(prompt_ids)
        return group

    def pooled(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, pooling: PoolingParams
    ) -> Request:
        """A prefill-only request (an embedding); ``params`` only needs to be valid."""
        check_pooled(prompt_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if (why := check_dimensions(pooling.dimensions, self.model_config)) is not None:
            raise InvalidParamError("dimensions", why)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            sampling=SamplingState(max_tokens=0, eos_token_ids=self.eos_token_ids),
            arrival_order=next(self._arrival),
            group_id=request_id,
            times=Timings(arrival=time.monotonic()),
            pooling=PoolingState(pooling.resolve(self.default_pooling)),
            partition=Partition(self._cache_root, self._lora),
        )

    def _request(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        stream: bool,
    ) -> Request:
        seed = params.seed + index if params.seed is not None else self._rng.getrandbits(63)
        detokenizer = (
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            if stream or params.stop
            else None
        )
        return Request(
            request_id=request_id if params.n == 1 else f"{request_id}-{index}",
            prompt_token_ids=prompt_ids,
            params=params,
            sampling=SamplingState(max_tokens, self.eos_token_ids, self.new_generator(seed)),
            arrival_order=next(self._arrival),
            group_id=request_id,
            output=OutputState(index=index, stream=stream, detokenizer=detokenizer),
            times=Timings(arrival=time.monotonic()),
            partition=Partition(self._cache_root, self._lora),
        )
