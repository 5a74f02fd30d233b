"""One tensor-parallel rank's device state and forward pass: flat inputs in, logits of the
sampling rows out (and the final-norm hidden states of the rows a pooled request reads,
without their logits).

A ``ModelRunner`` holds what one rank owns: its slice of the weights, its KV heads (the cache
is sized here, from the config and the device's free memory), its attention backend and its
captured CUDA graphs; ``run`` forwards one step and ``sleep``/``wake_up`` release and restore
that memory. ``Worker`` builds rank 0's runner in the engine's process; ``parallel.launch``
builds the others in theirs.

``prepare_inputs`` flattens a ``ScheduledBatch`` into plain lists (``StepInputs``): the token
ids, positions and KV slots of every new token, and each sequence's query length, context
length and block table. That is all a runner needs, so under tensor parallelism rank 0
sends exactly this to the other ranks, and every rank runs ``ModelRunner.run`` on it.

Decode-only steps can replay CUDA graphs captured per padded batch size (``capture_graphs``):
the batch is padded up to the next captured size with rows that read and write only the
reserved null page (block 0), the static input buffers are filled, the attention backend
re-plans its static page table outside the graph, and the graph replays. Anything else
(prefill, mixed batches, batches above the largest size, ``enforce_eager``, a backend that
cannot be captured) runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from .attention import BatchLayout, select_backend
from .attention.base import KeptRows, SeqShape
from .block_pool import NULL_BLOCK
from .config import ConfigError, EngineConfig
from .decode_chain import DecodeChain
from .kv_cache import KVCache
from .limits import max_model_len
from .loader import load_model, reload_weights, resolve_dtype
from .lora.layers import LoraLayers
from .models.config import ModelConfig
from .parallel import SINGLE, TensorParallel
from .pooling import rows_read

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
# Kept free on a GPU beside the KV cache for activations, the sampler and the graphs' pool.
ACTIVATION_RESERVE_BYTES = 1 << 30
WARM_UP_SEQUENCE = 256  # tokens of each sequence in the start-up step: its attention stays cheap


@dataclass(frozen=True)
class StepInputs(SeqShape):
    """One step, flattened: what every model shard needs (plain lists, cheap to pickle)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]  # flat rows whose logits are sampled
    hidden_rows: list[int] = field(default_factory=list)  # flat rows pooled requests read
    lora_slots: list[int] = field(default_factory=list)  # per sequence; -1: the base model


def prepare_inputs(
    batch: ScheduledBatch, block_size: int, lora_slots: list[int] | None = None
) -> tuple[StepInputs, list[Request]]:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    kv_lens: list[int] = []
    logits_rows: list[int] = []
    hidden_rows: list[int] = []
    sampling: list[Request] = []
    for req, n in zip(batch.requests, batch.num_new_tokens):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if req.pooling is not None:
            base = len(input_ids) - start
            hidden_rows.extend(
                base + p for p in rows_read(req.pooling.params.kind, start, end, req.num_tokens)
            )
        draft = req.sampling.draft.token_ids  # speculation: verified after the request's last token
        input_ids.extend(req.token_slice(start, end - len(draft)) + draft)
        positions.extend(range(start, end))
        table = req.block_ids
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        kv_lens.append(end)
        if end == req.num_tokens + len(draft) and req.pooling is None:
            logits_rows.extend(range(len(input_ids) - 1 - len(draft), len(input_ids)))
            sampling.append(req)
    inputs = StepInputs(
        input_ids,
        positions,
        slots,
        list(batch.num_new_tokens),
        kv_lens,
        [list(r.block_ids) for r in batch.requests],
        logits_rows,
        hidden_rows,
        lora_slots or [],
    )
    return inputs, sampling


def last_layer_tails(query_lens: list[int], rows: list[int]) -> list[int]:
    """Per sequence, how many of its last new rows the last layer has to finish so that
    ``rows`` (flat) are among them: from its first such row to its end; 0 where it has none."""
    firsts: dict[int, int] = {}
    ends = list(accumulate(query_lens))
    for row in rows:
        seq = bisect.bisect_right(ends, row)
        firsts[seq] = min(firsts.get(seq, row), row)
    return [end - firsts[i] if i in firsts else 0 for i, end in enumerate(ends)]


# ----- CUDA-graph helpers (pure; tested on CPU) ---------------------------------------------
def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    if top not in sizes:
        sizes.append(top)
    return sizes


def pick_graph_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs >= 1 else None


def pad_decode_inputs(inputs: StepInputs, size: int) -> StepInputs:
    """Pad a decode batch to ``size`` rows that touch only the null page.

    A padded row has token 0 at position 0, one token of context in block 0, and writes its
    K/V into slot 0 of block 0, so no real sequence's pages are read or written.
    """
    if not inputs.is_decode:
        raise ValueError("only decode batches run in CUDA graphs")
    pad = size - inputs.num_seqs
    if pad < 0:
        raise ValueError(f"{inputs.num_seqs} rows do not fit a graph of {size}")
    return replace(
        inputs,
        input_ids=inputs.input_ids + [0] * pad,
        positions=inputs.positions + [0] * pad,
        slots=inputs.slots + [NULL_BLOCK] * pad,
        query_lens=inputs.query_lens + [1] * pad,
        kv_lens=inputs.kv_lens + [1] * pad,
        block_tables=inputs.block_tables + [[NULL_BLOCK]] * pad,
    )


class _Graphs:
    """Captured decode graphs sharing one memory pool and one set of static buffers."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        self.sizes = sizes
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slots = torch.zeros(top, dtype=torch.int64, device=device)  # slot 0: the null page
        self.hidden: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}


class ModelRunner:
    """One rank's weights, KV cache, attention backend and decode graphs."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.tp = tp
        self.dtype = resolve_dtype(config.dtype, model_config, device)
        num_qo_heads = tp.divide(model_config.num_attention_heads, "num_attention_heads")
        num_kv_heads = tp.divide(model_config.num_key_value_heads, "num_key_value_heads")
        self.weights_path = config.model  # what wake_up(2) reloads; /update_weights changes it
        self.quantized = config.quantized_weights  # auto | exact | int8 | off: the block kernel
        self.model = load_model(config.model, self.dtype, device, tp, self.quantized)
        self.lora = (
            LoraLayers(config.max_loras, device, self.dtype) if config.lora_enabled else None
        )
        if self.lora is not None:
            self.lora.attach(self.model)
        self.num_blocks = self._agree(self._num_kv_blocks())
        self.kv_cache = KVCache(
            model_config, self.num_blocks, config.block_size, self.dtype, device, num_kv_heads
        )
        self.backend = select_backend(
            config.attention_backend, self.kv_cache, model_config.head_dim**-0.5, num_qo_heads
        )
        self._graphs: _Graphs | None = None
        self._capture_graphs()
        self._chain = self._build_chain()

    # ----- memory ---------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        """An explicit token count wins; else a fraction of device memory after the weights.

        On a GPU, ``gpu_memory_utilization`` is the share of the device's total memory this
        engine may hold (per engine, as vLLM's: two engines at 0.45 share one GPU); what this
        process already holds (the weights) and a reserve for activations come off it, and it
        never takes more than is free. On CPU: a fraction of available RAM, capped.
        """
        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            return -(-cfg.kv_cache_tokens // cfg.block_size) + 1
        per_block = KVCache.bytes_per_block(
            self.model_config, cfg.block_size, self.dtype, self.tp.size
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            share = int(total * cfg.gpu_memory_utilization) - torch.cuda.memory_reserved(
                self.device
            )
            budget = min(share, free) - ACTIVATION_RESERVE_BYTES
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(int(available * cfg.gpu_memory_utilization), cfg.max_kv_cache_bytes)
        blocks = budget // per_block
        if blocks < 2:
            raise ConfigError(
                f"no memory left for the KV cache ({budget} bytes, {per_block} per block)"
            )
        return blocks

    def _agree(self, blocks: int) -> int:
        """Every rank must index the same blocks: take the smallest count any rank can hold."""
        if self.tp.size == 1:
            return blocks
        import torch.distributed as dist

        t = torch.tensor([blocks], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.cpu_group)
        return int(t.item())

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (and parks weights in host memory on a GPU); level 2 drops weights."""
        self.drop_graphs()  # they point at the memory about to go
        self._chain = None  # so does it
        self.kv_cache.release()
        if level == 2:
            self.model.to_empty(device=torch.device("meta"))
        elif self.device.type == "cuda":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def load_weights(self, path: str) -> None:
        """Swap in ``path``'s weights (same shapes; see ``loader.reload_weights``)."""
        reload_weights(self.model, path, self.dtype, self.tp, self.quantized)
        self.weights_path = path
        self._chain = self._build_chain()

    def wake_up(self, level: int) -> None:
        if level == 2:
            self.model = load_model(
                self.weights_path, self.dtype, self.device, self.tp, self.quantized
            )
            if self.lora is not None:
                self.lora.attach(self.model)
        elif self.device.type == "cuda":
            self.model.to(self.device)
        self.kv_cache.restore()
        self._capture_graphs()
        self._chain = self._build_chain()

    # ----- the forward pass ------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, tokens: int) -> None:
        """Forward one prefill step of ``tokens`` prompt tokens (sequences of up to 256) whose
        K/V go to the null page, before the first request, as vLLM's start-up does: the
        step's activations are faulted in once (kept by ``settle_cpu_process``) and oneDNN
        makes its kernels, which the first batch after start otherwise pays (a bfloat16
        ``short`` batch of the bench ran 6-49 % slower first, over six children)."""
        bs = self.config.block_size
        longest = min(
            tokens, WARM_UP_SEQUENCE, max_model_len(self.config, self.model_config, self.num_blocks)
        )
        lens = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])
        positions = [p for n in lens for p in range(n)]
        inputs = StepInputs(
            input_ids=[0] * tokens,
            positions=positions,
            slots=[NULL_BLOCK * bs] * tokens,
            query_lens=lens,
            kv_lens=lens,
            block_tables=[[NULL_BLOCK] * -(-n // bs) for n in lens],
            logits_rows=[],
        )
        self.run_pooled(inputs, compute_logits=False)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, compute_logits: bool = True) -> torch.Tensor:
        """Forward one step; logits (the model's dtype) of ``inputs.logits_rows`` unless
        ``compute_logits`` is off."""
        return self.run_pooled(inputs, compute_logits)[0]

    @torch.inference_mode()
    def run_pooled(
        self, inputs: StepInputs, compute_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``run``'s logits, and the final-norm hidden states of ``inputs.hidden_rows``
        (float32, ``[len(hidden_rows), hidden]``): pooled rows never reach the lm_head."""
        size = self._graph_size(inputs)
        if size is not None:
            hidden = self._replay(inputs, size)
        elif self._chain is not None and self._chained(self._chain, inputs):
            hidden = self._chain.run(
                inputs.input_ids,
                inputs.positions,
                inputs.slots,
                inputs.query_lens,
                inputs.block_tables,
            )
        else:
            hidden, inputs = self._eager(inputs)
        # a copy: rows in order are a view, and a decode chain's output buffer is reused
        pooled = hidden[self._index(inputs.hidden_rows)].to(torch.float32, copy=True)
        if not compute_logits or not inputs.logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32), pooled
        return self.model.compute_logits(hidden[self._index(inputs.logits_rows)]), pooled

    def _build_chain(self) -> DecodeChain | None:
        """The CPU's counterpart of the decode graphs, where the model qualifies."""
        in_place = getattr(self.backend, "in_place", False)
        scale = self.model_config.head_dim**-0.5
        shared = getattr(self.backend, "shared_pages", None)
        return DecodeChain.build(self.model, self.kv_cache, in_place, self.tp.size, scale, shared)

    @staticmethod
    def _chained(chain: DecodeChain, inputs: StepInputs) -> bool:
        if any(s >= 0 for s in inputs.lora_slots):
            return False
        return chain.takes(inputs.query_lens, inputs.kv_lens)

    def _index(self, rows: list[int]) -> torch.Tensor | slice:
        """Rows to take from a step's hidden states: a slice when they run in order (every
        row of a decode step: no copy at all), else indices copied without a stream sync."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return self._on_device(rows, torch.int64)

    def _on_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A step input on the device, copied without waiting for the GPU: a blocking copy
        would hold the host until the previous step is done, where it could be planning this
        one (two such waits made Llama-3.1-8B's batch-1 step 8.1 ms over a 4.7 ms replay)."""
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _eager(self, inputs: StepInputs) -> tuple[torch.Tensor, StepInputs]:
        """The step's final hidden states and ``inputs`` with its logits and pooled rows
        numbered among them: without adapters, only the rows read from them (``KeptRows``)."""
        layout = BatchLayout(
            query_lens=list(inputs.query_lens),
            kv_lens=list(inputs.kv_lens),
            block_tables=inputs.block_tables,
            slot_mapping=self._on_device(inputs.slots, torch.int64),
        )
        step = self.backend.plan(layout)
        if self.lora is not None:
            self.lora.begin_step(inputs.lora_slots, inputs.query_lens)
        keep, inputs = self._kept(inputs)
        hidden = self.model(
            self._on_device(inputs.input_ids, torch.int64),
            self._on_device(inputs.positions, torch.int64),
            step,
            keep,
        )
        return hidden, inputs

    def _kept(self, inputs: StepInputs) -> tuple[KeptRows | None, StepInputs]:
        """The rows the last layer finishes, and ``inputs`` with its logits and pooled rows
        renumbered among them; None and ``inputs`` when every row is read, or when an adapter
        runs (its layers' hooks take the step's rows as they lie)."""
        if any(s >= 0 for s in inputs.lora_slots):
            return None, inputs
        tails = last_layer_tails(inputs.query_lens, inputs.logits_rows + inputs.hidden_rows)
        ends = accumulate(inputs.query_lens)
        kept = [r for end, t in zip(ends, tails) for r in range(end - t, end)]
        if len(kept) == len(inputs.input_ids):
            return None, inputs
        place = {row: i for i, row in enumerate(kept)}
        renumbered = replace(
            inputs,
            logits_rows=[place[r] for r in inputs.logits_rows],
            hidden_rows=[place[r] for r in inputs.hidden_rows],
        )
        return KeptRows(tails, self._index(kept)), renumbered

    # ----- CUDA graphs --------------------------------------------------------------------
    @property
    def graph_sizes(self) -> list[int]:
        return list(self._graphs.sizes) if self._graphs else []

    def _graph_size(self, inputs: StepInputs) -> int | None:
        if self._graphs is None or not inputs.is_decode or any(s >= 0 for s in inputs.lora_slots):
            return None  # adapters run eagerly: the graphs hold the base model only
        return pick_graph_size(inputs.num_seqs, self._graphs.sizes)

    def _capture_graphs(self) -> None:
        if self.config.enforce_eager or self.device.type != "cuda":
            return
        if not self.backend.supports_cuda_graphs:
            log.info(
                "the %s attention backend runs decode eagerly (no CUDA graphs)", self.backend.name
            )
            return
        limit = max_model_len(self.config, self.model_config, self.num_blocks)
        self.capture_graphs(self.config.max_num_seqs, -(-limit // self.config.block_size))

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Capture one decode graph per size in ``graph_batch_sizes(max_num_seqs)``, largest first.

        Needs CUDA and a backend that supports graphs; the KV cache and the weights must stay
        where they are while the graphs live (``drop_graphs`` before moving them).
        """
        if self.device.type != "cuda" or not self.backend.supports_cuda_graphs:
            raise ValueError(
                f"CUDA graphs need a CUDA device and a capturable attention backend "
                f"(device {self.device}, backend {self.backend.name})"
            )
        sizes = graph_batch_sizes(max_num_seqs)
        if self.lora is not None:
            self.lora.begin_step([], [])  # the graphs hold the base model only
        g = _Graphs(sizes, self.device)
        pool = None
        empty = StepInputs([], [], [], [], [], [], [])
        for size in reversed(sizes):
            step = self.backend.graph_step(size, g.slots[:size], max_blocks_per_seq)
            self.backend.plan_graph(size, self._layout(pad_decode_inputs(empty, size)))
            ids, pos = g.input_ids[:size], g.positions[:size]
            warm = self.model(ids, pos, step)  # warm-up outside the graph (kernel selection, JIT)
            if g.hidden is None:
                g.hidden = torch.zeros(
                    sizes[-1], warm.shape[-1], dtype=warm.dtype, device=self.device
                )
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                g.hidden[:size] = self.model(ids, pos, step)
            pool = graph.pool() if pool is None else pool
            g.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self._graphs = g
        log.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def drop_graphs(self) -> None:
        self._graphs = None
        drop = getattr(self.backend, "drop_graphs", None)
        if drop is not None:
            drop()

    def _layout(self, inputs: StepInputs) -> BatchLayout:
        return BatchLayout(
            list(inputs.query_lens),
            list(inputs.kv_lens),
            inputs.block_tables,
            torch.tensor(inputs.slots, dtype=torch.int64),
        )

    def _replay(self, inputs: StepInputs, size: int) -> torch.Tensor:
        g = self._graphs
        assert g is not None and g.hidden is not None
        padded = pad_decode_inputs(inputs, size)
        g.input_ids[:size].copy_(
            torch.tensor(padded.input_ids, dtype=torch.int64), non_blocking=True
        )
        g.positions[:size].copy_(
            torch.tensor(padded.positions, dtype=torch.int64), non_blocking=True
        )
        g.slots[:size].copy_(torch.tensor(padded.slots, dtype=torch.int64), non_blocking=True)
        self.backend.plan_graph(size, self._layout(padded))
        g.graphs[size].replay()
        return g.hidden[: inputs.num_seqs]
