"""Prompt logprobs over HTTP (engine, aggregated proxy, P/D proxy): OpenAI's ``echo`` with
``logprobs`` on ``/v1/completions`` (what lm-evaluation-harness's ``local-completions`` reads
for loglikelihood) and vLLM's ``prompt_logprobs``, equal to transformers' log-softmax."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from ..hf_reference import hf_model
from ..model_specs import on_gpu
from ..proxy.utils import FRONTS, front_of, openai_client

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox jumps over the lazy dog because"
# float32 on CPU: transformers' to 2e-5; the GPU run's engines are bfloat16 (TANDEM_TEST_GPU).
TOL = 0.1 if on_gpu() else 2e-5


@pytest.fixture(params=FRONTS)
def front(request, stack) -> tuple[str, dict[str, str]]:
    return front_of(stack, request.param)


@pytest.fixture(scope="module")
def reference(llama_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(llama_dir))(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = hf_model(str(llama_dir))(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def test_echo_with_logprobs_is_the_prompt_then_the_completion(front, reference) -> None:
    ids, ref = reference
    client = openai_client(*front)
    for prompt in (PROMPT, ids):  # text, and token ids as lm-eval sends them
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(PROMPT)
        assert len(lp.token_logprobs) == len(ids) + 2
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < TOL
            assert len(lp.top_logprobs[p]) <= 2
            assert max(lp.top_logprobs[p].values()) == pytest.approx(
                ref[p - 1].max().item(), abs=TOL
            )
        # the first generated token's logprob follows the whole prompt
        assert abs(lp.token_logprobs[len(ids)] - ref[-1].max().item()) < TOL
        assert lp.text_offset == sorted(lp.text_offset)


def test_vllm_prompt_logprobs_on_completions_and_chat(front, reference) -> None:
    ids, ref = reference
    url, headers = front
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 1}, headers=headers)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        entry = lps[p][str(ids[p])]
        assert abs(entry["logprob"] - ref[p - 1, ids[p]].item()) < TOL
        assert entry["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert entry["decoded_token"]
        best = str(int(ref[p - 1].argmax()))
        assert lps[p][best]["rank"] == 1
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(
        f"{url}/v1/chat/completions", json={**chat, "prompt_logprobs": 0}, headers=headers
    )
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    assert got[0] is None and all(len(e) == 1 for e in got[1:])


def test_echo_logprobs_stream_equals_non_stream(front) -> None:
    client = openai_client(*front)
    args = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**args).choices[0].logprobs
    tokens: list[float | None] = []
    for chunk in client.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.token_logprobs


def test_bad_prompt_logprobs_are_400(front) -> None:
    url, headers = front
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for bad in (-1, 100, "x"):
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "prompt_logprobs": bad}, headers=headers
        )
        assert r.status_code == 400, (bad, r.text)
    with pytest.raises(openai.BadRequestError):
        openai_client(*front).completions.create(
            model="tiny",
            prompt="hi",
            max_tokens=1,
            extra_body={"prompt_logprobs": 1, "session_id": "s"},
        )
