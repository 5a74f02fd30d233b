"""``tandem generate``: run prompts through the engine offline and print the completions.

A chat model (its tokenizer has a chat template) gets each prompt as a user's message,
rendered by the template, as ``/v1/chat/completions`` would: an instruct model given the
bare text of a question often answers nothing. ``--raw`` sends the text as it is."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

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
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    parser.add_argument(
        "--sampling-seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="the draw's seed (default: none, a fresh one each run)",
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        help="send each prompt as it is, without the model's chat template (default: the "
        "template, for a model that has one)",
    )
    add_engine_arguments(parser)


def chat_prompts(tokenizer: Any, prompts: list[str], raw: bool) -> list[str | list[int]]:
    """Each prompt as a user's message in the chat template (token ids), unless ``raw`` or
    the model has no template."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(prompts)
    out: list[str | list[int]] = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


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
    prompts = chat_prompts(llm.tokenizer, args.prompt, args.raw)
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
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
