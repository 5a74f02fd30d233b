"""The FlashInfer attention backend: paged prefill and decode kernels over our NHD pages.

Per step the runner's ``BatchLayout`` becomes FlashInfer's CSR page table, once, on the host:
``qo_indptr`` (query rows per sequence), ``kv_indptr`` / ``kv_indices`` (the pages of each
sequence, int32) and ``kv_last_page_len``. A decode-only step plans the decode wrapper, any
other step the prefill wrapper (decode rows in a mixed batch are prefill rows of length 1).
FlashInfer's causal mask is aligned to the end of the KV (query ``i`` of a sequence with
``q`` new tokens and ``kv`` tokens in all sits at position ``kv - q + i``), which is our
convention, so chunked prefill and prefix-cache hits need no special path. Each layer writes
its new K and V by flat slot index (as the torch backend does), then runs the planned kernel.

Block 0 of the KV cache is the reserved null page: padded rows of a CUDA-graph batch point
there (one token of context, slot 0), so they never touch a real sequence's pages.

Keyword arguments that moved between FlashInfer releases (``q_data_type``/``kv_data_type``
versus ``data_type``, ``use_tensor_cores``, ``sm_scale``, ``non_blocking``) are passed only
when the installed version's signature names them. FlashInfer's kernels take float16 and
bfloat16 (not float32): float32 models use the torch backend.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionStep, BatchLayout, KeptRows

WORKSPACE_BYTES = 128 << 20
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer builds its kernels on first use. Its FA2 prefill module also serves tensor-core
# decode (same template arguments), so one build covers both; "auto" would pick FA3 on Hopper
# for prefill alone, a second and much longer build per dtype and head size.
PREFILL_BACKEND = "fa2"


@dataclass(frozen=True)
class PagedMetadata:
    """FlashInfer's page table for one step; all int32 on the host."""

    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B], in 1..page_size
    kv_lens: torch.Tensor  # [B]


def paged_metadata(layout: BatchLayout, block_size: int) -> PagedMetadata:
    qo_indptr, kv_indptr, indices, last = [0], [0], [], []
    for q_len, kv_len, table in zip(layout.query_lens, layout.kv_lens, layout.block_tables):
        if kv_len < q_len or q_len < 1:
            raise ValueError(f"bad batch layout: {q_len} new tokens in a context of {kv_len}")
        pages = -(-kv_len // block_size)
        if len(table) < pages:
            raise ValueError(f"block table of {len(table)} pages cannot hold {kv_len} tokens")
        indices.extend(table[:pages])
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + pages)
        last.append(kv_len - (pages - 1) * block_size)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedMetadata(
        i32(qo_indptr), i32(kv_indptr), i32(indices), i32(last), i32(list(layout.kv_lens))
    )


def accepted_kwargs(fn: Callable[..., Any], **candidates: Any) -> dict[str, Any]:
    """The subset of ``candidates`` that ``fn`` (as installed) takes by name.

    Newer FlashInfer ``plan`` methods are ``plan(..., **kwargs)`` forwarding to ``_plan_impl``;
    their names are read from ``_plan_impl``. A bare ``**kwargs`` with nothing to read from
    takes everything.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        impl = (
            getattr(getattr(fn, "__self__", None), "_plan_impl", None)
            if fn.__name__ == "plan"
            else None
        )
        if impl is None:
            return dict(candidates)
        params = inspect.signature(impl).parameters
    return {k: v for k, v in candidates.items() if k in params}


def _dtype_kwargs(fn: Callable[..., Any], dtype: torch.dtype) -> dict[str, Any]:
    kw = accepted_kwargs(fn, q_data_type=dtype, kv_data_type=dtype)
    if "q_data_type" not in kw:
        kw.update(accepted_kwargs(fn, data_type=dtype))
    return kw


def import_flashinfer() -> ModuleType:
    return importlib.import_module("flashinfer")


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self,
        kv_cache: KVCache,
        scale: float,
        num_qo_heads: int,
        *,
        flashinfer: ModuleType | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        if kv_cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the flashinfer attention backend takes float16 or bfloat16, not {kv_cache.dtype}; "
                "use attention_backend=torch (or auto) for float32"
            )
        fi = flashinfer if flashinfer is not None else import_flashinfer()
        if not hasattr(fi.BatchDecodeWithPagedKVCacheWrapper, "plan"):
            raise ValueError(
                "the installed flashinfer has no plan()/run() wrappers; flashinfer >= 0.2 is needed"
            )
        self.fi = fi
        self.kv_cache = kv_cache
        self.scale = scale
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = kv_cache.num_kv_heads
        self.head_dim = kv_cache.head_dim
        self.block_size = kv_cache.block_size
        self.device = kv_cache.device
        self.dtype = kv_cache.dtype
        # One float workspace shared by every wrapper: only one kernel family runs at a time.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off for decode once a KV head serves several query heads.
        self.use_tensor_cores = num_qo_heads // self.num_kv_heads >= 4
        prefill = fi.BatchPrefillWithPagedKVCacheWrapper
        self.prefill_wrapper = prefill(
            self.workspace, "NHD", **accepted_kwargs(prefill.__init__, backend=PREFILL_BACKEND)
        )
        self.decode_wrapper = self._decode_wrapper()
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: dict[str, torch.Tensor] = {}

    def _decode_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        cls = self.fi.BatchDecodeWithPagedKVCacheWrapper
        kw = accepted_kwargs(cls.__init__, use_tensor_cores=self.use_tensor_cores)
        if graph_buffers:
            kw.update(use_cuda_graph=True, **graph_buffers)
        return cls(self.workspace, "NHD", **kw)

    # ----- eager steps --------------------------------------------------------------------
    def plan(self, layout: BatchLayout) -> AttentionStep:
        meta = paged_metadata(layout, self.block_size)
        if layout.is_decode:
            self._plan_decode(self.decode_wrapper, meta)
            wrapper = self.decode_wrapper
        else:
            self._plan_prefill(meta)
            wrapper = self.prefill_wrapper
        return FlashInferStep(
            self.kv_cache, layout.slot_mapping, wrapper, self._run_kwargs(wrapper)
        )

    def _plan_prefill(self, meta: PagedMetadata) -> None:
        w = self.prefill_wrapper
        kw = accepted_kwargs(w.plan, causal=True, sm_scale=self.scale, non_blocking=True)
        kw.update(_dtype_kwargs(w.plan, self.dtype))
        w.plan(
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices.to(self.device, non_blocking=True),
            meta.kv_last_page_len,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            **kw,
        )

    def _plan_decode(self, wrapper: Any, meta: PagedMetadata) -> None:
        kw = accepted_kwargs(
            wrapper.plan, pos_encoding_mode="NONE", sm_scale=self.scale, non_blocking=True
        )
        kw.update(_dtype_kwargs(wrapper.plan, self.dtype))
        wrapper.plan(
            meta.kv_indptr,
            meta.kv_indices.to(self.device, non_blocking=True),
            meta.kv_last_page_len,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            **kw,
        )

    def _run_kwargs(self, wrapper: Any) -> dict[str, Any]:
        """Versions whose ``plan`` has no ``sm_scale`` take it at ``run``."""
        if "sm_scale" in accepted_kwargs(wrapper.plan, sm_scale=None):
            return {}
        return accepted_kwargs(wrapper.run, sm_scale=self.scale)

    # ----- CUDA graphs --------------------------------------------------------------------
    def graph_step(
        self, batch_size: int, slot_mapping: torch.Tensor, max_blocks_per_seq: int
    ) -> AttentionStep:
        """A decode step over fixed-size page-table buffers, one wrapper per batch size.

        The indices buffer is shared by every size (one graph replays at a time) and holds
        ``max_blocks_per_seq`` pages for each row of the largest size asked for.
        """
        needed = batch_size * max_blocks_per_seq
        indices = self._graph_buffers.get("indices")
        if indices is None or indices.numel() < needed:
            if self._graph_wrappers:
                raise ValueError("capture the largest batch size first")
            indices = torch.zeros(needed, dtype=torch.int32, device=self.device)
            self._graph_buffers["indices"] = indices
        wrapper = self._decode_wrapper(
            paged_kv_indptr_buffer=torch.zeros(
                batch_size + 1, dtype=torch.int32, device=self.device
            ),
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=torch.ones(
                batch_size, dtype=torch.int32, device=self.device
            ),
        )
        self._graph_wrappers[batch_size] = wrapper
        return FlashInferStep(self.kv_cache, slot_mapping, wrapper, self._run_kwargs(wrapper))

    def plan_graph(self, batch_size: int, layout: BatchLayout) -> None:
        if layout.num_seqs != batch_size or not layout.is_decode:
            raise ValueError(f"a graph of batch size {batch_size} replays {batch_size} decode rows")
        self._plan_decode(self._graph_wrappers[batch_size], paged_metadata(layout, self.block_size))

    def drop_graphs(self) -> None:
        self._graph_wrappers.clear()
        self._graph_buffers.clear()


class FlashInferStep(AttentionStep):
    def __init__(
        self,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        wrapper: Any,
        run_kwargs: dict[str, Any],
    ) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.wrapper = wrapper
        self.run_kwargs = run_kwargs

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        flat = self.kv_cache.flat_kv(layer)
        flat[0].index_copy_(0, self.slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, self.slot_mapping, v.to(flat.dtype))
        out = self.wrapper.run(q.contiguous(), self.kv_cache.layer(layer), **self.run_kwargs)
        return out if keep is None else out[keep.index]
