"""Fixtures the agent-API tests share: one engine, an aggregated proxy and a P/D proxy on the
tests' flags (a module that needs other flags, as test_routes.py does, defines its own
``stack``), and each front door with its client key."""

from __future__ import annotations

import pytest

from ..proxy.utils import FRONTS, engine_and_proxies, front_of
from ..utils import ENGINE_FLAGS
from .utils import LORA_PROMPT


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("stack")
    with engine_and_proxies(str(llama_dir), logs, *ENGINE_FLAGS) as s:
        yield s


@pytest.fixture(params=FRONTS)
def keyed_front(request, stack) -> tuple[str, str]:
    """``(url, key)`` of the engine, the aggregated proxy or the P/D proxy."""
    url, headers = front_of(stack, request.param)
    return url, headers.get("Authorization", "Bearer none").split()[-1]


@pytest.fixture(scope="session")
def lora_prompt_ids(tiny_models) -> list[int]:
    """The LoRA tests' prompt (``LORA_PROMPT``) as the tiny Llama's tokenizer encodes it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models["llama"])).encode(LORA_PROMPT)
