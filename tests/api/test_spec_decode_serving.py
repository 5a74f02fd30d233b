"""``tandem serve --speculative-method ngram`` end to end: the official client's greedy
completions equal a server without speculation's, stream or not, and /health and /metrics
show the proposals verified (vLLM's counters)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from ..utils import ServerProcess, serving

# Random-weights models seldom repeat themselves: long outputs of several prompts do.
PROMPTS = [
    "one two three four five six seven eight. one two three four five six seven eight. one",
    "The scheduler decides, at every step, which requests run",
    "def generate(prompt, max_tokens=16):\n    tokens = tokenizer.encode(prompt)",
    "Numbers matter: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987. " * 3,
]


@pytest.fixture(scope="module")
def servers(llama_dir: Path):
    plain = ServerProcess(str(llama_dir), "--kv-cache-tokens", "4096")
    spec = ServerProcess(
        str(llama_dir),
        "--kv-cache-tokens",
        "4096",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "3",
    )
    with serving(plain), serving(spec):
        yield plain, spec


def _complete(server: ServerProcess, stream: bool) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = dict(model="tiny", prompt=PROMPTS, max_tokens=128, temperature=0.0, logprobs=1)
    texts = [""] * len(PROMPTS)
    if not stream:
        for c in client.completions.create(**kw).choices:
            texts[c.index] = c.text
        return texts
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_a_server_without_speculation(servers, stream: bool) -> None:
    plain, spec = servers
    assert _complete(spec, stream) == _complete(plain, stream)


def test_health_and_metrics_show_the_proposals(servers) -> None:
    plain, spec = servers
    _complete(spec, False)
    health = spec.wait_idle()
    info = health["spec_decode"]
    assert info["num_drafts"] > 0 and info["num_draft_tokens"] >= info["num_accepted_tokens"]
    assert len(info["accepted_per_position"]) == 3
    assert sum(info["accepted_per_position"]) == info["num_accepted_tokens"]
    assert "spec_decode" not in plain.health()
    text = httpx.get(spec.url + "/metrics", timeout=10).text
    drafted = re.search(r'vllm:spec_decode_num_draft_tokens_total\{model_name="tiny"\} (\S+)', text)
    assert drafted is not None and float(drafted.group(1)) == info["num_draft_tokens"]
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in text
    )
    assert "vllm:spec_decode" not in httpx.get(plain.url + "/metrics", timeout=10).text
