"""A proxy with no engine running (a pool scaled to zero): a clear 503 with Retry-After, and
the demand counted in the metric that activates the pool."""

from __future__ import annotations

import openai
import pytest

from .utils import PROXY_KEY, ProxyProcess, metric_value

pytestmark = pytest.mark.timeout(120)


def test_no_engine_answers_503_with_retry_after_and_counts_the_demand(tmp_path) -> None:
    proxy = ProxyProcess(log_path=tmp_path / "proxy.log")
    try:
        proxy.wait_nodes(lambda nodes: not nodes)  # up, and no engine known
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=PROXY_KEY, max_retries=0)
        before = metric_value(proxy.metrics(), "tandem_proxy_unserved_requests_total")
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as exc:
                client.completions.create(model="tiny", prompt="hi", max_tokens=2)
            err = exc.value
            assert err.status_code == 503
            assert err.response.headers["retry-after"] == "15"
            assert err.body["code"] == "no_engine_available"
            assert "scaled to zero" in err.message and "retry after 15 seconds" in err.message
        after = metric_value(proxy.metrics(), "tandem_proxy_unserved_requests_total")
        assert after - before == 2
    finally:
        proxy.stop()
