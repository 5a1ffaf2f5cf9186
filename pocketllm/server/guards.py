"""Plain ASGI middleware that refuses a request before any route runs: a body over the size limit (413) and a
browser request from a foreign ``Host`` or ``Origin`` (403), in the OpenAI error shape."""

from __future__ import annotations

import logging

from pocketllm.server.errors import JSONResponse, error_response
from pocketllm.server.exposure import ExposurePolicy

logger = logging.getLogger("pocketllm.server")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20


class BodyTooLarge(Exception):
    """Raised from ``receive`` once the body read so far passes the limit."""


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class BodyLimitMiddleware:
    """Refuses a body larger than ``limit`` bytes with a 413: at once when ``Content-Length`` says so (the body
    is never read), else as soon as the chunks received pass the limit (nothing more is read)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _refusal(self) -> JSONResponse:
        """The 413, which closes the connection (the rest of the body is never read)."""
        response = error_response(413, f"the request body is larger than {self.limit} bytes (--max-request-bytes)")
        response.headers["connection"] = "close"
        return response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            await self._refusal()(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if started:   # a route that answered before reading its whole body: nothing more can be said
                logger.warning("a request body passed %d bytes after its response had started", self.limit)
                return
            await self._refusal()(scope, receive, send)


class ExposureMiddleware:
    """Refuses HTTP requests and WebSocket upgrades whose ``Host`` or ``Origin`` the policy does not allow."""

    def __init__(self, app, policy: ExposurePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = _header(scope, b"host")
            problem = self.policy.host_refusal(host) or self.policy.origin_refusal(_header(scope, b"origin"), host)
            if problem is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008, "reason": "forbidden"})
                    return
                await error_response(403, problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)
