"""The offline API, shaped like vLLM's ``LLM``: build once, ``generate`` many prompts in one batch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .pooling import PoolingParams
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        if model is None:
            from .tiny_model import default_model_dir

            model = str(default_model_dir())
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        fields = {k: v for k, v in vars(config).items() if k != "model"}
        return cls(config.model, **fields)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        A prompt is a string or a list of token ids; a flat list of ints is one prompt.
        ``lora`` names the adapter of every prompt, or of each (None: the base model).
        """
        batch = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling params")
        loras = [lora] * len(batch) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(loras)} adapters")
        ids = []
        for prompt, p, name in zip(batch, params_list, loras):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, lora=name)
            ids.append(rid)
        return self._run(ids)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[list[float]]:
        """One vector per prompt (``pooling`` defaults to the engine's ``--pooling``, normalised)."""
        pooling = pooling or PoolingParams()
        ids = []
        for prompt in _as_prompt_list(prompts):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, SamplingParams(), pooling=pooling)
            ids.append(rid)
        return [out.embedding for out in self._run(ids)]

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        **template_kwargs: object,
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return self.generate(prompt, sampling_params)[0]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return items
