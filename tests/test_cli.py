"""The ``tandem`` command off the happy path: ``--version``, help text with a default for
every flag, ``tandem serve``'s safe defaults (loopback, its port checked before the model
loads), ``tandem generate`` through the chat template (``--raw`` without), and the
parent-death signal a child of ``tandem up`` arms."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from importlib.metadata import version

import pytest

from tandem.server.cli import SUBCOMMANDS, Formatter, build_parser
from tandem.server.engine.default_model import NAME, default_model_path

pytestmark = pytest.mark.timeout(300)


def _tandem(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version() -> None:
    r = _tandem("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tandem {version('tandem')}"


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_flag_has_help_text_with_its_default(command: str) -> None:
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    formatter = Formatter(prog="tandem")
    flags = [
        a
        for a in sub.choices[command]._actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
    ]
    assert flags
    for action in flags:
        text = formatter._get_help_string(action) or ""
        what = text.split("(default")[0].strip()
        assert what and "default" in text, (action.option_strings, text)


def test_serve_listens_on_loopback_by_default() -> None:
    parser = build_parser(only="serve")
    args = parser.parse_args(["serve"])
    assert args.host == "127.0.0.1"
    assert build_parser(only="proxy").parse_args(["proxy"]).host == "127.0.0.1"


def test_serve_checks_its_port_before_the_model() -> None:
    """A taken port is said first (the model here does not even exist: it is never read)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _tandem("serve", "--model", "/missing.gguf", "--port", str(port))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "no model" not in r.stderr


def test_generate_applies_the_chat_template_and_raw_does_not() -> None:
    default_model_path()  # fetched once, as the other default-model tests do
    ask = "What is the capital of France?"
    r = _tandem("generate", "--model", NAME, "--prompt", ask, "--max-tokens", "16", timeout=280)
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout.strip().splitlines()[-1])["text"]


def test_generate_raw_sends_the_text_as_is(tiny_models) -> None:
    """The tiny models have a chat template too: --raw must give the same tokens as the
    engine on the bare prompt, the default those of the templated one."""
    from tandem.server.engine import LLM, SamplingParams
    from tandem.server.engine.generate_cli import chat_prompts

    model = str(tiny_models["llama"])
    llm = LLM(model, kv_cache_tokens=2048)
    greedy = SamplingParams(temperature=0, max_tokens=6)  # what the command samples
    bare, templated = (
        llm.generate(chat_prompts(llm.tokenizer, ["Hello"], raw), greedy)[0].token_ids
        for raw in (True, False)
    )
    assert bare != templated
    outs = {}
    for flag in ("--raw", None):
        args = ["generate", "--model", model, "--prompt", "Hello", "--max-tokens", "6"]
        r = _tandem(*args, *([flag] if flag else []))
        assert r.returncode == 0, r.stderr
        outs[flag] = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    assert outs["--raw"] == bare and outs[None] == templated


def test_a_child_whose_parent_is_gone_ends_itself() -> None:
    """``die_with_parent`` with a parent id that is not the caller's parent (it died before
    the signal was armed) ends the process with SIGTERM at once."""
    code = (
        "import os, time\n"
        "from tandem.server.parent_watch import PARENT_ENV, die_with_parent\n"
        "os.environ[PARENT_ENV] = '1' if os.getppid() != 1 else '2'\n"
        "die_with_parent()\n"
        "time.sleep(30)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -15
