"""A replica that spans nodes: two real ``tandem serve`` processes, a leader (node 0) and a
worker (node 1), run tensor_parallel_size 2 across them, joined over loopback at the leader's
address (gloo on CPU), as two pods of a LeaderWorkerSet group join at LWS_LEADER_ADDRESS.

Their greedy tokens, read through the openai client, equal one process's and transformers'.
The worker serves no HTTP and exits 0 when the leader stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tandem.server.engine.config import ConfigError, EngineConfig
from tandem.server.net import free_port

from ..hf_reference import hf_greedy
from ..utils import ENGINE_FLAGS, ServerProcess, make_model, wait_until

PROMPTS = [[5, 17, 99, 300, 41], list(range(40, 90)), [7, 8] * 15]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(tmp_path_factory.mktemp("multinode"))


@contextlib.contextmanager
def leader_and_worker(model: str, logs: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(leader, worker): one engine whose two ranks are two ``tandem serve`` processes,
    the leader serving; both stopped afterwards, passed or failed."""
    flags = [*ENGINE_FLAGS, "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2"]
    flags += ["--leader-addr", f"127.0.0.1:{free_port()}", "--log-level", "info"]
    leader = ServerProcess(model, *flags, "--node-rank", "0", log_path=logs / "leader.log")
    worker = ServerProcess(model, *flags, "--node-rank", "1", log_path=logs / "worker.log")
    try:
        leader.wait_ready(timeout=300)
        yield leader, worker
    finally:
        leader.stop()
        worker.stop()


@pytest.fixture(scope="module")
def group(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    with leader_and_worker(model, tmp_path_factory.mktemp("multinode-logs")) as pair:
        yield pair


def greedy_ids(server: ServerProcess, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return out.choices[0].model_extra["token_ids"]


def test_leader_and_worker_give_one_process_greedy_tokens(
    model: str, group: tuple, tmp_path: Path
) -> None:
    leader, worker = group
    one = ServerProcess(model, *ENGINE_FLAGS, "--device", "cpu", log_path=tmp_path / "one.log")
    try:
        one.wait_ready(timeout=300)
        alone = [greedy_ids(one, p) for p in PROMPTS]
    finally:
        one.stop()
    reference = [hf_greedy(Path(model), p, MAX_TOKENS)[0] for p in PROMPTS]
    assert len({t for ids in reference for t in ids}) > 10  # varied, or equality proves little
    assert alone == reference
    assert [greedy_ids(leader, p) for p in PROMPTS] == reference
    assert worker.proc.poll() is None  # it ran its rank all along
    assert "following the leader's steps" in worker.log_tail()


def test_the_worker_serves_nothing_and_exits_when_the_leader_stops(model: str, tmp_path) -> None:
    with leader_and_worker(model, tmp_path) as (leader, worker):
        assert greedy_ids(leader, PROMPTS[0])
        assert leader.stop() == 0
        wait_until(lambda: worker.proc.poll() is not None, 60, "the worker to exit")
        assert worker.proc.returncode == 0, worker.log_tail()
        assert "the leader said stop" in worker.log_tail()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(nnodes=2, tensor_parallel_size=2), "leader_addr as HOST:PORT"),
        (dict(nnodes=2, tensor_parallel_size=2, leader_addr="host"), "HOST:PORT"),
        (dict(nnodes=2, tensor_parallel_size=3, leader_addr="h:1"), "multiple of nnodes"),
        (dict(nnodes=2, node_rank=2, tensor_parallel_size=2, leader_addr="h:1"), "node_rank"),
        (dict(nnodes=0), "nnodes must be >= 1"),
    ],
)
def test_a_group_that_cannot_form_is_refused_before_loading(fields: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **fields)


def test_a_worker_with_a_bad_group_exits_1_with_one_line(model: str, tmp_path: Path) -> None:
    worker = ServerProcess(
        model,
        *("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"),
        log_path=tmp_path / "worker.log",
    )
    assert worker.proc.wait(120) == 1
    assert "nnodes > 1 needs leader_addr as HOST:PORT" in worker.log_tail()
    assert "Traceback" not in worker.log_tail()


def test_a_worker_that_dies_fails_the_leader_instead_of_hanging_it(
    model: str, tmp_path: Path
) -> None:
    """A group cannot take back a lost rank: the leader's next step fails, the engine exits
    non-zero (in a cluster LWS then recreates the whole group) rather than waiting forever."""
    with leader_and_worker(model, tmp_path) as (leader, worker):
        worker.proc.kill()
        worker.proc.wait(30)
        with pytest.raises(openai.APIError):
            greedy_ids(leader, PROMPTS[0])
        wait_until(lambda: leader.proc.poll() is not None, 120, "the leader to exit")
        assert leader.proc.returncode != 0
