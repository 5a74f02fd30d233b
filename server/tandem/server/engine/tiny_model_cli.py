"""``tandem make-tiny-model DIR --arch llama|qwen2|qwen3 [--seed N]``."""

from __future__ import annotations

import argparse
import dataclasses

from .tiny_model import ARCHS, TinyModelSpec, make_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="the architecture")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the weights' dtype",
    )
    parser.add_argument("--max-shard-size", default=None, help="shard the safetensors, e.g. 200KB")
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=int,
            default=None,
            help=f"the config's {name} (default: the tiny spec's)",
        )


def run(args: argparse.Namespace) -> int:
    fields = {f.name for f in dataclasses.fields(TinyModelSpec)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    path = make_tiny_model(args.dir, TinyModelSpec(**given))
    print(path)
    return 0
