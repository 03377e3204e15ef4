"""HTTP responses by route and status code: ``pdserve_http_requests_total{method, route, code}``.

The outermost middleware, so it also counts what the others answer (413 from the
body limit, 4xx/5xx from the error handlers). ``route`` is the matched route's
template (``/v1/requests/{request_id}/events``), never the raw path, so a scan of
random URLs cannot grow the label set; unmatched paths count as ``other``. A
stream's status is the one sent when it starts: an error inside an SSE stream
is an error event under a 200.
"""

from __future__ import annotations

from prometheus_client import Counter

HTTP_REQUESTS = Counter("pdserve_http_requests_total", "HTTP responses of the gateway by route and status code.",
                        ["method", "route", "code"])


class HttpMetricsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        code = "500"  # nothing was sent: the application failed before answering

        async def recording_send(message):
            nonlocal code
            if message["type"] == "http.response.start":
                code = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "other"
            HTTP_REQUESTS.labels(scope.get("method", "GET"), template, code).inc()
