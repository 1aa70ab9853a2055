"""A bounded soak (tests/helpers/soak.py) against the shared live server: 2,000 mixed requests, 64 at a
time, with abandoned streams and plain requests and invalid ones among them. No request may end
in any other way than asked; afterwards no request runs, the KV cache is empty, and the server's
threads and memory stay within a bound."""

from __future__ import annotations

import pytest

from tests.helpers.live_server import API_KEY
from tests.helpers.soak import soak_figures


@pytest.mark.slow
def test_soak_2000_mixed_requests(server):
    figures = soak_figures(server.url, API_KEY, server.model, server.proc.pid, requests=2000, concurrency=64)
    print(figures)
    assert figures["errors"] == 0, figures["error_samples"][:5]
    assert figures["ok"] + figures["abandoned"] + figures["rejected"] == 2000
    assert figures["ok"] > 1500 and figures["abandoned"] > 100 and figures["rejected"] > 50
    before, after = figures["before"], figures["after"]
    assert after["running"] == after["waiting"] == 0 and after["kv_cache_usage"] == 0.0
    assert after["threads"] <= before["threads"] + 4  # no thread per request left behind
    assert after["rss_mib"] <= before["rss_mib"] * 1.25 + 64  # no memory per request left behind
    server.assert_healthy()
