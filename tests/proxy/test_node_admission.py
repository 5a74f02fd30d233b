"""The admin key cannot make the proxy leak the internal credential (issue "No client can hurt
another", finding B; docs/security.md, docs/proxy.md).

The proxy runs in process and every request it makes goes to a recording mock transport, so
no test here ever lets it contact a link-local or outside address: a refusal is checked by
the answer of the validation and by the recorder staying empty.
"""

from __future__ import annotations

import asyncio
import ipaddress

import httpx
import pytest

from tandem.server.proxy.app import build_app
from tandem.server.proxy.node_address import NodeNetworks, parse_networks
from tandem.server.proxy.pd_flow import FlowConfig
from tandem.server.proxy.registry import normalize_url
from tandem.server.proxy.state import ProxySettings
from tandem.server.wire.auth import Credentials, key_owner
from tandem.server.wire.trust import CHALLENGE_HEADER, PROOF_HEADER, node_proof

INTERNAL, ADMIN = "sk-internal-nodes", "sk-admin-nodes"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


class Engines:
    """Stands in for the network: ``answers`` maps a node URL to how it answers ``/health``
    (``"proof"``: an engine holding the credential; ``"plain"``: some other HTTP server;
    absent: connection refused). Every request is recorded with its headers."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        base = f"{request.url.scheme}://{request.url.netloc.decode()}"
        kind = self.answers.get(base)
        if kind is None:
            raise httpx.ConnectError("Connection refused", request=request)
        headers = {}
        if kind == "proof" and request.url.path == "/health":
            headers[PROOF_HEADER] = node_proof(INTERNAL, request.headers[CHALLENGE_HEADER])
        return httpx.Response(200, json={"status": "ok", "model": "m"}, headers=headers)

    def credentialed(self) -> list[str]:
        return [str(r.url) for r in self.seen if "authorization" in r.headers]


def _proxy(engines: Engines, networks: NodeNetworks | None = None):
    settings = ProxySettings(
        credentials=Credentials(internal_key=INTERNAL, admin_key=ADMIN),
        flow=FlowConfig(engine_api_key=INTERNAL),
        node_networks=networks or NodeNetworks(),
    )
    app = build_app(settings)
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    app.state.proxy.client = app.state.proxy.poller.client = app.state.proxy.flow.client = client
    return app


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return await c.request(method, path, headers=AS_ADMIN, **kw)

    return asyncio.run(go())


def _add(app, url: str) -> httpx.Response:
    return _call(app, "POST", "/nodes/add", json={"url": url, "status": {"role": 1}})


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8001/v1",
        "http://127.0.0.1:8001/?x=1",
        "http://127.0.0.1:8001#frag",
        "http://user:pw@127.0.0.1:8001",
        "http://127.0.0.1:8001@evil.example",
    ],
)
def test_a_node_is_a_scheme_host_and_port(url: str) -> None:
    engines = Engines({})
    app = _proxy(engines)
    r = _add(app, url)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "url" and err["code"] == "invalid_value" and err["type"]
    assert engines.seen == [] and _call(app, "GET", "/nodes/status").json() == {}
    with pytest.raises(ValueError):
        normalize_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254",  # cloud metadata
        "http://169.254.1.1:8000",
        "http://[fe80::1]:8000",
        "http://[::ffff:169.254.169.254]",
        "http://100.100.100.200",  # Alibaba's metadata
        "http://[fd00:ec2::254]",  # AWS's IPv6 metadata, inside fc00::/7
        "http://0.0.0.0:8000",
        "http://8.8.8.8:8000",  # outside the allowed networks
        "http://[2001:4860::1]:8000",
    ],
)
def test_link_local_metadata_and_outside_addresses_are_refused(url: str) -> None:
    engines = Engines({})
    app = _proxy(engines)
    r = _add(app, url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
    assert engines.seen == [] and _call(app, "GET", "/nodes/status").json() == {}


def test_allowed_networks_are_configurable_but_link_local_never() -> None:
    wide = NodeNetworks(parse_networks("0.0.0.0/0,::/0"))
    assert wide.problem(ipaddress.ip_address("8.8.8.8")) is None
    assert wide.problem(ipaddress.ip_address("169.254.169.254")) is not None
    assert wide.problem(ipaddress.ip_address("fe80::1")) is not None
    narrow = NodeNetworks(parse_networks("10.1.0.0/16"))
    assert narrow.problem(ipaddress.ip_address("10.1.2.3")) is None
    assert narrow.problem(ipaddress.ip_address("127.0.0.1")) is not None
    default = NodeNetworks()
    for ok in ("127.0.0.1", "::1", "10.4.0.7", "172.20.1.1", "192.168.1.9", "fd12::3"):
        assert default.problem(ipaddress.ip_address(ok)) is None, ok
    with pytest.raises(ValueError):
        parse_networks("10.0.0.0/8,not-a-cidr")


def test_localhost_by_name_is_a_loopback_node() -> None:
    engines = Engines({"http://localhost:8123": "proof"})
    app = _proxy(engines)
    r = _add(app, "localhost:8123")
    assert r.status_code == 200 and r.json()["healthy"] is True


def test_the_credential_goes_only_to_nodes_that_proved_they_hold_it() -> None:
    engines = Engines({"http://127.0.0.1:8001": "proof", "http://127.0.0.1:8002": "plain"})
    app = _proxy(engines)
    assert _add(app, "127.0.0.1:8001").json()["healthy"] is True
    assert _add(app, "127.0.0.1:8002").json()["healthy"] is False  # answered, proved nothing
    assert _add(app, "127.0.0.1:8003").json()["healthy"] is False  # refused
    # the polls carried a challenge and no credential
    assert engines.seen and engines.credentialed() == []
    status = _call(app, "GET", "/nodes/status").json()
    # an answer without proof and a refused connection read the same: no port-scan oracle
    assert status["http://127.0.0.1:8002"]["last_error"] == "unreachable"
    assert status["http://127.0.0.1:8003"]["last_error"] == "unreachable"
    assert status["http://127.0.0.1:8001"]["last_error"] is None
    for url in ("http://127.0.0.1:8002", "http://127.0.0.1:8003"):
        r = _call(app, "POST", "/nodes/terminate", json={"url": url})
        assert r.json() == {
            "url": url,
            "was_registered": True,
            "terminated": False,
            "detail": "unreachable",
        }
    assert engines.credentialed() == []  # terminate sent the unproven nodes nothing
    r = _call(app, "POST", "/nodes/terminate", json={"url": "http://127.0.0.1:8001"})
    assert r.json()["terminated"] is True
    assert engines.credentialed() == ["http://127.0.0.1:8001/terminate"]


def test_the_proxy_names_its_callers_cache_partition_to_engines() -> None:
    """Finding A behind the proxy: engines see only the internal credential, so the proxy
    forwards whose request it is; a client's own X-Tandem-Tenant header is not believed."""
    engines = Engines({"http://127.0.0.1:8001": "proof"})
    settings = ProxySettings(
        credentials=Credentials(
            client_keys=frozenset({"sk-a", "sk-b"}), internal_key=INTERNAL, admin_key=ADMIN
        ),
        flow=FlowConfig(engine_api_key=INTERNAL),
    )
    app = build_app(settings)
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    app.state.proxy.client = app.state.proxy.poller.client = app.state.proxy.flow.client = client
    assert _add(app, "127.0.0.1:8001").json()["healthy"] is True
    tenants = []
    for key in ("sk-a", "sk-b"):
        body = {"model": "m", "prompt": "x", "max_tokens": 1}

        async def go(key: str = key, body: dict = body) -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                headers = {"Authorization": f"Bearer {key}", "X-Tandem-Tenant": "forged"}
                return await c.post("/v1/completions", json=body, headers=headers)

        assert asyncio.run(go()).status_code == 200
        sent = engines.seen[-1]
        assert sent.url.path == "/v1/completions"
        tenants.append(sent.headers["x-tandem-tenant"])
    assert tenants == [key_owner(b"Bearer sk-a"), key_owner(b"Bearer sk-b")]
