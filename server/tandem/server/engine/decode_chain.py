"""A small decode step's decoder layers in one C call: the CPU's replayed CUDA graph.

At one to a few rows on a small model, a decode step's time goes mostly to dispatch: some
fifteen torch ops and kernel calls per layer, each a few microseconds, thirty layers deep. A
``DecodeChain`` describes every layer once (weight blocks, norms, KV pages: raw pointers in a
ctypes array) and each step runs them all in ``kernels/decode_chain.c``, which chains the same
kernels the modules call (each linear's own block kernel, ``Linear.kernel``: the exact one, or
the int8 one under ``quantized_weights: int8``), rounding where they round: the hidden states it returns are the
module path's bit for bit (``tests/engine/test_decode_chain.py``).

A model qualifies when it runs on CPU in float32 or bfloat16 with the C kernels built, every
linear of every layer is multiplied from its GGUF blocks (``Linear.use_quantized``) or else
by ``kernels.decode_linear`` (``Linear.decode_weight``: any checkpoint; AMX tiles in bfloat16,
AVX-512 panels in float32), one
tensor-parallel rank, the in-place attention kernel, and no q/k norm or o/MLP bias (Llama,
Mistral and Qwen2 do; Qwen3's q/k norm does not). A step qualifies with at most
``kernels.QUANT_MAX_ROWS`` tokens (blocks) or ``DECODE_ROWS``, no fresh prompt and no
adapter (``takes``): decodes, and speculation's verification rows, which would otherwise lose
the chain exactly where speculation pays. Anything else runs the modules. Decodes that begin
with the same pages attend to them once, as the attention backend has them do
(``shared_start``). Decode rows are the modules' bit for bit; a
sequence's several new tokens attend as decode rows do (one row each, up to its position),
where the modules run SDPA: the same attention, summed in another order.
The chain points at the weights and the KV cache where they are: the runner drops it whenever
either moves (sleep, new weights) and builds it again on the next step.
"""

from __future__ import annotations

import ctypes

import torch

from . import kernels
from .attention.torch_backend import SharedPages, shared_start
from .kv_cache import KVCache
from .models.layers import DECODE_ROWS, Linear
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
        ("linear", _P),
        ("linear_silu", _P),
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
        + [(name, _P) for name in ("slots", "tables", "lens", "cos", "sin", "shared")]
        + [("num_shared", _I)]
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


def _products(model: torch.nn.Module, kv_cache: KVCache, in_place: bool, tp_size: int) -> str:
    """How ``model``'s layers' linears run in a chain: ``blocks``, ``decode`` (by
    ``kernels.decode_linear``), or ``""`` where the model does not qualify (see the module's
    docstring)."""
    if not (isinstance(model, LlamaForCausalLM) and in_place and tp_size == 1):
        return ""
    dtype, device = kv_cache.dtype, kv_cache.device
    lib = kernels.library.load() if kernels.quant_gemv_for(device, dtype) else None
    if lib is None or not hasattr(lib, "decode_chain"):
        return ""
    cfg = model.config
    if cfg.qk_norm or cfg.o_bias or cfg.mlp_bias or model.model.embed_tokens.weight.dtype != dtype:
        return ""
    linears = [lin for layer in model.model.layers for lin in _linears(layer)]
    if all(_from_blocks(lin) for lin in linears):
        return "blocks"
    return "decode" if kernels.decode_linear_for(device, dtype) else ""


class DecodeChain:
    """One model's layers as ``decode_chain.c`` reads them; ``run`` is one decode step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        scale: float,
        decode_linears: bool = False,
        shared_pages: SharedPages | None = None,
    ) -> None:
        self.model: DecoderModel = model.model
        self.kv_cache = kv_cache
        self.dtype = kv_cache.dtype
        self.decode_linears = decode_linears  # else GGUF blocks
        self.max_rows = DECODE_ROWS if decode_linears else kernels.QUANT_MAX_ROWS
        self.shared_pages = shared_pages  # the backend's: attended once where decodes share them
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
        cls,
        model: torch.nn.Module,
        kv_cache: KVCache,
        in_place: bool,
        tp_size: int,
        scale: float,
        shared_pages: SharedPages | None = None,
    ) -> DecodeChain | None:
        """The chain of ``model`` where it qualifies (see the module's docstring), else None."""
        products = _products(model, kv_cache, in_place, tp_size)
        if not products:
            return None
        return cls(model, kv_cache, scale, products == "decode", shared_pages)

    def _layer(self, i: int, layer: torch.nn.Module) -> _Layer:
        linears = _linears(layer)
        lib = kernels.library.load()
        k_pages, v_pages = self.kv_cache.layer(i)
        bias = layer.self_attn.qkv_proj.bias
        products = [None, None]  # the decode product and its gate|up with SiLU, by address
        if self.decode_linears:
            product, _, silu = kernels.decode_kernel(self.dtype)
            products = [_address(lib, product), silu and _address(lib, silu)]
            weights = [lin.decode_weight() for lin in linears]
            blocks, strides, qtypes, gemv = (
                [w.data_ptr() for w in weights],
                [0] * 4,
                [0] * 4,
                [None] * 4,
            )
        else:
            blocks = [lin.quantized.data_ptr() for lin in linears]
            strides = [lin.quantized.stride(0) for lin in linears]
            qtypes = [lin.qtype for lin in linears]
            gemv = [_address(lib, lin.kernel) for lin in linears]
        return _Layer(
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            (_P * 4)(*blocks),
            (ctypes.c_int64 * 4)(*strides),
            (_I * 4)(*qtypes),
            (_P * 4)(*gemv),
            *products,
            k_pages.data_ptr(),
            v_pages.data_ptr(),
        )

    def takes(self, query_lens: list[int], kv_lens: list[int]) -> bool:
        """Whether a step runs as a chain: at most ``max_rows`` tokens, none of them a fresh
        prompt's (a sequence with context before its new tokens: decodes, speculation's
        verification rows, the last short chunk of a prompt)."""
        return sum(query_lens) <= self.max_rows and all(
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
        bs = self.kv_cache.block_size
        row_tables = [table for table, q in zip(block_tables, query_lens) for _ in range(q)]
        lens = [p + 1 for p in positions]
        decodes = all(q == 1 for q in query_lens)
        shared = shared_start(row_tables, lens, bs, self.shared_pages) if decodes else 0
        lens = [n - shared * bs for n in lens]
        width = -(-max(lens) // bs)
        tables = torch.tensor(
            [t[shared : shared + width] + [0] * (width + shared - len(t)) for t in row_tables],
            dtype=torch.int32,
        )
        shared_t = torch.tensor(row_tables[0][:shared], dtype=torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        step = _Step(
            rows=len(input_ids),
            width=width,
            max_len=max(lens),
            threads=torch.get_num_threads(),
            slots=slot_t.data_ptr(),
            tables=tables.data_ptr(),
            lens=lens_t.data_ptr(),
            cos=rope.cos.data_ptr(),
            sin=rope.sin.data_ptr(),
            shared=shared_t.data_ptr(),
            num_shared=shared,
            **self.shape,
        )
        kernels.library.load().decode_chain(
            h.data_ptr(), self.layers, len(self.layers), ctypes.byref(step)
        )
        return self.model.norm(h)
