"""Tandem behind a real Envoy configured as a Gateway API Inference Extension gateway: Envoy's
``ext_proc`` filter asks ``tandem epp`` for each request's engine and its ``ORIGINAL_DST``
cluster dials it. Three engines, the picker and Envoy are real processes on loopback, driven by
the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
import functools
import http.server
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.server.net import free_port
from tandem.server.picker.scrape import parse_metrics

from ..proxy.utils import kill, metric_value, stop_all
from ..utils import ENGINE_FLAGS, ServerProcess, wait_until
from .utils import EnvoyProcess, gie_gateway, original_dst_gateway, start_gateway

pytestmark = pytest.mark.timeout(400)

MODEL = "tiny"
# Ten 64-character chunks: a prefix the picker's affinity sees whole.
PREFIX = "You are a meticulous assistant who answers in one short line. " * 10


@pytest.fixture(scope="module")
def gateway(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("gateway")
    engines = [
        ServerProcess(str(llama_dir), *ENGINE_FLAGS, log_path=logs / f"engine{i}.log")
        for i in range(3)
    ]
    started: list = [*engines]
    try:
        for e in engines:
            e.wait_ready()
        nodes = [a for e in engines for a in ("--node", e.url)]
        flags = ["--health-interval", "0.3", "--metrics-interval", "0.2"]
        envoy = start_gateway(started, logs, *nodes, *flags)
        yield envoy, engines
    finally:
        stop_all(started[::-1])


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    envoy, _ = gateway
    return openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _served(engines: list[ServerProcess]) -> list[float]:
    """Requests each engine has finished so far."""
    return [
        metric_value(httpx.get(e.url + "/metrics").text, "tandem:request_success_total")
        for e in engines
    ]


def _delta(before: list[float], after: list[float]) -> list[int]:
    return [int(b - a) for a, b in zip(before, after)]


def test_the_engines_speak_the_model_server_protocol(gateway) -> None:
    """GIE proposal 003: the gauges a picker reads, with exactly these names and types."""
    _, engines = gateway
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(engines[0].url + "/metrics").text)
    }
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert families[name].type == "gauge", name
        assert len(families[name].samples) == 1
    (info,) = families["vllm:cache_config_info"].samples
    assert families["vllm:cache_config_info"].type == "gauge"
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    # and the picker reads them so
    read = parse_metrics(httpx.get(engines[0].url + "/metrics").text)
    assert (read.waiting, read.running, read.block_size) == (0, 0, 16)
    assert read.num_blocks == int(info.labels["num_gpu_blocks"]) and 0.0 <= read.kv_usage <= 1.0


def _answers_match_one_engine(client: openai.OpenAI, engine: ServerProcess) -> None:
    """Chat, a streamed completion and a bodiless GET through the gateway: the engine's own
    answers, token for token."""
    direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a prime number."}]
    want = direct.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    ref = direct.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0
    )
    assert text == ref.choices[0].text
    assert [m.id for m in client.models.list()] == [MODEL]  # a bodiless GET is routed too


def _burst_spreads(client: openai.OpenAI, engines: list[ServerProcess]) -> None:
    """Twelve requests at once on one prefix: affinity is worth about four queued requests,
    so the first engine's queue sends the rest elsewhere."""
    before = _served(engines)

    def one(i: int) -> None:
        client.completions.create(
            model=MODEL,
            prompt=PREFIX + f"Load {i}:",
            max_tokens=48,
            extra_body={"ignore_eos": True},
        )

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(12)))
    counts = _delta(before, _served(engines))
    assert sum(counts) == 12
    assert sum(1 for c in counts if c) >= 2, counts
    assert max(counts) <= 9, counts


def test_the_openai_client_gets_the_engines_answer_through_envoy(gateway, client) -> None:
    _, engines = gateway
    _answers_match_one_engine(client, engines[0])


@pytest.mark.parametrize("response", ["none", "streamed"])
def test_each_response_mode_a_gateway_may_configure(gateway, tmp_path, response: str) -> None:
    """The response's phases are the gateway's choice: none (the exchange ends with the
    request's body: each pick counts as load until the engine's next scrape shows it) or
    all of them, the body streamed through the picker as GIE's reference gateways do. Both
    give the engine's answers, streamed ones included, and spread a burst."""
    _, engines = gateway
    nodes = [a for e in engines for a in ("--node", e.url)]
    flags = ["--health-interval", "0.3", "--metrics-interval", "0.2"]
    started: list = []
    try:
        config = functools.partial(gie_gateway, response=response)
        envoy = start_gateway(started, tmp_path, *nodes, *flags, config=config)
        c = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
        _answers_match_one_engine(c, engines[0])
        _burst_spreads(c, engines)
    finally:
        stop_all(started[::-1])


def test_an_unknown_model_is_a_404_in_openais_shape(client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_requests_sharing_a_long_prefix_land_on_one_engine(gateway, client) -> None:
    _, engines = gateway
    before = _served(engines)
    for i in range(6):
        client.completions.create(model=MODEL, prompt=PREFIX + f"Question {i}:", max_tokens=4)
    counts = sorted(_delta(before, _served(engines)))
    assert counts == [0, 0, 6]


def test_load_spreads_when_queues_grow(gateway, client) -> None:
    _, engines = gateway
    _burst_spreads(client, engines)


def test_the_gateways_subset_hint_through_envoy(gateway, tmp_path) -> None:
    """A gateway that allows one engine (filter metadata ``envoy.lb.subset_hint``): every
    request lands there, whatever its prefix."""
    _, engines = gateway
    allowed = engines[2].url.removeprefix("http://")
    hinted = functools.partial(gie_gateway, subset=[allowed])
    nodes = [a for e in engines for a in ("--node", e.url)]
    started: list = []
    try:
        envoy = start_gateway(started, tmp_path, *nodes, "--health-interval", "0.3", config=hinted)
        c = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
        before = _served(engines)
        for i in range(4):
            c.completions.create(model=MODEL, prompt=f"{i} " + PREFIX, max_tokens=2)
        assert _delta(before, _served(engines)) == [0, 0, 4]
    finally:
        stop_all(started[::-1])


def test_an_engine_killed_mid_run_is_routed_around_within_seconds(gateway, client) -> None:
    _, engines = gateway
    before = _served(engines)
    client.completions.create(model=MODEL, prompt=PREFIX + "Before:", max_tokens=2)
    victim = engines[_delta(before, _served(engines)).index(1)]  # the prefix's engine
    kill(victim)
    killed_at = time.monotonic()

    def served() -> bool:
        try:
            client.completions.create(model=MODEL, prompt=PREFIX + "After:", max_tokens=2)
            return True
        except openai.APIStatusError as exc:
            assert exc.status_code == 503  # Envoy could not reach the dead engine
            return False

    wait_until(served, timeout=10, what="a request served after the kill")
    assert time.monotonic() - killed_at < 10
    alive = [e for e in engines if e is not victim]
    before = _served(alive)
    for i in range(4):
        client.completions.create(model=MODEL, prompt=PREFIX + f"Later {i}:", max_tokens=2)
    assert sum(_delta(before, _served(alive))) == 4


def test_with_no_engine_ready_the_client_gets_a_503(tmp_path) -> None:
    """The picker knows only an engine that does not answer: Envoy returns its 503."""
    started: list = []
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        envoy = start_gateway(started, tmp_path, "--node", dead, "--health-interval", "0.3")
        c = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        assert err.value.body["code"] == "no_engine_available"
        assert err.value.response.headers["retry-after"] == "15"
        picker = started[0]
        picker.proc.terminate()  # SIGTERM: a graceful stop
        assert picker.proc.wait(30) == 0
        assert "endpoint picker stopped" in picker.log_path.read_text()
    finally:
        stop_all(started[::-1])


def test_envoys_original_dst_takes_one_endpoint_not_a_fallback_list(tmp_path) -> None:
    """Why ``--fallback-endpoints`` is off by default: GIE's protocol lets the picker name
    ``ip:port,ip:port`` for a gateway to fall back down, but Envoy's ``ORIGINAL_DST`` cluster
    (GIE's reference routing) takes one address: a list, even with the live engine first and
    a retry policy, is an invalid host and a 503."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    live, dead = f"127.0.0.1:{upstream.server_port}", f"127.0.0.1:{free_port()}"
    envoy = EnvoyProcess(original_dst_gateway, tmp_path)
    try:
        envoy.wait_ready()

        def status(endpoints: str) -> int:
            r = httpx.get(envoy.url + "/", headers={"x-gateway-destination-endpoint": endpoints})
            return r.status_code

        assert status(live) == 200
        assert status(f"{live},{dead}") == status(f"{dead},{live}") == 503
        stats = httpx.get(f"http://127.0.0.1:{envoy.admin_port}/stats").text
        assert _envoy_stat(stats, "cluster.pool.original_dst_host_invalid") == 2
    finally:
        stop_all([envoy])
        upstream.shutdown()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the handler's name
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _envoy_stat(stats: str, name: str) -> int:
    """A counter from Envoy's admin ``/stats`` text (``name: value`` lines)."""
    return next(
        int(v) for n, _, v in (line.partition(": ") for line in stats.splitlines()) if n == name
    )
