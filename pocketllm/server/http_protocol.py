"""uvicorn's HTTP/1.1 protocol (h11) with every answer of its own in the OpenAI error shape: a request the
parser refuses (a bad request line, a header holding a control byte, a path that is not ASCII, headers past
the size limit) is a JSON 400 instead of uvicorn's plain text, and an app that fails or returns before it has
answered is a JSON 500. ``uvicorn_config`` builds the server's configuration with it."""

from __future__ import annotations

import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pocketllm.server.errors import JSONResponse, error_body, error_response

logger = logging.getLogger("pocketllm.server")

MALFORMED = "the HTTP request is malformed and cannot be read"


class AnswerGuard:
    """Plain ASGI around the whole app: an exception or a return before ``http.response.start`` is answered
    with a 500 in the OpenAI shape (uvicorn would send plain text)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            if started:   # uvicorn closes the connection of a response cut short
                raise
            logger.error("the app failed before answering", exc_info=exc)
            await error_response(500, f"internal error: {type(exc).__name__}")(scope, receive, send)
            return
        if not started:
            await error_response(500, "internal error: the request got no answer")(scope, receive, send)


class OpenAIErrorsH11Protocol(H11Protocol):
    """``H11Protocol`` whose refusals of unreadable requests are JSON in the OpenAI shape."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = AnswerGuard(self.app)

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except Exception as exc:   # a request h11 parsed but uvicorn cannot make a scope of (a non-ASCII path)
            logger.warning("an unreadable HTTP request: %s", type(exc).__name__)
            self.send_400_response(MALFORMED)

    def send_400_response(self, msg: str) -> None:
        """A 400 in the OpenAI shape, then the connection is closed (as uvicorn does)."""
        body = JSONResponse(error_body(400, MALFORMED)).body
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:   # a response had already begun on this connection: nothing more fits
            pass
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        logger.debug("an upgrade request answered as plain HTTP")


def uvicorn_config(app: Any, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: HTTP/1.1 through ``OpenAIErrorsH11Protocol`` and no WebSocket
    handling (the server has no WebSocket route; an upgrade request is answered as plain HTTP)."""
    return uvicorn.Config(app, http=OpenAIErrorsH11Protocol, ws="none", **options)
