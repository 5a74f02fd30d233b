"""``tandem make-tiny-model``: a small random-weight model in HuggingFace format.

It is the embedded default model and the fixture of the tests, so it must exercise what
real checkpoints do (a byte-level BPE tokenizer with special tokens and a chat template,
GQA, biases, q/k norms, tied embeddings) while staying small enough for a CPU. Weights are
drawn with std 0.2 rather than transformers' 0.02: a model that small initialised with
0.02 repeats one token under greedy decoding, and an exactness test on that proves nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .paths import cache_dir

ARCHS = ("llama", "qwen2", "qwen3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    max_shard_size: str | None = None
    init_std: float = 0.2


def corpus_lines() -> list[str]:
    text = (
        resources.files("tandem.server.engine")
        .joinpath("data/corpus.txt")
        .read_text(encoding="utf-8")
    )
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the shipped corpus: every UTF-8 string encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = corpus_lines()
    tok.train_from_iterator([line + "\n" for line in lines], trainer)
    return tok


def _hf_config(spec: TinyModelSpec, vocab: int, eos: int, pad: int):
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=spec.init_std,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    if spec.arch == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, attention_bias=False, **common)
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(
            tie_word_embeddings=True, use_sliding_window=False, **common
        )
    if spec.arch == "qwen3":
        head_dim = (
            2 * spec.hidden_size // spec.num_attention_heads
        )  # differs from hidden/heads on purpose
        return transformers.Qwen3Config(
            tie_word_embeddings=True, head_dim=head_dim, use_sliding_window=False, **common
        )
    raise ValueError(f"unknown arch {spec.arch!r}; choose from {ARCHS}")


def _randomise(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every parameter random (norm weights near 1, biases small), from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.vocab_size)
    vocab = tok.get_vocab_size()
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = _hf_config(spec, vocab, eos, pad)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, spec.seed, spec.init_std)
    model = model.to(getattr(torch, spec.dtype))
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, do_sample=False
    )
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "additional_special_tokens": ["<|im_start|>"],
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "model_max_length": spec.max_position_embeddings,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": ["<|im_start|>"],
            },
            indent=2,
        )
    )
    return out


def default_model_dir(arch: str = "llama", seed: int = 0) -> Path:
    """The embedded default: made on first use into the user's cache, then reused."""
    path = cache_dir() / f"tiny-{arch}-seed{seed}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, TinyModelSpec(arch=arch, seed=seed))
        tmp.rename(path) if not path.exists() else None
    return path
