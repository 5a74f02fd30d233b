"""HuggingFace transformers as the reference: greedy continuations and per-step log-probs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    return model.eval()


def hf_greedy(
    model_dir: Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    **generate_kwargs: object,
) -> tuple[list[int], torch.Tensor]:
    """Token ids and the raw logits [steps, vocab] of ``generate`` on one unpadded prompt."""
    model = hf_model(str(model_dir), dtype)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
            **generate_kwargs,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, torch.stack([lg[0] for lg in out.logits]).float()


@lru_cache(maxsize=4)
def peft_model(model_dir: str, adapters: tuple[tuple[str, str], ...]):
    """The base model with every adapter (name, path) loaded by PEFT, float32."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    (first, path), *rest = adapters
    model = peft.PeftModel.from_pretrained(base, path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def peft_greedy(
    model_dir: Path,
    adapters: dict[str, Path],
    name: str | None,
    prompt_ids: list[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy token ids of PEFT + transformers through adapter ``name`` (None: the base)."""
    import contextlib

    model = peft_model(str(model_dir), tuple((n, str(p)) for n, p in adapters.items()))
    if name is not None:
        model.set_adapter(name)
    scope = model.disable_adapter() if name is None else contextlib.nullcontext()
    with torch.no_grad(), scope:
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
