"""pdserve_http_requests_total: every HTTP answer of the gateway counted by route template and status code."""

from __future__ import annotations

import httpx

from tests.gateway.test_endpoints import _samples


def _count(samples: dict, method: str, route: str, code: str) -> float:
    return samples.get(("pdserve_http_requests_total", (("code", code), ("method", method), ("route", route))), 0)


def test_responses_are_counted_by_route_template_and_status(gateway):
    h = gateway(max_body_bytes=1000)
    with httpx.Client(base_url=h.url, timeout=10) as http:
        before = _samples(http)
        assert http.get("/v1/models").status_code == 200
        assert http.get("/v1/requests/req-nope/events").status_code == 404  # a path parameter: not a new label
        assert http.get("/no/such/path").status_code == 404
        too_big = http.post("/v1/chat/completions", content=b"x" * 2000, headers={"content-type": "application/json"})
        assert too_big.status_code == 413  # answered by the body-limit middleware, still counted
        after = _samples(http)
    grew = lambda method, route, code: _count(after, method, route, code) - _count(before, method, route, code)
    assert grew("GET", "/v1/models", "200") == 1
    assert grew("GET", "/v1/requests/{request_id}/events", "404") == 1
    assert grew("GET", "other", "404") == 1
    assert grew("POST", "other", "413") == 1  # refused before routing
    routes = {dict(labels)["route"] for name, labels in after if name == "pdserve_http_requests_total"}
    assert not any("req-nope" in r or "no/such" in r for r in routes)
