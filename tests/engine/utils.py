"""Helpers for the engine's tests: a request without an engine (its text over a byte-level
tokenizer that needs no files), an engine run to the end, the product a linear layer gives a
prefill's rows here, the prompts the exactness tests
share, and GGUF files written the way llama.cpp's converter does from the tests' HF-format
tiny models.

The GGUF writer is independent of the loader under test: names, llama's q/k row permutation
and the metadata keys follow llama.cpp's ``convert_hf_to_gguf.py``; quantization is the
``gguf`` package's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

from tandem.server.engine import LLMEngine, cpu, kernels
from tandem.server.engine.detokenizer import IncrementalDetokenizer
from tandem.server.engine.output_processor import add_text
from tandem.server.engine.request import OutputState, Request, SamplingState
from tandem.server.engine.sampling_params import SamplingParams

PROMPTS = [
    "Hello",
    "The scheduler decides, at every step, which requests run",
    "東京の天気は晴れです。",
    "Emoji travel as several bytes: 🚀",
    "def generate(prompt, max_tokens=16):\n    tokens = tokenizer.encode(prompt)",
    "x",
    "A paged cache splits memory into blocks of sixteen tokens, so no sequence needs one long "
    "contiguous region. When two requests share the same beginning, the prefix cache lets the "
    "second one reuse the blocks of the first.",
    "Numbers matter: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987. " * 3,
]


def make_request(
    tokens: list[int],
    rid: str = "r",
    order: int = 0,
    *,
    params: SamplingParams | None = None,
    max_tokens: int = 16,
    eos_token_ids: frozenset[int] = frozenset(),
    output: OutputState | None = None,
    group_id: str | None = None,
) -> Request:
    """A request as the input processor builds one, without a model or a tokenizer."""
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        params=params or SamplingParams(),
        sampling=SamplingState(max_tokens=max_tokens, eos_token_ids=eos_token_ids),
        arrival_order=order,
        group_id=group_id or rid,
        output=output or OutputState(),
    )


class ByteTokenizer:
    """A byte-level tokenizer without a vocabulary file: token ``i < 256`` is byte ``i`` and
    anything above is a special token (skipped), so a multi-byte character or a stop string
    spans several tokens, as with a real byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def text_output(index: int = 0, stream: bool = False) -> OutputState:
    """The output state of a sequence whose text is detokenized as it runs (a stream's, or
    one with stop strings), over ``ByteTokenizer``."""
    return OutputState(
        index=index, stream=stream, detokenizer=IncrementalDetokenizer(ByteTokenizer())
    )


def emit(req: Request, token: int) -> str:
    """Append a sampled ``token`` as the engine does before its stop check: the token, then
    its text; returns the text that became final."""
    req.output_token_ids.append(token)
    return add_text(req, token)


def drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# How a 2-D weight is stored: (float32 rows) -> (array to write, its GGML type).
Encoder = Callable[[np.ndarray], tuple[np.ndarray, GGMLQuantizationType]]


def encoder(qtype: GGMLQuantizationType) -> Encoder:
    return lambda w: (quantize(w, qtype), qtype)


def write_gguf(
    hf_dir: Path,
    out: Path,
    encode: Encoder = encoder(GGMLQuantizationType.F32),
    arch: str | None = None,
) -> dict[str, np.ndarray]:
    """Write ``hf_dir`` as a GGUF (2-D weights through ``encode``, the rest F32); returns the
    float32 source tensors by GGUF name, in GGUF (permuted) row order."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    arch = arch or ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(out, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, t) for i, (t, _) in enumerate(vocab)]
    tokens += [added[i] for i in sorted(added) if i >= len(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [TokenType.CONTROL if i in added else TokenType.NORMAL for i in range(len(tokens))]
    )
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    eos = cfg["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_chat_template(tok_cfg["chat_template"])
    source: dict[str, np.ndarray] = {}
    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    for hf, t in sorted(tensors.items()):
        name = gguf_name(hf)
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_permute(t, heads if "attn_q" in name else kv_heads)
        source[name] = t
        if t.ndim == 2:
            data, qtype = encode(t)
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return source


def prefill_route(dtype: torch.dtype) -> str:
    """The product ``Linear.route`` names for more than a decode step's rows on this CPU:
    float32 planes on AMX tiles, else oneDNN's packed weight (bfloat16 widened to float32
    where ``cpu.widens_bfloat16``); ``plain`` without oneDNN."""
    if dtype == torch.float32 and kernels.plane_linear_for(torch.device("cpu"), dtype):
        return "planes"
    if not torch.backends.mkldnn.is_available():
        return "plain"
    return "widened" if dtype == torch.bfloat16 and cpu.widens_bfloat16() else "onednn"
