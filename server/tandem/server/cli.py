"""The ``tandem`` command: one entry point, a subcommand per program.

Each subcommand lives with the code it runs and registers itself here through
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module providing add_arguments(parser) and run(args)
SUBCOMMANDS = {
    "make-tiny-model": (
        "tandem.server.engine.tiny_model_cli",
        "Write a small random-weight HF model",
    ),
    "make-tiny-lora": (
        "tandem.server.engine.tiny_lora_cli",
        "Write a random PEFT LoRA adapter for a tiny model",
    ),
    "generate": (
        "tandem.server.engine.generate_cli",
        "Generate offline from prompts with the engine",
    ),
    "serve": ("tandem.server.api.serve_cli", "Serve the OpenAI-compatible engine API"),
    "proxy": (
        "tandem.server.proxy.cli",
        "Run the P/D proxy: one OpenAI endpoint over many engines",
    ),
    "epp": (
        "tandem.server.picker.cli",
        "Run the endpoint picker a Gateway API Inference Extension gateway asks (ext_proc)",
    ),
    "up": ("tandem.server.local", "Run an InferenceService's proxy and engines as local processes"),
    "operator": ("tandem.operator.cli", "Run the Kubernetes operator (in or out of a cluster)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="LLM serving with prefill and decode in tandem"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=command if command in SUBCOMMANDS else None).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
