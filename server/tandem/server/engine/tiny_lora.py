"""``tandem make-tiny-lora``: a random PEFT LoRA adapter for a tiny model (``tiny_model``).

Made with ``peft`` itself (``get_peft_model`` + ``save_pretrained``), so the files are
exactly what a real fine-tune leaves behind, and the tests hold the engine to PEFT's own
forward. PEFT starts B at zero (a fresh adapter changes nothing); here both A and B are
drawn from one seeded generator (std 0.2, the tiny models' own), so an adapter moves greedy
outputs away from the base model's and an exactness test through it means something.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TinyLoraSpec:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    seed: int = 0
    init_std: float = 0.2
    use_rslora: bool = False


def make_tiny_lora(model_dir: str | Path, out_dir: str | Path, spec: TinyLoraSpec) -> Path:
    """Write a PEFT adapter for the model at ``model_dir`` into ``out_dir``."""
    import peft
    import transformers

    unknown = set(spec.targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown target modules {sorted(unknown)}; choose from {TARGETS}")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        use_rslora=spec.use_rslora,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(spec.init_std * torch.randn(p.shape, generator=g))
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out
