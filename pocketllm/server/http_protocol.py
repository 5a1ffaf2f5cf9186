"""uvicorn's HTTP/1.1 protocol (h11) with every answer of its own in the OpenAI error shape: a request the
parser refuses (a bad request line, a header value holding a control byte, a path that is not ASCII, headers
past the size limit) is a JSON 400 instead of uvicorn's plain text, a request line of another HTTP major version
(an HTTP/2 client's prior-knowledge preface, ``PRI * HTTP/2.0``, say) is one JSON 505 and the connection is
closed, and an app that fails or returns before it has answered is a JSON 500. A request must arrive whole,
headers and body, within ``REQUEST_READ_TIMEOUT`` seconds of the connection opening or of the previous
response's end; a request cut short then is a 408 and its connection is closed. ``uvicorn_config`` builds the
server's configuration with it."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from pocketllm.server.errors import JSONResponse, error_body, error_response

logger = logging.getLogger("pocketllm.server")

MALFORMED = "the HTTP request is malformed and cannot be read"
REQUEST_READ_TIMEOUT = 30.0
# C0 controls but horizontal tab, and DEL; h11 refuses only NUL (bytes from 0x80 are obs-text, which HTTP allows)
CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
HTTP_VERSION_NOT_SUPPORTED = 505


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


class CheckedConnection(h11.Connection):
    """h11's connection that also refuses header values holding a control byte and request lines of an HTTP
    major version other than 1 (h11 reads any ``HTTP/x.y``), and counts its cycles (one request and its
    response each). ``refusal`` keeps the version refusal, whose status (505) is not uvicorn's 400."""

    def __init__(self, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self.cycles = 0
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            if not event.http_version.startswith(b"1."):
                version = event.http_version.decode("ascii", "replace").removesuffix(".0")
                self.refusal = h11.RemoteProtocolError(
                    f"HTTP/{version} is not supported: this server speaks HTTP/1.1 only. Send the request over "
                    "HTTP/1.1", error_status_hint=HTTP_VERSION_NOT_SUPPORTED)
                raise self.refusal
            if any(CONTROL_BYTE.search(value) for _, value in event.headers):
                raise h11.RemoteProtocolError("a header value holds a control byte")
        return event

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self.cycles += 1


class OpenAIErrorsH11Protocol(H11Protocol):
    """``H11Protocol`` whose refusals of unreadable requests are JSON in the OpenAI shape, and which closes a
    connection whose request has not arrived whole within ``read_timeout`` seconds."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None,
                 read_timeout: float = REQUEST_READ_TIMEOUT) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.app = AnswerGuard(self.app)
        limit = config.h11_max_incomplete_event_size
        self.conn = CheckedConnection(DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit)
        self.read_timeout = read_timeout
        self.read_deadline: asyncio.TimerHandle | None = None
        self.read_deadline_cycle = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except Exception as exc:   # a request h11 parsed but uvicorn cannot make a scope of (a non-ASCII path)
            logger.warning("an unreadable HTTP request: %s", type(exc).__name__)
            self.send_400_response(MALFORMED)
        self._watch_request()

    def _watch_request(self) -> None:
        """Runs the read deadline while a request is awaited or arriving, from the start of its cycle (the
        connection opening or the previous response's end), and stops it once the request is whole."""
        awaited = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if self.read_deadline is not None and (not awaited or self.read_deadline_cycle != self.conn.cycles):
            self._stop_read_deadline()
        if awaited and self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
            self.read_deadline_cycle = self.conn.cycles

    def _stop_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        """A 408 for a request begun but not whole (a connection that sent nothing is only closed)."""
        self.read_deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection whose request did not arrive within %g s", self.read_timeout)
        if self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            self._refuse(408, f"the request did not arrive whole within {self.read_timeout:g} s")
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A 400 in the OpenAI shape (or the connection's own refusal: a 505 for another HTTP version), then the
        connection is closed (as uvicorn does)."""
        refusal = self.conn.refusal
        if refusal is not None:
            self._refuse(refusal.error_status_hint, str(refusal))
        else:
            self._refuse(400, MALFORMED)

    def _refuse(self, status: int, message: str) -> None:
        """An error in the OpenAI shape (nothing when a response has begun on this connection), then the
        connection is closed."""
        body = JSONResponse(error_body(status, message)).body
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:   # a response had already begun on this connection: nothing more fits
            pass
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        logger.debug("an upgrade request answered as plain HTTP")


def uvicorn_config(app: Any, read_timeout: float = REQUEST_READ_TIMEOUT, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: HTTP/1.1 through ``OpenAIErrorsH11Protocol`` (requests read within
    ``read_timeout`` seconds) and no WebSocket handling (the server has no WebSocket route; an upgrade request is
    answered as plain HTTP)."""
    protocol = functools.partial(OpenAIErrorsH11Protocol, read_timeout=read_timeout)
    return uvicorn.Config(app, http=protocol, ws="none", **options)  # type: ignore[arg-type]
