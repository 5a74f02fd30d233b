"""The proxy's pure pieces without servers: routing, the registry, discovery, the P/D flow's
request rewriting, and the app's own answers (auth, validation, no engines) in process."""

from __future__ import annotations

import pytest

from tandem.server.api.announce import node_body
from tandem.server.proxy import routing
from tandem.server.proxy.app import build_app
from tandem.server.proxy.discovery import PodTracker, parse_node_flag, pod_node
from tandem.server.proxy.registry import (
    DECODE_ROLES,
    PREFILL_ROLES,
    Registry,
    normalize_url,
)
from tandem.server.proxy.state import ProxySettings
from tandem.server.wire.auth import Credentials
from tandem.server.wire.prefill_step import prefill_request
from tandem.server.wire.roles import parse_role

from ..utils import call_app


# ----- routing ---------------------------------------------------------------------------------
def test_prompt_text_and_estimate() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ]
    }
    assert routing.prompt_text("chat", chat) == "<system>be terse\n<user>hi"
    assert routing.estimate_tokens("chat", chat) == len("<system>be terse\n<user>hi") // 4 + 2 * 4
    assert routing.estimate_tokens("completions", {"prompt": "x" * 400}) == 100
    assert (
        routing.estimate_tokens("completions", {"prompt": [1, 2, 3, 4, 5]}) == 5
    )  # token ids: exact
    assert routing.prompt_text("completions", {"prompt": ["first", "second"]}) == "first"


def test_chunk_hashes_are_a_prefix_chain() -> None:
    a = routing.chunk_hashes("a" * 64 + "b" * 64 + "c" * 10)
    b = routing.chunk_hashes("a" * 64 + "b" * 64 + "d" * 64)
    c = routing.chunk_hashes("z" * 64 + "b" * 64)
    assert len(a) == 2 and len(b) == 3  # only full chunks
    assert a == b[:2]
    assert c[1] != a[1]  # same chunk text after a different prefix hashes differently


def test_an_adapters_chunks_chain_from_its_name() -> None:
    """The proxy never expects an engine to hold a prefix computed through another LoRA
    adapter (or the base): the engine's blocks are partitioned by adapter too."""
    text = "a" * 64 + "b" * 64
    base, sql, chat = (routing.chunk_hashes(text, root=r) for r in (b"", b"sql", b"chat"))
    assert not {*base} & {*sql} and not {*sql} & {*chat}
    assert routing.chunk_hashes(text, root=b"sql") == sql
    idx = routing.PrefixIndex(chunk_chars=64)
    idx.record("n1", sql)
    assert idx.matched_chunks("n1", sql) == 2 and idx.matched_chunks("n1", base) == 0


def test_prefix_index_matches_leading_chunks_and_is_bounded() -> None:
    idx = routing.PrefixIndex(capacity_per_node=3, chunk_chars=4)
    chunks = routing.chunk_hashes("aaaabbbbccccdddd", 4)
    idx.record("n1", chunks[:2])
    assert idx.matched_chunks("n1", chunks) == 2
    assert idx.matched_tokens("n1", chunks) == 2 * 4 // routing.CHARS_PER_TOKEN
    assert idx.matched_chunks("n2", chunks) == 0
    other = routing.chunk_hashes("xxxxyyyy", 4)
    idx.record("n1", other)  # capacity 3: the oldest chunk (aaaa) is evicted
    assert len(idx) == 3
    assert idx.matched_chunks("n1", chunks) == 0  # the chain breaks at the first chunk
    idx.forget("n1")
    assert len(idx) == 0


def test_session_table_lru() -> None:
    t = routing.SessionTable(capacity=2)
    t.set("s1", "a")
    t.set("s2", "b")
    assert t.get("s1") == "a"  # s1 now most recent
    t.set("s3", "a")
    assert t.get("s2") is None and t.get("s1") == "a" and t.get("s3") == "a"
    t.forget_node("a")
    assert len(t) == 0


def test_score_trades_affinity_against_load() -> None:
    cold_idle = routing.Candidate("cold", load=0, cached_tokens=0)
    warm_busy = routing.Candidate("warm", load=2, cached_tokens=100)
    warm_swamped = routing.Candidate("swamped", load=8, cached_tokens=100)
    assert (
        routing.pick([cold_idle, warm_busy], 100).url == "warm"
    )  # a full hit beats 2 queued requests
    assert routing.pick([cold_idle, warm_swamped], 100).url == "cold"  # not 8
    assert routing.pick([warm_busy, cold_idle], 0).url == "cold"  # no prompt: load alone decides
    assert routing.pick([], 10) is None
    assert routing.pick([warm_busy, cold_idle], 100, "least_load").url == "cold"
    rr = [routing.pick([cold_idle, warm_busy], 0, "round_robin", turn=i).url for i in range(4)]
    assert rr == ["cold", "warm", "cold", "warm"]
    with pytest.raises(ValueError):
        routing.pick([cold_idle], 1, "bogus")


def test_conditional_disaggregation() -> None:
    assert routing.should_disaggregate(100, 0, 32)
    assert not routing.should_disaggregate(100, 90, 32)  # mostly cached on the decode engine
    assert not routing.should_disaggregate(10, 0, 32)  # short prompt
    assert routing.should_disaggregate(1, 0, 0)  # threshold 0: everything
    assert routing.uncached_tokens(50, 80) == 1


def test_disaggregatable() -> None:
    assert routing.disaggregatable("chat", {"messages": [], "max_tokens": 20}) is None
    assert routing.disaggregatable("chat", {"n": 2}) == "n > 1"
    assert routing.disaggregatable("chat", {"logprobs": True, "top_logprobs": 2}) == "logprobs"
    assert routing.disaggregatable("completions", {"prompt": ["a", "b"]}) == "several prompts"
    assert (
        routing.disaggregatable("completions", {"prompt": [1, 2, 3]}) is None
    )  # token ids, one prompt
    assert (
        routing.disaggregatable("completions", {"prompt": "a", "max_tokens": 1})
        == "max_tokens is 1"
    )
    assert routing.disaggregatable("chat", {"max_completion_tokens": 1}) == "max_tokens is 1"


# ----- registry --------------------------------------------------------------------------------
def test_parse_role_and_url() -> None:
    assert [parse_role(v) for v in (1, 2, 3, "2", None)] == [
        "both",
        "prefill",
        "decode",
        "prefill",
        "both",
    ]
    assert [parse_role(v) for v in ("Hybrid", "PREFILL", "EngineRole.Decode", "both")] == [
        "both",
        "prefill",
        "decode",
        "both",
    ]
    for bad in (0, 4, "middle", True, 1.5):
        with pytest.raises(ValueError):
            parse_role(bad)
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert normalize_url("https://x") == "https://x"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_registry_health_and_dead_nodes() -> None:
    clock = FakeClock()
    reg = Registry(dead_threshold=2, startup_grace=30, clock=clock)
    removed: list[str] = []
    reg.on_remove(lambda n: removed.append(n.url))
    p = reg.add("127.0.0.1:1", 2, ["m"])
    d = reg.add("http://127.0.0.1:2", "decode", ["m"])
    s = reg.add("http://127.0.0.1:3", "both", None, source="static")
    assert reg.routable(DECODE_ROLES) == []  # not healthy until a probe says so
    ok = {
        "status": "ok",
        "pending_requests": 3,
        "active_requests": 1,
        "role": "decode",
        "block_pool": {"free_blocks": 7, "total_blocks": 8},
    }
    for n in (p, d, s):
        reg.record_health(n.url, 200, {**ok, "role": n.role})
    assert [n.url for n in reg.routable(DECODE_ROLES)] == [d.url, s.url]
    assert [n.url for n in reg.routable(PREFILL_ROLES, "m")] == [p.url]
    assert reg.routable(PREFILL_ROLES, "other") == []
    assert reg.routable(DECODE_ROLES, "other") == [s]  # a node listing no models serves any
    assert d.pending == 3 and d.load == 3 and d.free_blocks == 7
    reg.record_health(d.url, 503, {"status": "draining"})
    assert not d.healthy and d.failures == 0 and reg.get(d.url) is not None  # not ready is not dead
    reg.record_health(d.url, None, None, error="refused")
    assert reg.get(d.url) is not None
    reg.record_health(d.url, None, None, error="refused")
    # it answered before: kept (restarting? stalled?), out of routing, expected back
    assert reg.get(d.url) is d and d.health == "dead" and reg.routable(DECODE_ROLES) == [s]
    assert reg.expected_back(DECODE_ROLES, "m")
    clock.t += 601  # down for longer than forget_after: dropped
    reg.record_health(d.url, None, None, error="refused")
    assert reg.get(d.url) is None and removed == [d.url]
    for _ in range(5):
        reg.record_failure(s.url, "refused")
    assert reg.get(s.url) is not None and not s.healthy  # static nodes stay, marked dead
    reg.record_health(s.url, 200, ok)
    assert s.healthy and s.failures == 0
    # a registered node that never answered is kept through its startup grace
    late = reg.add("http://127.0.0.1:4", "decode")
    for _ in range(5):
        reg.record_failure(late.url, "refused")
    assert reg.get(late.url) is not None
    clock.t += 31
    reg.record_failure(late.url, "refused")
    assert reg.get(late.url) is None


def test_stalled_node_is_told_from_a_dead_one_and_readmitted() -> None:
    """Issue 26: a stalled engine was dropped for good; now it is probed with a backoff,
    shown as stalled (timeout) or dead (refused), and re-admitted when it answers."""
    clock = FakeClock()
    reg = Registry(dead_threshold=2, startup_grace=30, clock=clock)
    n = reg.add("http://127.0.0.1:5", "decode", ["m"])
    assert n.health == "starting"
    reg.record_health(n.url, 200, {"status": "ok"})
    assert n.health == "healthy" and n.status()["health"] == "healthy"
    for i in range(1, 6):
        reg.record_failure(n.url, "ReadTimeout", stalled=True)
        reg.backoff(n, 2.0)
        assert n.health == "stalled" and reg.get(n.url) is n
        assert not reg.probe_due(n)
        assert n.next_probe_at - clock.t == min(8.0, 2.0 * 2 ** (i - 1))  # 2, 4, 8, 8, 8
    clock.t += 8
    assert reg.probe_due(n)
    reg.record_failure(n.url, "ConnectError")
    assert n.health == "dead" and n.status()["last_error"] == "unreachable"
    reg.record_health(n.url, 200, {"status": "ok"})
    assert n.healthy and reg.probe_due(n) and n.down_since is None
    # a node never proven to be an engine says nothing about what happened to a connection
    ghost = reg.add("http://127.0.0.1:6", "decode", ["m"])
    reg.record_failure(ghost.url, "ReadTimeout", stalled=True)
    assert ghost.health == "unreachable"


def test_registry_readd_updates_role_keeps_counters() -> None:
    reg = Registry()
    n = reg.add("http://h:1", "prefill", ["a"])
    n.inflight = 2
    again = reg.add("http://h:1/", 3, ["b"])
    assert again is n and n.role == "decode" and n.models == ["b"] and n.inflight == 2
    assert n.status()["role"] == 3 and n.status()["role_name"] == "decode"


# ----- discovery -------------------------------------------------------------------------------
def _pod(
    name: str,
    ip: str | None = "10.0.0.5",
    ready: bool = True,
    role: str | None = "decode",
    port: int | None = 8123,
    deleting: bool = False,
) -> dict:
    meta: dict = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": {}}
    if role:
        meta["labels"]["tandem.dev/role"] = role
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    ports = [{"name": "metrics", "containerPort": 9000}] + (
        [{"name": "http", "containerPort": port}] if port else []
    )
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "ports": ports}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_pod_node() -> None:
    assert pod_node(_pod("a")) == ("http://10.0.0.5:8123", "decode", None)
    assert pod_node(_pod("a", port=None))[0] == "http://10.0.0.5:8000"
    assert pod_node(_pod("a", ip="fd00::1"))[0] == "http://[fd00::1]:8123"
    assert pod_node(_pod("a", ready=False)) is None
    assert pod_node(_pod("a", ip=None)) is None
    assert pod_node(_pod("a", role=None)) is None
    assert pod_node(_pod("a", role="sideways")) is None
    assert pod_node(_pod("a", deleting=True)) is None


def test_pod_tracker() -> None:
    reg = Registry()
    t = PodTracker(reg)
    t.apply("ADDED", _pod("a", ready=False))
    assert len(reg) == 0
    t.apply("MODIFIED", _pod("a"))
    t.apply("ADDED", _pod("b", ip="10.0.0.6", role="prefill"))
    assert {n.url: n.role for n in reg.nodes()} == {
        "http://10.0.0.5:8123": "decode",
        "http://10.0.0.6:8123": "prefill",
    }
    assert all(n.source == "kubernetes" for n in reg.nodes())
    t.apply("MODIFIED", _pod("a", ready=False))  # not ready: dropped at once
    assert [n.url for n in reg.nodes()] == ["http://10.0.0.6:8123"]
    t.apply("MODIFIED", _pod("b", ip="10.0.0.7", role="prefill"))  # new IP: old node goes
    assert [n.url for n in reg.nodes()] == ["http://10.0.0.7:8123"]
    t.resync([_pod("c", ip="10.0.0.8")])
    assert [n.url for n in reg.nodes()] == ["http://10.0.0.8:8123"]
    t.apply("DELETED", _pod("c", ip="10.0.0.8"))
    assert len(reg) == 0


def test_pod_tracker_keeps_a_node_whose_ip_a_new_pod_reuses() -> None:
    """Pod IPs are reused: losing pod A must not remove the engine pod B now serves at A's URL."""
    reg = Registry()
    t = PodTracker(reg)
    t.apply("ADDED", _pod("a", ip="10.0.0.2"))
    t.resync([_pod("b", ip="10.0.0.2")])  # relist after a watch gap: A gone, B has its IP
    assert [n.url for n in reg.nodes()] == ["http://10.0.0.2:8123"]
    reg2 = Registry()
    t2 = PodTracker(reg2)
    t2.apply("ADDED", _pod("a", ip="10.0.0.2"))
    t2.apply("ADDED", _pod("b", ip="10.0.0.2"))
    t2.apply("DELETED", _pod("a", ip="10.0.0.2"))  # A's late DELETED after B took the IP
    assert [n.url for n in reg2.nodes()] == ["http://10.0.0.2:8123"]
    t2.apply("DELETED", _pod("b", ip="10.0.0.2"))
    assert len(reg2) == 0


def test_parse_node_flag() -> None:
    assert parse_node_flag("http://127.0.0.1:9=prefill") == ("http://127.0.0.1:9", "prefill")
    assert parse_node_flag("127.0.0.1:9") == ("http://127.0.0.1:9", "both")
    assert parse_node_flag("http://h:1=3") == ("http://h:1", "decode")
    with pytest.raises(ValueError):
        parse_node_flag("http://h:1=sideways")


# ----- the P/D flow's rewriting -------------------------------------------------------------------
def test_prefill_request() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "temperature": 0,
    }
    p = prefill_request(body)
    assert p == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["stream"] is True and "kv_transfer_params" not in body  # the original is untouched


def test_registration_body_is_lmdeploys() -> None:
    assert node_body("http://e:1/", "prefill", ["m"]) == {
        "url": "http://e:1",
        "status": {"models": ["m"], "role": 2},
    }
    assert node_body("http://e:1", 1, [])["status"]["role"] == 1


# ----- the app in process (no engines) -------------------------------------------------------------
def test_app_auth_validation_and_no_engines() -> None:
    app = build_app(ProxySettings(api_key="k", credentials=Credentials(admin_key="adm")))
    auth = {"Authorization": "Bearer k"}
    admin = {"Authorization": "Bearer adm"}
    r = call_app(app, "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = call_app(
        app,
        "POST",
        "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer nope"},
    )
    assert r.status_code == 401
    assert call_app(app, "GET", "/health").status_code == 503  # open, and no engine yet
    assert call_app(app, "GET", "/metrics").status_code == 200
    r = call_app(
        app,
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=auth,
    )
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    as_json = {**auth, "Content-Type": "application/json"}
    r = call_app(app, "POST", "/v1/completions", content=b"{not json", headers=as_json)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = call_app(app, "POST", "/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 415  # no Content-Type: what to send, before what is wrong in it
    r = call_app(app, "POST", "/v1/completions", json=[1, 2], headers=auth)
    assert r.status_code == 400
    r = call_app(app, "POST", "/nodes/add", json={"status": {"role": 2}}, headers=auth)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"  # a client key
    r = call_app(app, "POST", "/nodes/add", json={"status": {"role": 2}}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    r = call_app(
        app,
        "POST",
        "/nodes/add",
        json={"url": "http://127.0.0.1:9", "status": {"role": 7}},
        headers=admin,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "status.role"
    r = call_app(app, "GET", "/nope", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_app_node_routes_in_process() -> None:
    app = build_app(ProxySettings(static_nodes=[("http://127.0.0.1:9", "prefill")]))
    # port 9 (discard) is closed on loopback: the probe fails fast and the node stays unhealthy
    r = call_app(
        app,
        "POST",
        "/nodes/add",
        json={"url": "127.0.0.1:10", "status": {"models": ["m"], "role": 3}},
    )
    assert r.status_code == 200 and r.json() == {
        "url": "http://127.0.0.1:10",
        "role": 3,
        "role_name": "decode",
        "healthy": False,
    }
    status = call_app(app, "GET", "/nodes/status").json()
    assert (
        status["http://127.0.0.1:9"]["role_name"] == "prefill"
        and status["http://127.0.0.1:9"]["source"] == "static"
    )
    assert status["http://127.0.0.1:10"]["models"] == ["m"]
    r = call_app(app, "POST", "/v1/completions", json={"model": "other", "prompt": "x"})
    assert (
        r.status_code == 503
    )  # the static node lists no models: it might serve "other" once healthy
    r = call_app(app, "POST", "/nodes/remove", json={"url": "http://127.0.0.1:9"})
    assert r.json() == {"url": "http://127.0.0.1:9", "removed": True}
    assert list(call_app(app, "GET", "/nodes/status").json()) == ["http://127.0.0.1:10"]
    r = call_app(app, "POST", "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_pod_tracker_reads_each_engines_kv_layout() -> None:
    """The operator labels engine pods with their KV layout; the proxy pairs by it."""
    reg = Registry()
    t = PodTracker(reg)
    old, new = _pod("a"), _pod("b", ip="10.0.0.6", role="prefill")
    old["metadata"]["labels"]["tandem.dev/kv-layout"] = "aaa"
    new["metadata"]["labels"]["tandem.dev/kv-layout"] = "bbb"
    t.apply("ADDED", old)
    t.apply("ADDED", new)
    assert {n.role: n.kv_layout for n in reg.nodes()} == {"decode": "aaa", "prefill": "bbb"}
    new["metadata"]["labels"]["tandem.dev/kv-layout"] = "aaa"  # a relabelled pod is updated
    t.apply("MODIFIED", new)
    assert {n.kv_layout for n in reg.nodes()} == {"aaa"}


def test_plan_is_the_one_decision_both_front_doors_take() -> None:
    """The decode engine by score; a prefill engine only of its KV layout, only when the
    request can split and the decode engine would prefill at least the threshold."""
    cold = routing.Candidate("http://d1", load=0, cached_tokens=0, kv_layout="a")
    warm = routing.Candidate("http://d2", load=0, cached_tokens=100, kv_layout="b")
    prefill_a = routing.Candidate("http://p1", load=0, kv_layout="a")
    prefill_b = routing.Candidate("http://p2", load=0, kv_layout="b")
    assert routing.plan([], [prefill_a], 100) is None
    got = routing.plan([cold, warm], [prefill_a, prefill_b], 100, disagg_threshold=32)
    assert got == routing.Plan(warm)  # all of it cached on d2: nothing worth moving
    got = routing.plan([cold], [prefill_a, prefill_b], 100, disagg_threshold=32)
    assert got == routing.Plan(cold, prefill_a)  # layout a pairs with a only
    assert routing.plan([cold], [prefill_b], 100, disagg_threshold=0) == routing.Plan(cold)
    assert routing.plan([cold], [prefill_a], 100, why_not="n > 1") == routing.Plan(cold)
