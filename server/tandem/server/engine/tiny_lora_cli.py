"""``tandem make-tiny-lora MODEL_DIR OUT_DIR [--rank R] [--targets q_proj,v_proj] [--seed N]``."""

from __future__ import annotations

import argparse

from .tiny_lora import TARGETS, TinyLoraSpec, make_tiny_lora


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the base model's directory (tandem make-tiny-model)")
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--rank", type=int, default=TinyLoraSpec.rank, help="the adapter's rank r")
    parser.add_argument(
        "--alpha", type=float, default=TinyLoraSpec.alpha, help="lora_alpha (scaling alpha/r)"
    )
    parser.add_argument(
        "--targets",
        default=",".join(TinyLoraSpec.targets),
        help=f"comma-separated modules to adapt, of {','.join(TARGETS)}",
    )
    parser.add_argument(
        "--seed", type=int, default=TinyLoraSpec.seed, help="the random weights' seed"
    )
    parser.add_argument("--use-rslora", action="store_true", help="rsLoRA's scaling alpha/sqrt(r)")


def run(args: argparse.Namespace) -> int:
    spec = TinyLoraSpec(
        rank=args.rank,
        alpha=args.alpha,
        targets=tuple(t for t in args.targets.split(",") if t),
        seed=args.seed,
        use_rslora=args.use_rslora,
    )
    print(make_tiny_lora(args.model, args.dir, spec))
    return 0
