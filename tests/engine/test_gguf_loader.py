"""GGUF files as models: exact against transformers, every quantization type, bad files rejected.

The files are written here from the tiny HF models the way llama.cpp's converter writes them
(``gguf_files.py``), so each test knows what the loader must read back.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.gguf_loader import gguf_tensors, hf_name
from tandem.server.engine.loader import read_model_config
from tandem.server.engine.models.config import ModelLoadError
from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model
from tandem.server.engine.tokenizer import load_tokenizer

from .utils import encoder, llama_permute, write_gguf


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    """Converted tokenizers of these throwaway files go to the test's cache, not the user's."""
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))


PROMPTS = ["Hello there, how are you", "The cat sat on", "Once upon a time, in a land far"]


def _greedy_hf(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_generates_exactly_what_transformers_does(tiny_models, tmp_path, arch) -> None:
    hf_dir = tiny_models[arch]
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf_dir, path)
    llm = LLM(str(path), kv_cache_tokens=2048)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    tok = llm.engine.tokenizer
    assert [tok.encode(p) for p in PROMPTS] == [hf_tok.encode(p) for p in PROMPTS]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tok.apply_chat_template(chat, tokenize=False) == hf_tok.apply_chat_template(
        chat, tokenize=False
    )
    again = load_tokenizer(path)  # saved in the cache by the first load, and read from there
    assert again is not tok and [again.encode(p) for p in PROMPTS] == [
        tok.encode(p) for p in PROMPTS
    ]
    assert again.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(
        chat, tokenize=False
    )
    prompts = [hf_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert [o.token_ids for o in outs] == [_greedy_hf(reference, p, 24) for p in prompts]
    if arch == "llama":  # transformers reading the same file un-permutes q/k the same way
        from_gguf = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        )
        assert [o.token_ids for o in outs] == [_greedy_hf(from_gguf, p, 24) for p in prompts]


# Largest error allowed, as a fraction of the tensor's largest magnitude.
QUANT_ERROR = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1e-2,
    Q.Q5_0: 5e-2,
    Q.Q5_1: 5e-2,
    Q.Q4_0: 1e-1,
    Q.Q4_1: 1e-1,
}


@pytest.mark.parametrize("qtype", list(QUANT_ERROR), ids=lambda q: q.name)
def test_quantized_weights_dequantize_to_their_source(llama_dir, tmp_path, qtype) -> None:
    path = tmp_path / "m.gguf"
    source = write_gguf(llama_dir, path, encoder(qtype))
    cfg = read_model_config(path)
    loaded = dict(gguf_tensors(path, cfg))
    assert set(loaded) == {hf_name(n) for n in source}
    for name, src in source.items():
        got = loaded[hf_name(name)].numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            got = llama_permute(got, heads)  # back into the file's row order
        assert got.shape == src.shape, name
        error = np.abs(got - src).max() / np.abs(src).max()
        assert error <= QUANT_ERROR[qtype if src.ndim == 2 else Q.F32], (name, error)


# K-quant block layouts: bytes per 256 weights, and where the fp16 super-block scales sit.
K_QUANTS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda q: q.name)
def test_k_quants_load_as_gguf_dequantizes_them(tmp_path, qtype) -> None:
    """gguf has no K-quant quantizer: random blocks with sane fp16 scales, checked against
    gguf's reference dequantization of the same bytes, row for row (a 256-wide model)."""
    hf_dir = make_tiny_model(
        tmp_path / "wide",
        TinyModelSpec(hidden_size=256, intermediate_size=256, num_hidden_layers=1, seed=3),
    )
    block_bytes, scale_offsets = K_QUANTS[qtype]
    rng = np.random.default_rng(0)
    stored: dict[tuple[int, ...], list[np.ndarray]] = {}

    def random_blocks(w: np.ndarray) -> tuple[np.ndarray, Q]:
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, block_bytes), np.uint8)
        for off in scale_offsets:  # a different scale per row, so a row mix-up shows
            scales = (0.01 + 0.001 * np.arange(w.shape[0])).astype(np.float16)
            blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(-1, 1, 2)
        data = blocks.reshape(w.shape[0], -1)
        stored.setdefault(w.shape, []).append(data)
        return data, qtype

    path = tmp_path / "k.gguf"
    source = write_gguf(hf_dir, path, random_blocks)
    cfg = read_model_config(path)
    loaded = dict(gguf_tensors(path, cfg))
    remaining = {shape: list(datas) for shape, datas in stored.items()}
    for name, src in source.items():  # written in this order, so stored data pairs up
        if src.ndim != 2:
            continue
        data = remaining[src.shape].pop(0)
        expected = dequantize(data, qtype).reshape(src.shape)
        got = loaded[hf_name(name)].numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            got = llama_permute(got, heads)
        assert np.isfinite(expected).all() and np.abs(expected).max() > 0
        np.testing.assert_array_equal(got, expected, err_msg=name)


def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), kv_cache_tokens=256)
    return str(info.value)


def test_bad_gguf_files_are_clear_load_errors(llama_dir, tmp_path) -> None:
    good = tmp_path / "good.gguf"
    write_gguf(llama_dir, good)

    other = tmp_path / "gpt2.gguf"
    write_gguf(llama_dir, other, arch="gpt2")
    assert "architecture 'gpt2' is not supported" in _load_error(other)

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "truncated or corrupt" in _load_error(truncated)

    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    assert "not a readable GGUF file" in _load_error(not_gguf)

    assert "no GGUF file at" in _load_error(tmp_path / "missing.gguf")

    iq = tmp_path / "iq.gguf"  # a real type this engine does not dequantize
    write_gguf(
        llama_dir,
        iq,
        lambda w: (np.zeros((w.shape[0], w.shape[1] // 32 * 18), np.uint8), Q.IQ4_NL),
    )
    assert "quantization type(s) IQ4_NL not supported" in _load_error(iq)

    odd = tmp_path / "odd.gguf"  # a type id no GGML release defines
    data = bytearray(good.read_bytes())
    # tensor info: name, n_dims (u32), dims (u64 each), then the type id (u32)
    first_type = data.find(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 8 * 2
    data[first_type : first_type + 4] = (250).to_bytes(4, "little")
    odd.write_bytes(bytes(data))
    assert "not a readable GGUF file" in _load_error(odd)


def test_cli_reports_a_bad_gguf_in_one_line(llama_dir, tmp_path) -> None:
    bad = tmp_path / "gpt2.gguf"
    write_gguf(llama_dir, bad, arch="gpt2")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.server.cli",
            "generate",
            "--model",
            str(bad),
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "tandem generate:" in proc.stderr and "'gpt2' is not supported" in proc.stderr
