"""The engine's one handle on the device(s): rank 0's ``ModelRunner`` and the other ranks.

The engine above it is pure bookkeeping (scheduler, blocks, requests); everything that
holds device memory or launches kernels lives in the runner, so tensor parallelism, CUDA
graphs and other backends change that module and below, never the scheduler.

With ``tensor_parallel_size > 1`` the worker starts the other ranks (``parallel.launch``),
sends each step's flattened inputs to them and runs its own runner on the same inputs; the
engine sees one device either way. On one CPU rank the thread count of each step is the
``ThreadTuner``'s (``threads.py``): measured, since other processes may share the cores.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import torch

from .config import EngineConfig
from .host_process import settle_cpu_process
from .lora.adapter import LoraAdapter
from .model_runner import ModelRunner, StepInputs, prepare_inputs
from .models.config import ModelConfig
from .parallel import SINGLE, rank_device
from .parallel.launch import RankGroup
from .prompt_logprobs import fold_prompt_logprobs, prompt_spans, span_rows
from .request import Request
from .sampler import draw_uniform
from .scheduler import ScheduledBatch
from .step_curve import StepCurve
from .threads import ThreadTuner


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.tensor_parallel_size = config.tensor_parallel_size
        self._ranks: RankGroup | None = None
        base_device = resolve_device(config.device)
        if config.tensor_parallel_size > 1:
            self._ranks = RankGroup.start(config, model_config, base_device)
        tp = self._ranks.tp if self._ranks is not None else SINGLE
        try:
            self.runner = ModelRunner(config, model_config, rank_device(base_device, tp.rank), tp)
            if self._ranks is not None:
                self._ranks.wait_ready()
        except BaseException:
            if self._ranks is not None:
                self._ranks.abort()
                self._ranks = None
            raise
        self._threads = (
            ThreadTuner(torch.get_num_threads())
            if base_device.type == "cpu" and self._ranks is None and torch.get_num_threads() > 1
            else None
        )
        # Decode and verification steps' seconds by rows, for speculation's cost model; on a
        # CPU only, where a step's time is its own (an accelerator's launches return early).
        self.step_curve: StepCurve | None = None
        if base_device.type == "cpu":
            self.step_curve = StepCurve()
            settle_cpu_process()
            if self._ranks is None:
                self.runner.warm_up(config.max_num_batched_tokens)

    def execute(
        self, batch: ScheduledBatch, lora_slots: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[Request]]:
        """The sampling rows' logits, the pooled requests' hidden rows, the sampling requests
        (``lora_slots``: each request's adapter slot, -1 for the base model); prompt logprobs
        (``prompt_logprobs.py``) are folded into their requests here."""
        inputs, sampling = prepare_inputs(batch, self.config.block_size, lora_slots)
        spans = prompt_spans(batch)
        sampled = len(inputs.logits_rows)  # a speculating request samples several rows
        if spans:
            inputs = replace(inputs, logits_rows=inputs.logits_rows + span_rows(spans))
        if self._ranks is not None:
            self._ranks.send(("step", inputs))
        logits, hidden = self._run(inputs)
        if spans:
            fold_prompt_logprobs(spans, logits[sampled:])
            logits = logits[:sampled]
        return logits, hidden, sampling

    def _run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass, on the thread count the tuner picks for a step of its kind; a
        step of sampled rows only (decodes, verification) run on the chosen count is timed
        into the step curve (a tuner's try of another count is not what steps cost, nor is a
        count's first step, which the tuner does not count either)."""
        tuner, usual = self._threads, True
        if tuner is not None:
            kind = tuner.kind_of(inputs.is_decode, len(inputs.input_ids))
            threads = tuner.choose(kind)
            usual = threads == tuner.chosen(kind)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        start, cpu = time.perf_counter(), time.thread_time()
        out = self.runner.run_pooled(inputs)
        seconds = time.perf_counter() - start
        if tuner is not None:
            measured = tuner.record(kind, threads, seconds, (time.thread_time() - cpu) / seconds)
            usual = usual and measured
        sampled_only = len(inputs.logits_rows) == len(inputs.input_ids) and not inputs.hidden_rows
        if self.step_curve is not None and usual and sampled_only:
            self.step_curve.record(len(inputs.input_ids), seconds)
        return out

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Make ``adapter`` resident in ``slot`` (LoRA is single-rank: ``EngineConfig`` checks)."""
        assert self.runner.lora is not None
        self.runner.lora.load(slot, adapter)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def skip_draw(self, generator: torch.Generator) -> None:
        """Advance ``generator`` past one token's draw, as sampling that token would have."""
        draw_uniform(generator, self.runner.device)

    def sleep(self, level: int) -> None:
        if self._ranks is not None:
            self._ranks.send(("sleep", level))
        self.runner.sleep(level)

    def load_weights(self, path: str) -> None:
        """Rank 0 first, so a checkpoint that fails leaves every rank on the old weights."""
        self.runner.load_weights(path)
        if self._ranks is not None:
            self._ranks.send(("load_weights", path))

    def wake_up(self, level: int) -> None:
        if self._ranks is not None:
            self._ranks.send(("wake_up", level))
        self.runner.wake_up(level)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; also runs at exit and on collection)."""
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.close()
        gc.unfreeze()  # what settle_cpu_process froze may now be garbage


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
