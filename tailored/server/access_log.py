"""One log line per HTTP request (`tailored serve --access-log on`, the default): what a client
framework sent and what it got, e.g.

    127.0.0.1:50412 "POST /v1/chat/completions" 200 stream prompt_tokens=25
        completion_tokens=16 0.412s

method and path, the status code, "stream" for an SSE answer, the prompt and completion tokens
of a generation route (prompt tokens count each prompt once; completion tokens are the ones
the engine produced over every choice, to the end of the stream or the client's leaving), and
the latency from the request's arrival to the end of its answer (a stream's last event). A
request the server refused has no token counts. `/health`, `/metrics` and `/v1/loads` (polled
by load balancers, scrapers and gateways) are logged at DEBUG, everything else at INFO, under the logger
`tailored.server.access_log`. uvicorn's own access log stays off: it logs a stream when its
headers go out, before any token.

The generation routes tell the line their counts through the request's state
(`record(request, prompt_tokens, trackers)`: metrics.RequestMetrics count the tokens).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

QUIET_PATHS = ("/health", "/metrics", "/v1/loads")  # logged at DEBUG (polled)
_KEY = "tailored_access"  # the request state's key of a generation route's counts


def record(request, prompt_tokens: int, trackers) -> None:
    """A generation route's counts for its access line: its prompt tokens and the trackers
    (metrics.RequestMetrics) of its engine requests, read when the answer ended."""
    request.state.tailored_access = (prompt_tokens, trackers)


class AccessLog:
    """ASGI middleware that writes each HTTP request's line once its answer ended."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        seen = {"status": 500, "stream": False}

        async def watch(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                headers = dict(message.get("headers") or ())
                seen["stream"] = headers.get(b"content-type", b"").startswith(
                    b"text/event-stream")
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            try:
                self._log(scope, seen, time.monotonic() - start)
            except Exception:  # noqa: BLE001 - a log line never fails a request
                logger.debug("access log line failed", exc_info=True)

    @staticmethod
    def _log(scope, seen: dict, seconds: float) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not logger.isEnabledFor(level):
            return
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        parts = [f'{who} "{scope.get("method", "")} {path}" {seen["status"]}']
        if seen["stream"]:
            parts.append("stream")
        counts = (scope.get("state") or {}).get(_KEY)
        if counts is not None:
            prompt_tokens, trackers = counts
            completion = sum(t.completion_tokens for t in trackers)
            parts.append(f"prompt_tokens={prompt_tokens} completion_tokens={completion}")
        parts.append(f"{seconds:.3f}s")
        logger.log(level, " ".join(parts))
