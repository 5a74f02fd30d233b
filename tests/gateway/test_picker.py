"""The picker's side of the endpoint picker protocol over real gRPC, in process: engines are
registry entries marked healthy by hand (no model), the gateway is a gRPC stub sending what
Envoy sends. The subset hint, the endpoint in header and metadata, stripping the picker's
headers from clients, shedding, the P/D header's signature and the health services."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.server.picker.choice import Picker, PickerConfig
from tandem.server.picker.scrape import EngineMetrics, parse_metrics
from tandem.server.picker.server import PickerSettings, running_picker
from tandem.server.picker.service import ExternalProcessor
from tandem.server.proxy.registry import Registry
from tandem.server.wire.trust import PREFILLER_HEADER, PREFILLER_SIGNATURE_HEADER, prefiller_valid

SECRET = "sk-internal"
ENGINES = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def _registry(prefill: bool = False) -> Registry:
    registry = Registry()
    for url in ENGINES:
        registry.add(url, "decode" if prefill else "both", ["tiny"], source="static").healthy = True
    if prefill:
        registry.add("http://10.0.1.1:8000", "prefill", ["tiny"], source="static").healthy = True
    return registry


def _headers(path: str, extra: dict[str, str] | None = None, eos: bool = False):
    pairs = {":method": "POST", ":path": path, "content-type": "application/json", **(extra or {})}
    return ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=eos,
    )


def _messages(body: dict, subset: list[str] | None = None, extra=None):
    first = ext_proc.ProcessingRequest(request_headers=_headers("/v1/completions", extra))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    raw = json.dumps(body).encode()
    half = len(raw) // 2
    return [
        first,
        ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=raw[:half])),
        ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=raw[half:], end_of_stream=True)
        ),
    ]


async def _exchange(picker: Picker, messages) -> list[ext_proc.ProcessingResponse]:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ext_proc_grpc.ExternalProcessorStub(channel)

            async def send() -> AsyncIterator[ext_proc.ProcessingRequest]:
                for m in messages:
                    yield m

            return [r async for r in stub.Process(send())]
    finally:
        await server.stop(None)


def _run(picker: Picker, messages) -> list[ext_proc.ProcessingResponse]:
    return asyncio.run(_exchange(picker, messages))


def _set(response: ext_proc.ProcessingResponse) -> dict[str, str]:
    mutation = response.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


BODY = {"model": "tiny", "prompt": "Once upon a time " * 20, "max_tokens": 4}


def test_the_endpoint_comes_back_in_the_header_and_the_metadata_then_the_body() -> None:
    responses = _run(Picker(_registry(), PickerConfig()), _messages(BODY))
    headers, body = responses
    endpoint = _set(headers)["x-gateway-destination-endpoint"]
    assert endpoint in {u.removeprefix("http://") for u in ENGINES}
    meta = headers.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == endpoint
    assert headers.request_headers.response.clear_route_cache
    streamed = body.request_body.response.body_mutation.streamed_response
    assert json.loads(streamed.body) == BODY and streamed.end_of_stream
    assert int(_set(headers)["content-length"]) == len(streamed.body)


def test_the_subset_hint_limits_the_choice_and_an_empty_one_is_a_503() -> None:
    registry = _registry()
    picker = Picker(registry, PickerConfig())
    for _ in range(4):
        (headers, _) = _run(picker, _messages(BODY, subset=["10.0.0.3:8000"]))
        assert _set(headers)["x-gateway-destination-endpoint"] == "10.0.0.3:8000"
    (refused,) = _run(picker, _messages(BODY, subset=["10.9.9.9:8000"]))
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "no_engine_available"


def test_a_clients_picker_headers_are_never_passed_on() -> None:
    forged = {
        PREFILLER_HEADER: "169.254.169.254:80",
        PREFILLER_SIGNATURE_HEADER: "1.deadbeef",
        "x-gateway-destination-endpoint": "169.254.169.254:80",
    }
    (headers, _) = _run(Picker(_registry(), PickerConfig()), _messages(BODY, extra=forged))
    mutation = headers.request_headers.response.header_mutation
    assert set(mutation.remove_headers) == {PREFILLER_HEADER, PREFILLER_SIGNATURE_HEADER}
    assert _set(headers)["x-gateway-destination-endpoint"].startswith("10.0.0.")
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert all(h.append_action == overwrite for h in mutation.set_headers)


def test_pd_names_the_prefill_engine_signed_with_the_internal_credential() -> None:
    picker = Picker(_registry(prefill=True), PickerConfig(disagg_threshold=0, internal_key=SECRET))
    (headers, _) = _run(picker, _messages(BODY))
    sets = _set(headers)
    assert sets[PREFILLER_HEADER] == "10.0.1.1:8000"
    assert sets["x-gateway-destination-endpoint"].startswith("10.0.0.")
    assert prefiller_valid(SECRET, "10.0.1.1:8000", sets[PREFILLER_SIGNATURE_HEADER], time.time())
    assert not prefiller_valid(
        SECRET, "10.0.9.9:8000", sets[PREFILLER_SIGNATURE_HEADER], time.time()
    )
    # n > 1 cannot be split: no prefill engine named, and any client copy removed
    (headers, _) = _run(picker, _messages({**BODY, "n": 2}))
    assert PREFILLER_HEADER not in _set(headers)


def test_a_session_stays_on_the_engine_holding_it_for_its_caller() -> None:
    """A turn may send only its new message: no prefix to follow, the session table holds it."""
    picker = Picker(_registry(), PickerConfig())
    first = {"model": "tiny", "prompt": "Opening turn " * 20, "session_id": "s1"}
    (headers, _) = _run(picker, _messages(first, extra={"authorization": "Bearer k1"}))
    held = _set(headers)["x-gateway-destination-endpoint"]
    for node in picker.registry.nodes():  # make the holder the busiest: it still gets the turn
        node.pending = 9 if node.url.endswith(held) else 0
    turn = {"model": "tiny", "prompt": "next", "session_id": "s1"}
    (headers, _) = _run(picker, _messages(turn, extra={"authorization": "Bearer k1"}))
    assert _set(headers)["x-gateway-destination-endpoint"] == held
    (headers, _) = _run(picker, _messages(turn, extra={"authorization": "Bearer k2"}))
    assert _set(headers)["x-gateway-destination-endpoint"] != held  # another key's session


def test_full_queues_are_shed_with_a_429() -> None:
    registry = _registry()
    for node in registry.nodes():
        node.pending = 8
    (refused,) = _run(Picker(registry, PickerConfig(shed_queue=8)), _messages(BODY))
    assert refused.immediate_response.status.code == 429
    registry.nodes()[0].pending = 7
    (headers, _) = _run(Picker(registry, PickerConfig(shed_queue=8)), _messages(BODY))
    assert _set(headers)["x-gateway-destination-endpoint"] == "10.0.0.1:8000"


def test_a_bodiless_request_is_routed_on_its_headers() -> None:
    message = ext_proc.ProcessingRequest(request_headers=_headers("/v1/models", eos=True))
    (headers,) = _run(Picker(_registry(), PickerConfig()), [message])
    assert "x-gateway-destination-endpoint" in _set(headers)


@pytest.mark.parametrize(
    "service", ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
)
def test_the_health_services_serve(service: str) -> None:
    async def check() -> int:
        async with running_picker(PickerSettings(), "127.0.0.1:0") as port:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                return reply.status

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


def test_fallback_endpoints_follow_the_chosen_one_best_first_in_header_and_metadata() -> None:
    """GIE protocol v0.4: ``ip:port,ip:port,...``, one value in both places. The engine
    holding the prompt's prefix comes first, then the less loaded of the others."""
    registry = _registry()
    picker = Picker(registry, PickerConfig(fallbacks=2))
    (headers, _) = _run(picker, _messages(BODY))
    first = _set(headers)["x-gateway-destination-endpoint"].split(",")[0]
    for node in registry.nodes():  # the holder busy, yet affinity keeps it first
        node.pending = {first: 2, "10.0.0.2:8000": 3}.get(node.url.removeprefix("http://"), 0)
    (headers, _) = _run(picker, _messages(BODY))
    listed = _set(headers)["x-gateway-destination-endpoint"]
    others = [u.removeprefix("http://") for u in ENGINES if not u.endswith(first)]
    assert listed.split(",") == [first, *sorted(others, key=lambda e: e == "10.0.0.2:8000")]
    meta = headers.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == listed
    (headers, _) = _run(Picker(registry, PickerConfig()), _messages(BODY))
    assert "," not in _set(headers)["x-gateway-destination-endpoint"]  # the default: one


def test_the_response_phases_pass_through_and_a_pick_counts_until_the_engines_scrape() -> None:
    """A gateway streaming the response through the picker (GIE's reference configuration)
    gets every chunk back unchanged; one sending no response phase ends the exchange after
    the request's body, and the pick then counts as load until a later scrape shows it."""
    picker = Picker(_registry(), PickerConfig())
    status = ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    )
    chunks = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    response = [
        ext_proc.ProcessingRequest(response_headers=status),
        *(
            ext_proc.ProcessingRequest(
                response_body=ext_proc.HttpBody(body=c, end_of_stream=i == len(chunks) - 1)
            )
            for i, c in enumerate(chunks)
        ),
        ext_proc.ProcessingRequest(response_trailers=ext_proc.HttpTrailers()),
    ]
    replies = _run(picker, _messages(BODY) + response)
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
        "response_body",
        "response_trailers",
    ]
    streamed = [r.response_body.response.body_mutation.streamed_response for r in replies[3:5]]
    assert [s.body for s in streamed] == chunks and streamed[-1].end_of_stream
    nodes = picker.registry.nodes()
    assert [picker.load(n) for n in nodes] == [0, 0, 0]  # answered: nothing held
    (headers, _) = _run(picker, _messages(BODY))  # no response phase
    chosen = next(
        n for n in nodes if n.url.endswith(_set(headers)["x-gateway-destination-endpoint"])
    )
    assert chosen.inflight == 0 and picker.load(chosen) == 1
    picker.scraped(chosen.url, started=time.monotonic() - 60)  # begun before the pick
    assert picker.load(chosen) == 1
    picker.scraped(chosen.url, started=time.monotonic())
    assert picker.load(chosen) == 0


def test_a_5xx_reprobes_the_engine_the_gateway_says_served() -> None:
    """Protocol v1.0: with fallbacks the gateway names the endpoint that answered
    (``envoy.lb`` / ``x-gateway-destination-endpoint-served``); that one is re-probed."""
    picker = Picker(_registry(), PickerConfig(fallbacks=2))
    probed: list[list[str]] = []
    picker.suspect = probed.append

    def answered(status: bytes, served: str | None) -> str:
        headers = ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":status", raw_value=status)]
            )
        )
        message = ext_proc.ProcessingRequest(response_headers=headers)
        if served is not None:
            meta = struct_pb2.Struct()
            meta.update({"x-gateway-destination-endpoint-served": served})
            message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
        (routed, _, _) = _run(picker, [*_messages(BODY), message])
        return _set(routed)["x-gateway-destination-endpoint"]

    assert len(answered(b"503", "10.0.0.2:8000").split(",")) == 3
    assert probed == [["http://10.0.0.2:8000"]]
    chosen = answered(b"503", None).split(",")[0]  # the gateway does not say: the chosen one
    assert probed[-1] == ["http://" + chosen]
    answered(b"200", "10.0.0.3:8000")
    assert len(probed) == 2


def test_the_scrape_reads_the_protocols_gauges_and_nothing_else() -> None:
    """Only the protocol's families reach the parser (the engine's histograms are skipped
    unparsed); a family whose name merely begins with a protocol name is not read as it;
    labelled series add up (one per model)."""
    text = (
        "# HELP tandem_step_seconds step time\n# TYPE tandem_step_seconds histogram\n"
        'tandem_step_seconds_bucket{le="0.1"} 3.0\ntandem_step_seconds_bucket{le="+Inf"} 3.0\n'
        "tandem_step_seconds_count 3.0\ntandem_step_seconds_sum 0.2\n"
        "# HELP vllm:num_requests_waiting_by_priority not the queue\n"
        "# TYPE vllm:num_requests_waiting_by_priority gauge\n"
        "vllm:num_requests_waiting_by_priority 9.0\n"
        "# HELP vllm:num_requests_waiting Requests waiting\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="a"} 2.0\n'
        'vllm:num_requests_waiting{model_name="b"} 1.0\n'
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4.0\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="256"} 1.0\n'
    )
    assert parse_metrics(text) == EngineMetrics(
        waiting=3, running=4, kv_usage=0.25, block_size=16, num_blocks=256
    )
    assert parse_metrics("# TYPE tandem_step_seconds histogram\n") == EngineMetrics()


def test_released_picks_count_until_their_horizon_then_are_dropped() -> None:
    """A pick released with no answer counts as load until a scrape begun after it, or
    ``UNSCRAPED_SECONDS`` at most; the count is kept pruned, not re-summed."""
    from tandem.server.picker import choice

    registry = _registry()
    picker = Picker(registry, PickerConfig())
    node = registry.get(ENGINES[0])
    routes = [
        picker.choose("/v1/completions", b'{"model": "tiny"}', frozenset({"10.0.0.1:8000"}))
        for _ in range(3)
    ]
    assert all(isinstance(r, choice.Route) for r in routes)
    for r in routes:
        picker.release(r, answered=False)
    assert node.inflight == 0 and picker.load(node) == 3
    picker._released[node.url][0] -= choice.UNSCRAPED_SECONDS + 1  # the oldest is past it
    assert picker.load(node) == 2 and len(picker._released[node.url]) == 2
    picker.scraped(node.url, started=time.monotonic())
    assert picker.load(node) == 0
