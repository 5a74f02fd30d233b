"""A small decode step's decoder layers in one C call: the CPU's replayed CUDA graph.

At one to a few rows on a small model, a decode step's time goes mostly to dispatch: some
fifteen torch ops and kernel calls per layer, each a few microseconds, thirty layers deep. A
``DecodeChain`` describes every layer once (weight blocks, norms, KV pages: raw pointers in a
ctypes array) and each step runs them all in ``kernels/decode_chain.c``, which chains the same
kernels the modules call (each linear's own block kernel, ``Linear.kernel``: the exact one, or
the int8 one under ``quantized_weights: int8``), rounding where they round: the hidden states it returns are the
module path's bit for bit (``tests/engine/test_decode_chain.py``).

A model qualifies when it runs on CPU in float32 or bfloat16 with the C kernels built, every
linear of every layer is multiplied from its GGUF blocks (``Linear.use_quantized``), one
tensor-parallel rank, the in-place attention kernel, and no q/k norm or o/MLP bias (Llama,
Mistral and Qwen2 do; Qwen3's q/k norm does not). A step qualifies with at most
``kernels.QUANT_MAX_ROWS`` tokens, no fresh prompt and no adapter (``takes``): decodes, and
speculation's verification rows, which would otherwise lose the chain exactly where
speculation pays. Anything else runs the modules. Decode rows are the modules' bit for bit; a
sequence's several new tokens attend as decode rows do (one row each, up to its position),
where the modules run SDPA: the same attention, summed in another order.
The chain points at the weights and the KV cache where they are: the runner drops it whenever
either moves (sleep, new weights) and builds it again on the next step.
"""

from __future__ import annotations

import ctypes

import torch

from . import kernels
from .kv_cache import KVCache
from .models.layers import Linear
from .models.llama import DecoderModel, LlamaForCausalLM

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
LINEARS = ("qkv", "o", "gate_up", "down")  # decode_chain.c's QKV, O, GATE_UP, DOWN


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _P),
        ("post_norm", _P),
        ("qkv_bias", _P),
        ("blocks", _P * 4),
        ("block_stride", ctypes.c_int64 * 4),
        ("qtype", _I * 4),
        ("gemv", _P * 4),
        ("k_pages", _P),
        ("v_pages", _P),
    ]


class _Step(ctypes.Structure):
    _fields_ = (
        [
            (name, _I)
            for name in (
                "rows hidden heads kv_heads head_dim rotary_dim inter "
                "block_size width max_len bf16 threads"
            ).split()
        ]
        + [("eps", _F), ("scale", _F)]
        + [(name, _P) for name in ("slots", "tables", "lens", "cos", "sin")]
    )


def _linears(layer: torch.nn.Module) -> list[Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _address(lib: ctypes.CDLL, name: str) -> int | None:
    """The C function ``name`` of the library, as a pointer the chain calls."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _from_blocks(linear: Linear) -> bool:
    w = linear.weight
    return linear.quantized is not None and linear._quantized_for == (w.data_ptr(), w._version)


def _qualifies(model: torch.nn.Module, kv_cache: KVCache, in_place: bool, tp_size: int) -> bool:
    """Whether ``model``'s layers can run as a chain (see the module's docstring)."""
    if not (isinstance(model, LlamaForCausalLM) and in_place and tp_size == 1):
        return False
    dtype = kv_cache.dtype
    lib = kernels.library.load() if kernels.quant_gemv_for(kv_cache.device, dtype) else None
    if lib is None or not hasattr(lib, "decode_chain"):
        return False
    cfg = model.config
    if cfg.qk_norm or cfg.o_bias or cfg.mlp_bias or model.model.embed_tokens.weight.dtype != dtype:
        return False
    return all(_from_blocks(lin) for layer in model.model.layers for lin in _linears(layer))


class DecodeChain:
    """One model's layers as ``decode_chain.c`` reads them; ``run`` is one decode step."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, scale: float) -> None:
        self.model: DecoderModel = model.model
        self.kv_cache = kv_cache
        self.dtype = kv_cache.dtype
        cfg = model.config
        layers = self.model.layers
        self.layers = (_Layer * len(layers))(
            *(self._layer(i, layer) for i, layer in enumerate(layers))
        )
        attn = layers[0].self_attn
        self.shape = dict(
            hidden=cfg.hidden_size,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            rotary_dim=self.model.rotary.rotary_dim,
            inter=layers[0].mlp.intermediate,
            block_size=kv_cache.block_size,
            bf16=int(self.dtype == torch.bfloat16),
            eps=cfg.rms_norm_eps,
            scale=scale,
        )

    @classmethod
    def build(
        cls, model: torch.nn.Module, kv_cache: KVCache, in_place: bool, tp_size: int, scale: float
    ) -> DecodeChain | None:
        """The chain of ``model`` where it qualifies (see the module's docstring), else None."""
        if not _qualifies(model, kv_cache, in_place, tp_size):
            return None
        return cls(model, kv_cache, scale)

    def _layer(self, i: int, layer: torch.nn.Module) -> _Layer:
        linears = _linears(layer)
        lib = kernels.library.load()
        k_pages, v_pages = self.kv_cache.layer(i)
        bias = layer.self_attn.qkv_proj.bias
        return _Layer(
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            (_P * 4)(*(lin.quantized.data_ptr() for lin in linears)),
            (ctypes.c_int64 * 4)(*(lin.quantized.stride(0) for lin in linears)),
            (_I * 4)(*(lin.qtype for lin in linears)),
            (_P * 4)(*(_address(lib, lin.kernel) for lin in linears)),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
        )

    @staticmethod
    def takes(query_lens: list[int], kv_lens: list[int]) -> bool:
        """Whether a step runs as a chain: at most ``QUANT_MAX_ROWS`` tokens, none of them a
        fresh prompt's (a sequence with context before its new tokens: decodes, speculation's
        verification rows, the last short chunk of a prompt)."""
        return sum(query_lens) <= kernels.QUANT_MAX_ROWS and all(
            q < n or q == 1 for q, n in zip(query_lens, kv_lens)
        )

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """The final-norm hidden states of one step's tokens (``[tokens, hidden]``). Each token
        is a row of its own that attends to its sequence's pages up to its own position (every
        row's K and V are written first), which is causal attention over a few new tokens."""
        h = self.model.embed_tokens(torch.tensor(input_ids, dtype=torch.int64))
        rope = self.model.rotary.tables(torch.tensor(positions, dtype=torch.int64), self.dtype)
        width = -(-(max(positions) + 1) // self.kv_cache.block_size)
        rows = [t[:width] + [0] * (width - len(t)) for t in block_tables]
        tables = torch.tensor(
            [table for table, q in zip(rows, query_lens) for _ in range(q)], dtype=torch.int32
        )
        lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        step = _Step(
            rows=len(input_ids),
            width=width,
            max_len=max(positions) + 1,
            threads=torch.get_num_threads(),
            slots=slot_t.data_ptr(),
            tables=tables.data_ptr(),
            lens=lens.data_ptr(),
            cos=rope.cos.data_ptr(),
            sin=rope.sin.data_ptr(),
            **self.shape,
        )
        kernels.library.load().decode_chain(
            h.data_ptr(), self.layers, len(self.layers), ctypes.byref(step)
        )
        return self.model.norm(h)
