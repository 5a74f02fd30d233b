"""The ``tandem`` command: one entry point, a subcommand per program.

Each subcommand lives with the code it runs and registers itself here through
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tandem.server.parent_watch import die_with_parent

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
    "make-draft": (
        "tandem.server.engine.spec_decode.layer_draft",
        "Write a draft model for --speculative-method draft: a model's first layers",
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


class Formatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless its text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        default = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {default})".lstrip()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="LLM serving with prefill and decode in tandem"
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=Formatter)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # a child of tandem up goes when it goes (parent_watch.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=command if command in SUBCOMMANDS else None).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
