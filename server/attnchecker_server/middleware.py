"""Pure ASGI middleware: the body-size limit (before anything parses) and the ingest request metrics."""

import json
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import IngestMetrics

__all__ = ["BodyLimitMiddleware", "IngestMetricsMiddleware"]


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """413 for bodies over max_bytes, by Content-Length or, for chunked uploads, by the bytes actually received.

    The body is buffered (it is at most max_bytes) so the 413 goes out before the route has seen any of it.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> dict[str, Any]:
        return {
            "detail": f"request body is larger than {self.max_bytes} bytes (ATTNCHECKER_MAX_BODY_BYTES); "
            "send fewer events per batch"
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "Content-Length is not a number"})
                    return
                if declared > self.max_bytes:
                    await _send_json(send, 413, self._too_large())
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_json(send, 413, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# (method, path pattern) -> endpoint label; anything else is not ingest and not measured here.
_INGEST_ROUTES = (
    ("POST", re.compile(r"^/api/v1/runs/?$"), "register"),
    ("POST", re.compile(r"^/api/v1/runs/[^/]+/finish$"), "finish"),
    ("POST", re.compile(r"^/api/v1/runs/[^/]+/events:batch$"), "events"),
    ("POST", re.compile(r"^/api/v1/runs/[^/]+/stats$"), "stats"),
)


class IngestMetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: IngestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http":
            endpoint = next(
                (
                    label
                    for method, pattern, label in _INGEST_ROUTES
                    if scope["method"] == method and pattern.match(scope["path"])
                ),
                None,
            )
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.duration.labels(endpoint).observe(time.perf_counter() - start)
