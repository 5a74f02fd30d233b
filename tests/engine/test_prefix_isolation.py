"""Prefix-cache isolation (issue "No client can hurt another", finding A; docs/security.md).

Key A sends a secret; key B guesses it and reads ``usage.prompt_tokens_details.cached_tokens``.
Against real ``tandem serve`` processes on loopback: with the default ``--prefix-cache-scope
key`` the right guess reads 0 like a wrong one, while each key still hits its own cache; with
``global`` the keys share; ``cache_salt`` partitions within a key.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tandem.server.engine.input_processor import InputProcessor
from tandem.server.engine.prefix_cache import ROOT_HASH, chain_hashes, salted_root

from ..utils import ENGINE_FLAGS, ServerProcess

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
SECRET = list(range(100, 150))  # 50 tokens: three full blocks of 16 (48 cacheable)


def _cached(url: str, key: str, prompt: list[int], **extra: object) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(
        url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _server(llama_dir: Path, tmp_path: Path, *flags: str) -> ServerProcess:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    server = ServerProcess(
        str(llama_dir),
        *ENGINE_FLAGS,
        "--block-size",
        "16",
        "--api-key-file",
        str(keys),
        *flags,
        log_path=tmp_path / "serve.log",
    )
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def test_salt_changes_every_block_of_the_chain() -> None:
    tokens = list(range(64))
    shared = chain_hashes(tokens, 16)
    salted = chain_hashes(tokens, 16, root=salted_root("a"))
    assert salted_root(None) == ROOT_HASH
    assert not set(shared) & set(salted)
    assert salted_root("a") == salted_root("a") != salted_root("b")


def test_partition_follows_the_scope() -> None:
    """Only the key is dropped under ``global``; ``cache_salt`` always partitions."""
    inputs = InputProcessor.__new__(InputProcessor)
    roots = {}
    for scope in ("key", "global"):
        inputs.prefix_cache_scope = scope
        for tenant, salt in [(None, None), ("a", None), ("b", None), ("a", "s"), (None, "s")]:
            with inputs.cache_partition(tenant, salt):
                roots[scope, tenant, salt] = inputs._cache_root
            assert inputs._cache_root == ROOT_HASH  # reset after the add
    assert roots["key", None, None] == ROOT_HASH
    assert len({roots["key", t, s] for t, s in [(None, None), ("a", None), ("b", None)]}) == 3
    assert roots["global", "a", None] == roots["global", "b", None] == ROOT_HASH
    assert roots["global", "a", "s"] == roots["global", None, "s"] != ROOT_HASH
    assert roots["key", "a", "s"] != roots["key", "a", None]


def test_one_key_cannot_read_another_keys_prompt(llama_dir: Path, tmp_path: Path) -> None:
    server = _server(llama_dir, tmp_path)
    try:
        url = server.url
        assert _cached(url, KEY_A, SECRET, session_id="secret") == 0
        assert _cached(url, KEY_A, SECRET) == 48  # A hits its own blocks
        wrong = SECRET[:32] + [7] * 18
        assert _cached(url, KEY_B, SECRET) == 0  # the right guess reads like...
        assert _cached(url, KEY_B, [9] * 50) == 0  # ...a wrong one
        assert _cached(url, KEY_B, SECRET) == 48  # B hits its own cache
        assert _cached(url, KEY_A, wrong) == 32  # and A still hits its own
        # cache_salt partitions within a key, and matches only the same salt
        assert _cached(url, KEY_A, SECRET, cache_salt="alice") == 0
        assert _cached(url, KEY_A, SECRET, cache_salt="alice") == 48
        assert _cached(url, KEY_B, SECRET, cache_salt="alice") == 0
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": SECRET, "max_tokens": 1, "cache_salt": ""},
            headers={"Authorization": f"Bearer {KEY_A}"},
            timeout=60,
        )
        assert r.status_code == 400 and "cache_salt" in r.text
    finally:
        server.stop()


@pytest.mark.parametrize("scope", ["global"])
def test_global_scope_shares_across_keys(llama_dir: Path, tmp_path: Path, scope: str) -> None:
    server = _server(llama_dir, tmp_path, "--prefix-cache-scope", scope)
    try:
        url = server.url
        assert _cached(url, KEY_A, SECRET) == 0
        assert _cached(url, KEY_B, SECRET) == 48
        assert _cached(url, KEY_B, SECRET, cache_salt="x") == 0  # the salt still partitions
        assert _cached(url, KEY_A, SECRET, cache_salt="x") == 48
    finally:
        server.stop()
