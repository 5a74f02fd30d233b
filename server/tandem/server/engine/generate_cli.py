"""``tandem generate``: run prompts through the engine offline and print the completions."""

from __future__ import annotations

import argparse
import json
import sys

from .engine_args import add_engine_arguments, engine_config_from_args
from .llm import LLM
from .sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="an HF-format model directory or a .gguf file (default: smollm2-135m-instruct, "
        "downloaded once into the cache)",
    )
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt; repeat for a batch"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .default_model import one_line, resolve_model
    from .models.config import ModelLoadError

    try:
        model, _ = resolve_model(args.model)
        llm = LLM.from_config(engine_config_from_args(args, model))
    except (ModelLoadError, ConfigError, OSError, ValueError) as exc:
        print(f"tandem generate: {one_line(exc)}", file=sys.stderr)
        return 1
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
        print(
            json.dumps(
                {
                    "prompt": prompt,
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                },
                ensure_ascii=False,
            )
        )
    return 0
